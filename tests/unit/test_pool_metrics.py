"""CPU-pool capacity, occupancy, evictions and failed transfers in vLLM's
offloading stats, each worker's pool info series, and the pool's KV events
across a cache reset, for both of our specs.

The manager's ``get_stats`` payload is what vLLM's front end exports on
``/metrics`` (``OffloadPromMetrics``); our specs declare the series there.
(``tests/e2e/test_serve.py`` and ``test_tiering_online.py`` read them from
real servers, ``tests/e2e/test_kv_events.py`` the events of a reset.)
"""

from __future__ import annotations

import dataclasses

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    Medium,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    ReqContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from tests.unit.conftest import make_connector, new_engine_id
from tests.unit.kv_helpers import make_config, worker_report
from vllm_ascend.kv_offload import pool_metrics
from vllm_ascend.kv_offload.manager import FailureAwareManager
from vllm_ascend.kv_offload.npu import NPUOffloadingSpec
from vllm_ascend.kv_offload.scheduler_side import FailureRouter
from vllm_ascend.kv_offload.tiering.spec import NPUTieringOffloadingSpec


def reduced(manager: FailureAwareManager) -> dict[str, float]:
    return manager.get_stats().reduce()


def store(manager: FailureAwareManager, *names: str) -> None:
    """One request stores blocks ``names`` (written, then completed)."""
    ctx = ReqContext(req_id=f"store-{'-'.join(names)}")
    manager.on_new_request(ctx)
    out = manager.prepare_store([n.encode() for n in names], ctx)
    manager.complete_store(list(out.keys_to_store), ctx)


@pytest.mark.parametrize("spec_cls", [NPUOffloadingSpec, NPUTieringOffloadingSpec])
def test_the_spec_declares_the_pool_series_beside_vllms(spec_cls):
    defs = spec_cls.build_metric_definitions({})
    assert set(pool_metrics.metric_definitions()) <= set(defs)
    assert "vllm:kv_offload_cpu_cache_usage_perc" in defs  # vLLM's own stays
    assert isinstance(defs[pool_metrics.FAILED_STORES], OffloadingCounterMetadata)
    assert isinstance(defs[pool_metrics.FAILED_LOADS], OffloadingCounterMetadata)
    info = defs[pool_metrics.POOL_INFO]
    assert isinstance(info, OffloadingGaugeMetadata)
    assert info.labelnames == ("memory_kind", "pinned", "pieces", "copy_path")


POOL_SERIES = (
    pool_metrics.CAPACITY_BLOCKS,
    pool_metrics.CAPACITY_BYTES,
    pool_metrics.BLOCKS_IN_USE,
    pool_metrics.EVICTIONS,
    pool_metrics.FAILED_STORES,
    pool_metrics.FAILED_LOADS,
)


@pytest.fixture
def four_block_manager():
    """Builds the scheduler-side manager of a spec: 4 CPU blocks of 64 KiB
    (the tiering one on its own shared region); shut down at teardown."""
    made = []

    def build(spec_cls, events: bool = False):
        config = dataclasses.replace(
            make_config({"num_cpu_blocks": 4, "block_size": 128}),
            enable_kv_cache_events=events,
            engine_id=new_engine_id(),
        )
        made.append(spec_cls(config).get_manager())
        return made[-1]

    yield build
    for manager in made:
        manager.shutdown()


@pytest.fixture(params=[NPUOffloadingSpec, NPUTieringOffloadingSpec])
def spec_manager(request, four_block_manager):
    """Each of our specs' manager, KV events on."""
    return four_block_manager(request.param, events=True)


def workload(manager) -> list[dict[str, float]]:
    """Six blocks through four, then a reset: the pool series before, after
    each store, once more with nothing new, and after the reset."""
    series = [reduced(manager)]
    store(manager, "a", "b", "c")
    series.append(reduced(manager))
    store(manager, "d", "e", "f")  # two of a, b, c make room
    series += [reduced(manager), reduced(manager)]
    manager.reset_cache()
    series.append(reduced(manager))
    return [{name: s[name] for name in POOL_SERIES} for s in series]


def test_both_specs_report_the_same_pool_series_for_the_same_workload(
    four_block_manager,
):
    """Capacity, occupancy and evictions; the tiering spec's CPU tier is the
    pool: same series, same values."""
    plain, tiering = (
        workload(four_block_manager(spec_cls))
        for spec_cls in (NPUOffloadingSpec, NPUTieringOffloadingSpec)
    )
    assert tiering == plain
    assert [s[pool_metrics.BLOCKS_IN_USE] for s in plain] == [0, 3, 4, 4, 0]
    # A counter's increase is per interval: nothing new evicted since.
    assert [s[pool_metrics.EVICTIONS] for s in plain] == [0, 0, 2, 0, 0]
    assert {s[pool_metrics.CAPACITY_BLOCKS] for s in plain} == {4}
    assert plain[0][pool_metrics.CAPACITY_BYTES] == 4 * 65536


