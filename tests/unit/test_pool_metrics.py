"""CPU-pool capacity, occupancy and evictions in vLLM's offloading stats.

The manager's ``get_stats`` payload is what vLLM's front end exports on
``/metrics`` (``OffloadPromMetrics``); our spec declares the series there.
(``tests/e2e/test_serve.py`` reads them from a real server.)
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from vllm_ascend.kv_offload import pool_metrics
from vllm_ascend.kv_offload.manager import FailureAwareManager
from vllm_ascend.kv_offload.npu import NPUOffloadingSpec
from vllm_ascend.kv_offload.pool_metrics import PoolCapacity

BLOCK_BYTES = 1 << 20


def reduced(manager: FailureAwareManager) -> dict[str, float]:
    return manager.get_stats().reduce()


def store(manager: FailureAwareManager, *names: str) -> None:
    ctx = ReqContext(req_id="r")
    out = manager.prepare_store([n.encode() for n in names], ctx)
    manager.complete_store(list(out.keys_to_store), ctx)


def test_the_spec_declares_the_pool_series_beside_vllms():
    defs = NPUOffloadingSpec.build_metric_definitions({})
    assert set(pool_metrics.metric_definitions()) <= set(defs)
    assert "vllm:kv_offload_cpu_cache_usage_perc" in defs  # vLLM's own stays


def test_stats_report_capacity_occupancy_and_evictions():
    m = FailureAwareManager(
        CPUOffloadingManager(num_chunks=4), PoolCapacity(4, 4 * BLOCK_BYTES)
    )
    first = reduced(m)
    assert first[pool_metrics.CAPACITY_BLOCKS] == 4
    assert first[pool_metrics.CAPACITY_BYTES] == 4 * BLOCK_BYTES
    assert first[pool_metrics.BLOCKS_IN_USE] == 0
    assert first[pool_metrics.EVICTIONS] == 0

    store(m, "a", "b", "c")
    assert reduced(m)[pool_metrics.BLOCKS_IN_USE] == 3
    store(m, "d", "e", "f")  # two of a, b, c make room
    after = reduced(m)
    assert after[pool_metrics.BLOCKS_IN_USE] == 4
    assert after[pool_metrics.EVICTIONS] == 2
    # A counter's increase is per interval: nothing new evicted since.
    assert reduced(m)[pool_metrics.EVICTIONS] == 0
