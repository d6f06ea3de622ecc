"""CPU-pool capacity and occupancy on ``/metrics``, for routers.

vLLM's offloading metrics framework (``OffloadingSpec.build_metric_definitions``
declares, the manager's ``get_stats`` reports, ``OffloadPromMetrics`` exports
on the front end) already carries ``vllm:kv_offload_cpu_cache_usage_perc``,
the fraction of the pool held by transfers in flight, and vLLM counts the
prompt tokens served from host memory per request source
(``vllm:prompt_tokens_cached_by_source{source="host"}``). What a router that
places requests by cache contents also needs, and vLLM does not export, is
how large the CPU cache is and how full: these four series, declared and
reported here in the same framework (docs/serving_events_metrics.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

try:  # vLLM's offloading metrics framework (checked on 0.32 and 0.33)
    from vllm.v1.kv_offload.base import (
        OffloadingCounterMetadata,
        OffloadingGaugeMetadata,
        OffloadingMetricMetadata,
    )
except ImportError:  # a release without it: nothing to declare or report
    OffloadingMetricMetadata = None  # type: ignore[assignment,misc]

CAPACITY_BLOCKS = "vllm:kv_offload_cpu_pool_capacity_blocks"
CAPACITY_BYTES = "vllm:kv_offload_cpu_pool_capacity_bytes"
BLOCKS_IN_USE = "vllm:kv_offload_cpu_pool_blocks_in_use"
# prometheus_client exports a counter as <name>_total.
EVICTIONS = "vllm:kv_offload_cpu_pool_evictions"


def metric_definitions() -> dict[str, Any]:
    if OffloadingMetricMetadata is None:
        return {}
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
    }


@dataclass(frozen=True)
class PoolCapacity:
    blocks: int
    bytes: int


def add_pool_stats(
    stats: Any, capacity: PoolCapacity, blocks_in_use: int | None, evictions: int
) -> None:
    """Adds the pool series to an ``OffloadingConnectorStats`` payload.
    ``blocks_in_use`` None: the manager's occupancy is unknown (not reported)."""
    stats.set_gauge(CAPACITY_BLOCKS, capacity.blocks)
    stats.set_gauge(CAPACITY_BYTES, capacity.bytes)
    if blocks_in_use is not None:
        stats.set_gauge(BLOCKS_IN_USE, blocks_in_use)
    stats.increase_counter(EVICTIONS, evictions)