def test_promotions_into_the_cpu_tier_count_their_evictions(four_block_manager):
    manager = four_block_manager(NPUTieringOffloadingSpec)
    store(manager, "a", "b", "c", "d")
    reduced(manager)
    # A promotion (secondary tier -> CPU tier) needs a block: one evicted.
    ctx = ReqContext(req_id="p")
    manager.on_new_request(ctx)
    assert manager.inner.primary_tier.prepare_write([b"e"], ctx) is not None
    assert reduced(manager)[pool_metrics.EVICTIONS] == 1


def cpu_events(manager) -> list[tuple[bool, set]]:
    """(removed, keys) of each CPU event the manager publishes now."""
    return [
        (e.removed, set(e.keys))
        for e in manager.take_events()
        if e.medium == Medium.CPU
    ]


def test_a_reset_publishes_the_removal_of_every_block_the_pool_held(spec_manager):
    m = spec_manager
    store(m, "a", "b", "c")
    store(m, "d", "e", "f")  # two of a, b, c evicted
    resident: set = set()
    for removed, keys in cpu_events(m):
        if removed:
            resident -= keys
        else:
            resident |= keys
    stats = reduced(m)
    assert len(resident) == stats[pool_metrics.BLOCKS_IN_USE] == 4
    # Good transfers count no failures.
    assert stats[pool_metrics.FAILED_STORES] == stats[pool_metrics.FAILED_LOADS] == 0

    m.reset_cache()
    assert cpu_events(m) == [(True, resident)]
    assert reduced(m)[pool_metrics.BLOCKS_IN_USE] == 0
    m.reset_cache()  # nothing left: nothing more to announce
    assert cpu_events(m) == []


def test_a_block_still_being_written_at_a_reset_is_not_announced(spec_manager):
    m = spec_manager
    store(m, "a", "b")
    ctx = ReqContext(req_id="w")
    m.on_new_request(ctx)
    assert m.prepare_store([b"c"], ctx) is not None  # its copy never completes
    assert cpu_events(m) == [(False, {b"a", b"b"})]
    m.reset_cache()
    assert cpu_events(m) == [(True, {b"a", b"b"})]


# -- failed transfers ----------------------------------------------------------


def test_failed_stores_and_loads_are_counted_once_per_job(spec_manager):
    """Two workers each report the same failed store and load, in different
    steps: one failed store, one failed load."""
    m = spec_manager
    router = FailureRouter(m, num_workers=2)
    ctx = ReqContext(req_id="a")
    m.on_new_request(ctx)
    out = m.prepare_store([b"k1", b"k2"], ctx)
    loaded = ReqContext(req_id="b")
    m.on_new_request(loaded)
    device = GPULoadStoreSpec([1], group_sizes=[1], block_indices=[0])
    router.expect(
        OffloadingConnectorMetadata(
            load_jobs={8: TransferJob("b", CPULoadStoreSpec([0]), device)},
            store_jobs={7: TransferJob("a", device, out.store_spec)},
        )
    )
    router.route(worker_report({7: 1, 8: 1}, failed={7, 8}))  # worker 0
    router.route(worker_report({7: 1, 8: 1}, failed={7, 8}))  # worker 1, later
    m.complete_store(list(out.keys_to_store), ctx)  # vLLM completes job 7
    first = reduced(m)
    assert first[pool_metrics.FAILED_STORES] == 1
    assert first[pool_metrics.FAILED_LOADS] == 1
    assert first[pool_metrics.BLOCKS_IN_USE] == 0  # the failed store's freed
    # A counter's increase is per interval.
    again = reduced(m)
    assert again[pool_metrics.FAILED_STORES] == again[pool_metrics.FAILED_LOADS] == 0


# -- the worker's pool info ------------------------------------------------------


@pytest.fixture(scope="module")
def worker_connector():
    connector = make_connector("worker")
    yield connector
    connector.shutdown()


def test_each_worker_reports_its_pool_and_copy_path_as_an_info_series(worker_connector):
    worker = worker_connector.connector_worker.worker
    stats = worker_connector.get_kv_connector_stats()
    labels = (
        worker.pool.memory.kind,  # the CPU backend's: a pageable mmap
        "false",
        "1",
        worker.self_check.path,
    )
    assert worker.pool.memory.kind == "pageable mmap"
    assert worker.self_check.path in ("native", "torch")  # torch: without native code
    assert stats.reduce() == {f"{pool_metrics.POOL_INFO}:{labels}": 1}


def test_workers_with_different_pools_show_as_one_series_each():
    """vLLM merges the workers' stats: a worker whose pool differs (here its
    copy path) is its own series; identical ones are one."""
    native = pool_metrics.PoolInfo("aclrtMallocHost", True, 1, "native-batch")
    torch_path = pool_metrics.PoolInfo("aclrtMallocHost", True, 1, "torch")
    merged = None
    for info in (native, native, torch_path):
        stats = OffloadingConnectorStats()
        pool_metrics.add_pool_info(stats, info)
        merged = stats if merged is None else merged.aggregate(stats)
    assert merged.reduce() == {
        f"{pool_metrics.POOL_INFO}:{native.labelvalues()}": 1,
        f"{pool_metrics.POOL_INFO}:{torch_path.labelvalues()}": 1,
    }
