"""How many CPU blocks of a sized model (``sizing.KVSizing``) fit in host
memory: the worker's host-memory guard (``host_guard``) applied ahead of
time, for the doctor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_ascend.kv_offload import host_guard, host_ledger
from vllm_ascend.kv_offload.config_sizes import SizingError

if TYPE_CHECKING:
    from vllm_ascend.kv_offload.sizing import KVSizing


@dataclass(frozen=True)
class HostFit:
    """The largest pool the worker's host-memory guard would accept now."""

    available_bytes: int  # host memory available when measured
    reserved_bytes: int  # subtracted first (e.g. the CPU backend's KV cache)
    usable_bytes: int  # what the guard leaves for this engine's pools
    workers_on_host: int  # pools allocated on this host
    max_num_cpu_blocks: int
    cpu_bytes_to_use: int  # max_num_cpu_blocks in cpu_bytes_to_use's unit
    other_pools_bytes: int = 0  # live pools of other engines on this host
    host_budget_bytes: int | None = None  # host_guard.HOST_BUDGET_ENV


def fit_host_memory(
    sizing: KVSizing,
    *,
    reserved_bytes: int = 0,
    workers_on_host: int | None = None,
    available_bytes: int | None = None,
    other_pools: Sequence[host_guard.Reserved] | None = None,
) -> HostFit:
    """The largest ``num_cpu_blocks`` the worker's host-memory guard
    accepts with the host memory available now (or ``available_bytes``),
    less ``reserved_bytes`` for what will be allocated before the pool (the
    KV cache of vLLM's CPU backend, weights), next to the host's live pools
    (``other_pools``; by default those in the host's ledger when measuring
    now, none when ``available_bytes`` is given), within the host budget.

    ``workers_on_host`` (default: one per stored copy: every tensor-parallel
    worker, or one region they share for MLA) pools of this engine share
    this host: the result is what all of them together leave room for.
    """
    workers = workers_on_host
    if workers is None:
        workers = sizing.stored_copies
    if workers < 1:
        raise SizingError(f"workers_on_host={workers} must be >= 1")
    try:
        cap = host_guard.budget_cap()
        if available_bytes is None:
            available_bytes = host_guard.host_available_bytes()
            if other_pools is None:
                other_pools = host_ledger.live_pools()
    except ValueError as e:  # a setting that is not one
        raise SizingError(str(e)) from None
    budget = host_guard.HostBudget(available_bytes, other_pools or (), cap)
    # What the pools may take once the engine's memory is allocated, less
    # what the other pools take (the worker's check: host_guard.check_pool).
    limit = host_guard.usable_bytes(available_bytes + budget.held, reserved_bytes, cap)
    usable = max(0, limit - budget.others_bytes)
    blocks = usable // (sizing.worker_bytes_per_cpu_block * workers)
    return HostFit(
        available_bytes=available_bytes,
        reserved_bytes=reserved_bytes,
        usable_bytes=usable,
        workers_on_host=workers,
        max_num_cpu_blocks=blocks,
        cpu_bytes_to_use=blocks * sizing.bytes_per_cpu_block,
        other_pools_bytes=budget.others_bytes,
        host_budget_bytes=cap,
    )
