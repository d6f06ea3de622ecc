"""The host-memory guard: how much host memory CPU block pools may take, and
the messages that refuse a pool that does not fit.

The one place for this arithmetic (``HostBudget.room``): the worker checks
its pool with it right before allocating it (``npu.py``, with the host's
other pools read from ``host_ledger``), the doctor applies it ahead of time
(``fit_host_memory``), and so do the examples (``auto_num_cpu_blocks``,
``examples/kv_offload_sizing.py``). It imports neither vLLM nor torch: the
examples size a configuration before vLLM is imported.

**The budget.** All CPU pools of a host together may take at most
``MAX_HOST_MEMORY_FRACTION`` of the host memory there is for them; the rest
is headroom for the engines, their tokenizers and the OS. The memory there
is for them is what the kernel reports available now (``MemAvailable``)
plus what the live pools already hold. Each pool is counted once: an
allocated pool (faulted in) is gone from ``MemAvailable``, so its bytes are
added back and counted among the pools; a pool that is only reserved (its
worker passed the check and is allocating it) is not gone yet, and is
counted among the pools only. A pool being faulted in while another worker
checks is, for a moment, counted twice: the error is on the safe side.
``HOST_BUDGET_ENV`` caps the total further (unset: no cap).

One worker alone, on a host with no other pool, is checked exactly as
before the budget existed: its pool within 90 % of the memory available.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

from vllm_ascend.kv_offload import host_ledger
from vllm_ascend.kv_offload.config_sizes import SizingError

if TYPE_CHECKING:
    from vllm_ascend.kv_offload.sizing import KVSizing

# The pools may take at most this share of the host memory there is for them.
MAX_HOST_MEMORY_FRACTION = 0.9
# "auto" pool sizing takes this share of the largest pool the guard accepts,
# so that the host stays usable next to the engine.
AUTO_POOL_SHARE = 0.5
# Where vLLM's CPU backend sizes its KV cache (GiB), besides kv_cache_memory_bytes.
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
# The most host memory all CPU pools of this host may take together (bytes,
# or a number with K/M/G/T, binary units). Unset: no cap but the fraction.
HOST_BUDGET_ENV = "VLLM_ASCEND_KV_OFFLOAD_HOST_BUDGET"

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def host_available_bytes() -> int:
    """Host memory available now (a function so that tests can replace it)."""
    return int(psutil.virtual_memory().available)


def show(nbytes: float) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.2f} MiB"


def parse_bytes(text: str) -> int:
    """``1073741824``, ``512MiB``, ``4G``, ``1.5GiB`` -> bytes; ValueError
    naming the forms accepted."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgtKMGT]?)(i?[bB])?\s*", text)
    if m is None:
        raise ValueError(
            f"{text!r} is not a size: give bytes, or a number with K/M/G/T "
            "(binary units), e.g. 512MiB or 4G"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def size_flag(text: str) -> int:
    """``parse_bytes`` as an argparse ``type`` for a size > 0 (argparse
    prints an ArgumentTypeError's message, not a ValueError's)."""
    try:
        value = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be > 0")
    return value


def budget_cap() -> int | None:
    """``HOST_BUDGET_ENV`` in bytes, None when unset."""
    text = os.environ.get(HOST_BUDGET_ENV, "").strip()
    if not text:
        return None
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise ValueError(
            f"{HOST_BUDGET_ENV}={text!r}: {e}; or unset it (then the CPU pools "
            f"of this host may take {MAX_HOST_MEMORY_FRACTION:.0%} of the host "
            "memory available)"
        ) from None


def usable_bytes(available: int, reserved: int = 0, cap: int | None = None) -> int:
    """The most the pools may take together once ``reserved`` of the
    ``available`` host memory is allocated (weights, the host KV cache of
    vLLM's CPU backend), within ``cap``."""
    usable = int(max(0, available - reserved) * MAX_HOST_MEMORY_FRACTION)
    return usable if cap is None else min(usable, cap)


@dataclass(frozen=True)
class PoolRequest:
    """One worker's CPU block pool, as the user asked for it."""

    num_blocks: int
    row_bytes: int  # host bytes of one CPU block in this worker's pool
    key: str  # the setting that sized it: num_cpu_blocks or cpu_bytes_to_use
    setting: str  # that setting as the user wrote it, for the messages
    # Bytes of one CPU block over all workers, padded: cpu_bytes_to_use's unit.
    all_workers_block_bytes: int
    blocks_per_chunk: int
    chunk_key: str  # the setting that sized a CPU block: block_size or blocks_per_chunk
    device_block_tokens: int

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.row_bytes


@dataclass(frozen=True)
class HostBudget:
    """The host's memory for CPU pools at one moment, and the pools in it."""

    available: int  # MemAvailable now
    others: Sequence[host_ledger.Reserved] = ()
    cap: int | None = None
    reserved: int = 0  # to be allocated before the pool (the engine's memory)

    @property
    def held(self) -> int:
        """Bytes the other pools hold already (gone from ``available``)."""
        return sum(o.nbytes for o in self.others if o.allocated)

    @property
    def others_bytes(self) -> int:
        return sum(o.nbytes for o in self.others)

    @property
    def limit(self) -> int:
        """The most all pools of the host may take together."""
        return usable_bytes(self.available + self.held, self.reserved, self.cap)

    def room(self, engine_id: str = "") -> int:
        """What the limit leaves for one engine's pools next to the others
        (those of ``engine_id``, its own, not counted)."""
        own = [o.nbytes for o in self.others if engine_id and o.engine_id == engine_id]
        return max(0, self.limit - self.others_bytes + sum(own))

    @property
    def cap_binds(self) -> bool:
        return self.cap is not None and self.limit == self.cap


def auto_num_cpu_blocks(
    block_bytes: int, budget: HostBudget, share: float = AUTO_POOL_SHARE
) -> int:
    """``num_cpu_blocks`` for an "auto" setting (the examples'
    ``--num-cpu-blocks auto``): ``share`` of the largest pool the guard
    accepts in ``budget`` (its ``reserved``: the engine's weights, the host
    KV cache of vLLM's CPU backend, its processes)."""
    if not 0 < share <= 1:
        raise SizingError(f"share={share} must be in (0, 1]")
    return int(budget.room() * share) // block_bytes


def check_pool(
    pool: PoolRequest,
    budget: HostBudget,
    *,
    engine_id: str = "",
    workers: int = 1,
    host_kv_bytes: int = 0,
) -> str | None:
    """Why ``pool`` does not fit next to the host's other pools, naming the
    total and the setting to lower and by how much; None when it fits.

    ``workers``: this engine's workers on this host (each with a pool like
    this one): the fix is a value all of them fit with. ``host_kv_bytes``:
    this worker's device KV cache in host memory, offered as the other fix.
    """
    need, limit = pool.nbytes, budget.limit
    total = need + budget.others_bytes
    if total <= limit:
        return None
    ours = [o for o in budget.others if engine_id and o.engine_id == engine_id]
    workers = max(workers, len(ours) + 1)
    fit = budget.room(engine_id) // (workers * pool.row_bytes)
    asked = (
        f"{pool.setting} asks for a CPU pool of {show(need)} "
        f"({pool.num_blocks} blocks of {pool.row_bytes} bytes)"
    )
    room = _room(budget)
    if pool.row_bytes > limit:
        return (
            f"{asked}, but one CPU block ({pool.row_bytes} bytes) alone is more "
            f"than {room}: no pool fits; make CPU blocks smaller "
            f"({_smaller_blocks(pool)}), or free host memory"
        )
    if budget.others:
        n = len(budget.others)
        asked += (
            f"; with the {n} other CPU pool{'s' if n > 1 else ''} of this host "
            f"({show(budget.others_bytes)}, {show(budget.held)} of it allocated) "
            f"the pools would take {show(total)}"
        )
    if fit == 0:
        return (
            f"{asked}, more than {room}: the other pools leave no room for "
            f"this engine's {workers} worker(s); stop engines or lower their "
            f"pools, {_raise_cap(budget, total)}or free host memory"
        )
    lowered = (
        f"lower num_cpu_blocks to {fit}"
        if pool.key == "num_cpu_blocks"
        else f"lower cpu_bytes_to_use to {fit * pool.all_workers_block_bytes}"
    )
    if workers > 1:
        lowered += (
            f" (this engine's {workers} workers on this host then take "
            f"{show(workers * fit * pool.row_bytes)})"
        )
    kv_fix = _kv_cache_fix(total, budget, host_kv_bytes, workers)
    return (
        f"{asked}, more than {room}; {lowered}{kv_fix}, "
        f"{_raise_cap(budget, total)}or free host memory"
    )


def passed(pool: PoolRequest, budget: HostBudget) -> str:
    """The log line of a pool that fits."""
    others = ""
    if budget.others:
        others = (
            f" next to {len(budget.others)} other pool(s) of this host "
            f"({show(budget.others_bytes)})"
        )
    return (
        f"KV offload: host memory check passed: {pool.num_blocks} CPU blocks "
        f"({show(pool.nbytes)}){others} fit in {_room(budget)}"
    )


def _room(budget: HostBudget) -> str:
    if budget.cap_binds:
        return f"the host budget {HOST_BUDGET_ENV}={show(budget.limit)}"
    there = f"the {show(budget.available)} of host memory available"
    if budget.held:
        there = (
            f"the {show(budget.available + budget.held)} of host memory there is "
            f"for the pools ({show(budget.available)} available, "
            f"{show(budget.held)} in allocated pools)"
        )
    return f"{MAX_HOST_MEMORY_FRACTION:.0%} of {there}"


def _raise_cap(budget: HostBudget, total: int) -> str:
    """The other fix where the cap, not the memory, refuses."""
    if budget.cap_binds and total <= usable_bytes(budget.available + budget.held):
        return f"raise {HOST_BUDGET_ENV} to at least {total} ({show(total)}), "
    return ""


def _smaller_blocks(pool: PoolRequest) -> str:
    device = pool.device_block_tokens
    if pool.blocks_per_chunk > 1 and pool.chunk_key == "blocks_per_chunk":
        return f"lower blocks_per_chunk from {pool.blocks_per_chunk} to 1"
    if pool.blocks_per_chunk > 1:
        tokens = pool.blocks_per_chunk * device
        return f"lower block_size from {tokens} to {device} tokens"
    return (
        f"a CPU block is one device block ({device} tokens) already: a smaller "
        "device KV block size (vLLM's block_size) or KV cache dtype makes it smaller"
    )


def _kv_cache_fix(
    total: int, budget: HostBudget, host_kv_bytes: int, workers: int
) -> str:
    """The other fix where the device KV cache is host memory too (and the
    cap does not bind): how small each worker's must be, in its unit."""
    if host_kv_bytes == 0 or budget.cap_binds:
        return ""
    # Whatever the KV caches give back becomes memory for the pools.
    there = budget.available + budget.held
    shrink = math.ceil(total / MAX_HOST_MEMORY_FRACTION) - there
    while usable_bytes(there + shrink) < total:
        shrink += 1  # float rounding in the limit
    keep = host_kv_bytes - math.ceil(shrink / workers)
    setting = os.environ.get(CPU_KV_CACHE_ENV)
    if setting:
        keep_gib = keep // 2**30  # the variable counts whole GiB
        if keep_gib < 1:
            return ""
        fix = f"lower {CPU_KV_CACHE_ENV} from {setting} to {keep_gib}"
    else:
        if keep <= 0:
            return ""
        fix = (
            f"set kv_cache_memory_bytes to at most {keep} (it is sized by "
            "kv_cache_memory_bytes or gpu_memory_utilization now)"
        )
    return (
        f", or shrink the KV cache of vLLM's CPU backend, which takes "
        f"{show(host_kv_bytes)} of host memory: {fix}"
    )


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
    host_budget_bytes: int | None = None  # HOST_BUDGET_ENV


def fit_host_memory(
    sizing: KVSizing,
    *,
    reserved_bytes: int = 0,
    workers_on_host: int | None = None,
    available_bytes: int | None = None,
    other_pools: Sequence[host_ledger.Reserved] | None = None,
) -> HostFit:
    """The doctor's fit: the largest ``num_cpu_blocks`` of a sized model the
    worker's check accepts with the host memory available now (or
    ``available_bytes``), less ``reserved_bytes`` for what will be allocated
    before the pool (the KV cache of vLLM's CPU backend, weights), next to
    the host's live pools (``other_pools``; default: the ledger's when
    measuring now, none when ``available_bytes`` is given).

    ``workers_on_host`` (default: one per stored copy: every tensor-parallel
    worker, or one region they share for MLA) pools of this engine share
    this host: the result is what all of them together leave room for.
    """
    workers = sizing.stored_copies if workers_on_host is None else workers_on_host
    try:
        cap = budget_cap()
        if available_bytes is None:
            available_bytes = host_available_bytes()
            if other_pools is None:
                other_pools = host_ledger.live_pools()
    except ValueError as e:  # a setting that is not one
        raise SizingError(str(e)) from None
    budget = HostBudget(available_bytes, other_pools or (), cap, reserved_bytes)
    usable = budget.room()
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
