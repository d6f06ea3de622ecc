"""CPU-pool capacity and occupancy on ``/metrics``, for routers.

vLLM's offloading metrics framework (``OffloadingSpec.build_metric_definitions``
declares, the manager's ``get_stats`` reports, ``OffloadPromMetrics`` exports
on the front end) already carries ``vllm:kv_offload_cpu_cache_usage_perc``,
the fraction of the pool held by transfers in flight, and vLLM counts the
prompt tokens served from host memory per request source
(``vllm:prompt_tokens_cached_by_source{source="host"}``). What a router that
places requests by cache contents also needs, and vLLM does not export, is
how large the CPU cache is and how full: four series, declared and
reported here in the same framework (docs/serving_events_metrics.md).

For an operator, four more: failed stores and failed loads (counters; the
failures are otherwise only in the log), CPU hits recomputed instead of
waiting for their copies (``load_wait.py``), and an info series (a gauge of
1, Prometheus' ``_info`` convention) saying what the pool's memory is and
which copy path the self-check chose. Those facts live in the workers: each
reports them in its own KV connector stats, which vLLM merges over workers
and with the scheduler's; workers that differ show as one series each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# vLLM's offloading metrics framework: in every supported release (0.30-0.33).
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata

CAPACITY_BLOCKS = "vllm:kv_offload_cpu_pool_capacity_blocks"
CAPACITY_BYTES = "vllm:kv_offload_cpu_pool_capacity_bytes"
BLOCKS_IN_USE = "vllm:kv_offload_cpu_pool_blocks_in_use"
# prometheus_client exports a counter as <name>_total.
EVICTIONS = "vllm:kv_offload_cpu_pool_evictions"
FAILED_STORES = "vllm:kv_offload_failed_stores"
FAILED_LOADS = "vllm:kv_offload_failed_loads"
HITS_RECOMPUTED = "vllm:kv_offload_hits_recomputed"
POOL_INFO = "vllm:kv_offload_cpu_pool_info"
POOL_INFO_LABELS = ("memory_kind", "pinned", "pieces", "copy_path")


def metric_definitions() -> dict[str, Any]:
    return {
        CAPACITY_BLOCKS: OffloadingGaugeMetadata(
            documentation=(
                "CPU KV-cache capacity in CPU blocks (each block_size tokens "
                "of every layer)."
            ),
        ),
        CAPACITY_BYTES: OffloadingGaugeMetadata(
            documentation="CPU KV-cache capacity in bytes, all workers together.",
        ),
        BLOCKS_IN_USE: OffloadingGaugeMetadata(
            documentation=(
                "CPU blocks holding KV or being written (capacity minus free "
                "blocks); evictable blocks count as in use."
            ),
        ),
        EVICTIONS: OffloadingCounterMetadata(
            documentation=(
                "CPU blocks evicted from the CPU KV cache to make room for new stores."
            ),
        ),
        FAILED_STORES: OffloadingCounterMetadata(
            documentation=(
                "Store jobs (device -> CPU) that failed on some worker, or "
                "copied device blocks a load failed to fill; their CPU blocks "
                "were freed, not kept."
            ),
        ),
        FAILED_LOADS: OffloadingCounterMetadata(
            documentation=(
                "Load jobs (CPU -> device) that failed on some worker; their "
                "blocks were recomputed or their request failed "
                "(kv_load_failure_policy)."
            ),
        ),
        HITS_RECOMPUTED: OffloadingCounterMetadata(
            documentation=(
                "Requests whose CPU hit was recomputed (from the first block "
                "that had to wait) because waiting for its copies was "
                "estimated to take longer than max_load_wait_ratio times "
                "recomputing it."
            ),
        ),
        POOL_INFO: OffloadingGaugeMetadata(
            documentation=(
                "1 per kind of worker CPU pool: its host memory (memory_kind, "
                "pinned), the allocations it is made of (pieces) and the copy "
                "path the start-up self-check chose (copy_path)."
            ),
            labelnames=POOL_INFO_LABELS,
        ),
    }


@dataclass(frozen=True)
class PoolCapacity:
    blocks: int
    bytes: int


@dataclass(frozen=True)
class PoolCounts:
    """Counter increases since the last report (scheduler side)."""

    evictions: int = 0
    failed_stores: int = 0
    failed_loads: int = 0
    hits_recomputed: int = 0


@dataclass(frozen=True)
class PoolInfo:
    """What one worker's pool is (worker side): ``host_memory``'s kind,
    whether it is page-locked, its allocations, the self-check's path."""

    memory_kind: str
    pinned: bool
    pieces: int
    copy_path: str

    def labelvalues(self) -> tuple[str, ...]:
        return (
            self.memory_kind,
            str(self.pinned).lower(),
            str(self.pieces),
            self.copy_path,
        )


def add_pool_stats(
    stats: Any, capacity: PoolCapacity, blocks_in_use: int, counts: PoolCounts
) -> None:
    """Adds the pool series to an ``OffloadingConnectorStats`` payload."""
    stats.set_gauge(CAPACITY_BLOCKS, capacity.blocks)
    stats.set_gauge(CAPACITY_BYTES, capacity.bytes)
    stats.set_gauge(BLOCKS_IN_USE, blocks_in_use)
    stats.increase_counter(EVICTIONS, counts.evictions)
    stats.increase_counter(FAILED_STORES, counts.failed_stores)
    stats.increase_counter(FAILED_LOADS, counts.failed_loads)
    stats.increase_counter(HITS_RECOMPUTED, counts.hits_recomputed)


def add_pool_info(stats: Any, info: PoolInfo) -> None:
    """Adds a worker's info series to an ``OffloadingConnectorStats`` payload."""
    stats.set_gauge(POOL_INFO, 1, info.labelvalues())
