"""How many CPU blocks of a sized model (``sizing.KVSizing``) fit in host
memory: the worker's host-memory guard (``cpu_pool.check_host_memory``)
applied ahead of time, for the doctor and the examples' "auto" pool."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from vllm_ascend.kv_offload.config_sizes import SizingError

if TYPE_CHECKING:
    from vllm_ascend.kv_offload.sizing import KVSizing

# "auto" pool sizing takes this share of the largest pool the guard accepts,
# so that the host stays usable next to the engine.
AUTO_POOL_SHARE = 0.5


@dataclass(frozen=True)
class HostFit:
    """The largest pool the worker's host-memory guard would accept now."""

    available_bytes: int  # host memory available when measured
    reserved_bytes: int  # subtracted first (e.g. the CPU backend's KV cache)
    usable_bytes: int  # the guard's share of what is left
    workers_on_host: int  # pools allocated on this host
    max_num_cpu_blocks: int
    cpu_bytes_to_use: int  # max_num_cpu_blocks in cpu_bytes_to_use's unit

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fit_host_memory(
    sizing: KVSizing,
    *,
    reserved_bytes: int = 0,
    workers_on_host: int | None = None,
    available_bytes: int | None = None,
) -> HostFit:
    """The largest ``num_cpu_blocks`` the worker's host-memory guard
    (``cpu_pool.check_host_memory``) accepts with the host memory available
    now (or ``available_bytes``), less ``reserved_bytes`` for what will be
    allocated before the pool (the KV cache of vLLM's CPU backend, weights).

    Each worker's guard checks its own pool alone; ``workers_on_host``
    (default: every tensor-parallel worker) pools share this host, so the
    result is what all of them together leave room for.
    """
    # Imported here: cpu_pool imports vLLM, and sizing alone must stay fast.
    from vllm_ascend.kv_offload import cpu_pool

    if available_bytes is None:
        available_bytes = cpu_pool.host_available_bytes()
    workers = workers_on_host
    if workers is None:
        workers = sizing.tensor_parallel_size
    if workers < 1:
        raise SizingError(f"workers_on_host={workers} must be >= 1")
    usable = _guard_usable(available_bytes, reserved_bytes)
    blocks = usable // (sizing.worker_bytes_per_cpu_block * workers)
    return HostFit(
        available_bytes=available_bytes,
        reserved_bytes=reserved_bytes,
        usable_bytes=usable,
        workers_on_host=workers,
        max_num_cpu_blocks=blocks,
        cpu_bytes_to_use=blocks * sizing.bytes_per_cpu_block,
    )


def _guard_usable(available: int, reserved: int) -> int:
    """Bytes the worker's guard lets a pool take once ``reserved`` of the
    ``available`` host memory is allocated (``check_host_memory``'s limit)."""
    from vllm_ascend.kv_offload import cpu_pool

    return int(max(0, available - reserved) * cpu_pool.MAX_HOST_MEMORY_FRACTION)


def guard_max_blocks(block_bytes: int, available: int, reserved: int = 0) -> int:
    """The largest number of CPU blocks of ``block_bytes`` (one worker's pool
    row) the guard accepts with ``available`` bytes of host memory of which
    ``reserved`` go to what is allocated before the pool."""
    if block_bytes < 1:
        raise SizingError(f"block_bytes={block_bytes} must be > 0")
    return _guard_usable(available, reserved) // block_bytes


def auto_num_cpu_blocks(
    block_bytes: int,
    engine_bytes: int,
    available: int,
    share: float = AUTO_POOL_SHARE,
) -> int:
    """``num_cpu_blocks`` for an "auto" setting (the examples'
    ``--num-cpu-blocks auto``): ``share`` of the largest pool the guard
    accepts once the engine (``engine_bytes``: weights, the host KV cache of
    vLLM's CPU backend, its processes) is allocated."""
    if not 0 < share <= 1:
        raise SizingError(f"share={share} must be in (0, 1]")
    if block_bytes < 1:
        raise SizingError(f"block_bytes={block_bytes} must be > 0")
    return int(_guard_usable(available, engine_bytes) * share) // block_bytes
