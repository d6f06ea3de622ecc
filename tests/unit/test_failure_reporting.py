"""How a failed transfer reaches vLLM, through its public connector hooks.

vLLM's own connector worker (``OffloadingConnectorWorker``, run unmodified
here) asserts that every transfer succeeded. Our worker diverts failures: vLLM
sees the job finish, and ``AscendOffloadingConnector`` reports what failed:

* worker side: a failed load's device blocks (``get_block_ids_with_load_errors``,
  in the same step as vLLM sees the job finish), or its request
  (``failed_recving``) with several KV cache groups; failed job ids in the
  worker metadata;
* scheduler side: ``FailureAwareManager`` frees a failed store's CPU blocks
  (``complete_store(success=False)``) and offers a request whose load failed
  no more hits.

Failures are injected with tests/fault_injection.py (rate 1 = every job).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LookupResult,
    PrepareStoreOutput,
    ReqContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from tests.fault_injection import FaultInjectingWorker, FaultInjector
from tests.unit.conftest import CONNECTOR_BLOCK_SIZE, make_connector
from tests.unit.kv_helpers import (
    cpu_queues,
    make_kv_caches,
    make_worker,
    running,
    worker_report,
)
from vllm_ascend.kv_offload.connector import AscendOffloadingConnectorMetadata
from vllm_ascend.kv_offload.failures import (
    AscendOffloadingWorkerMetadata,
    WorkerFailureLog,
)
from vllm_ascend.kv_offload.manager import FailureAwareManager
from vllm_ascend.kv_offload.scheduler_side import FailureRouter, SyncLoadQuarantine

PAGES = [256, 128]
NUM_DEVICE_BLOCKS = 16
NUM_CPU_BLOCKS = 8


def gpu(*blocks: int) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(list(blocks), group_sizes=[len(blocks)], block_indices=[0])


def load(req: str, *blocks: int) -> TransferJob:
    return TransferJob(req, CPULoadStoreSpec(list(blocks)), gpu(*blocks))


def store(req: str, *blocks: int) -> TransferJob:
    return TransferJob(req, gpu(*blocks), CPULoadStoreSpec(list(blocks)))


def metadata(load_jobs=None, store_jobs=None) -> AscendOffloadingConnectorMetadata:
    return AscendOffloadingConnectorMetadata(
        load_jobs=load_jobs or {}, store_jobs=store_jobs or {}
    )


class WorkerSide:
    """A worker-side connector built as vLLM builds it, over vLLM's real
    connector worker and our fault-injecting worker."""

    def __init__(self, faults: str | None = None, num_groups: int = 1):
        self.c = make_connector("worker", num_groups=num_groups)
        self.worker = self.c.connector_worker.worker
        assert isinstance(self.worker, FaultInjectingWorker)
        self.worker.faults = FaultInjector.parse(faults) if faults else None
        self.seen: set[int] = set()

    def step(self, meta: AscendOffloadingConnectorMetadata):
        """One engine step as vLLM's model runner drives the connector;
        waits for this step's transfers first so results are deterministic."""
        c = self.c
        c.bind_connector_metadata(meta)
        c.handle_preemptions(meta)
        c.start_load_kv(None)
        c.wait_for_save()  # defers this step's stores to the next step
        self.seen |= set(meta.load_jobs) | set(meta.store_jobs)
        self.worker.wait(self.seen)
        results = c.get_transfer_results(set())
        errors = c.get_block_ids_with_load_errors()
        worker_meta = c.build_connector_worker_meta()
        c.clear_connector_metadata()
        return results, errors, worker_meta


@pytest.fixture
def side_factory():
    made: list[WorkerSide] = []

    def make(**kwargs) -> WorkerSide:
        made.append(WorkerSide(**kwargs))
        return made[-1]

    yield make
    for side in made:
        side.c.shutdown()


@pytest.mark.parametrize("faults", ["load:1", "load_submit:1"])
def test_a_failed_load_reports_its_device_blocks_in_the_step_it_finishes(
    side_factory, faults
):
    """Failed while copying or refused at submission: reported the same way."""
    side = side_factory(faults=faults)
    results, errors, meta = side.step(metadata(load_jobs={1: load("a", 4, 5)}))
    # The request stops waiting (vLLM saw the job finish) ...
    assert results.finished_recving == {"a"}
    # ... and in the same step its blocks are reported for recompute/fail.
    assert errors == {4, 5}
    assert isinstance(meta, AscendOffloadingWorkerMetadata)
    assert meta.completed_jobs == {1: 1} and meta.failed_jobs == {1}
    assert meta.transfer_stats.load.is_empty()  # no bytes counted for it


def test_a_good_load_reports_nothing_but_its_bytes(side_factory):
    side = side_factory()
    # Something to load: store blocks 4, 5 first (stores go out a step late).
    side.step(metadata(store_jobs={1: store("a", 4, 5)}))
    results, errors, meta = side.step(metadata(load_jobs={2: load("b", 4, 5)}))
    assert results.finished_recving == {"b"} and errors == set()
    assert meta.failed_jobs == set()
    # Two blocks of the connector's one layer: K and V of 16 tokens x 2 x 32.
    assert meta.transfer_stats.load.bytes == 2 * (2 * CONNECTOR_BLOCK_SIZE * 2 * 32 * 4)


def test_with_several_kv_cache_groups_a_failed_load_fails_its_request(side_factory):
    side = side_factory(faults="load:1", num_groups=2)
    results, errors, meta = side.step(metadata(load_jobs={1: load("a", 4)}))
    assert errors == set()  # vLLM cannot map block ids to requests here
    assert results.failed_recving == {"a"}
    assert meta.failed_jobs == {1}


def test_a_failed_store_is_flagged_for_the_scheduler_and_invalidates_nothing(
    side_factory,
):
    side = side_factory(faults="store:1")
    _, _, first = side.step(metadata(store_jobs={5: store("a", 1, 2)}))
    assert first is None  # stores are submitted at the next step's start
    results, errors, meta = side.step(metadata())
    assert errors == set() and results.failed_recving == set()
    assert meta.completed_jobs == {5: 1} and meta.failed_jobs == {5}


class Unread:
    """Device block ids that must not be read: iterating or converting
    them is work per block."""

    def __iter__(self, *args, **kwargs):
        raise AssertionError("the block ids of a good load were read")

    __array__ = __len__ = __iter__


def test_loads_that_do_not_fail_cost_no_work_per_block():
    log = WorkerFailureLog(report_block_ids=True)
    good = gpu(4, 5)
    good.block_ids = Unread()
    log.record_loads({1: TransferJob("a", CPULoadStoreSpec([4, 5]), good)})
    log.record_loads({2: load("b", 6, 7)})
    log.record_failures([2])
    assert log.take_load_error_block_ids() == {6, 7}


def test_without_diversion_the_worker_reports_failures_to_vllm_truthfully():
    kv = make_kv_caches(NUM_DEVICE_BLOCKS, PAGES)
    with running(make_worker(kv, 1, NUM_CPU_BLOCKS, FaultInjectingWorker)) as worker:
        worker.faults = FaultInjector.parse("load:1,store_submit:1")
        # A connector that does not collect failures gets vLLM's contract.
        assert not worker.submit_store(1, gpu(1), CPULoadStoreSpec([1]))
        assert worker.submit_load(2, CPULoadStoreSpec([1]), gpu(3))
        worker.wait({2})
        [result] = worker.get_finished()
        assert (result.job_id, result.success) == (2, False)
        assert worker.take_failed_jobs() == []


def test_worker_metadata_merges_failures_across_workers():
    a = AscendOffloadingWorkerMetadata(failed_jobs={2})
    a.mark_completed(1)
    a.mark_completed(2)
    b = AscendOffloadingWorkerMetadata(failed_jobs={1})
    b.mark_completed(1)
    b.mark_completed(2)
    merged = a.aggregate(b)
    assert isinstance(merged, AscendOffloadingWorkerMetadata)
    assert merged.completed_jobs == {1: 2, 2: 2}
    assert merged.failed_jobs == {1, 2}


# -- expedited loads ----------------------------------------------------------


def test_an_expedited_load_does_not_wait_behind_regular_loads():
    stores, loads, expedited = cpu_queues()
    kv = make_kv_caches(NUM_DEVICE_BLOCKS, PAGES)
    worker = make_worker(kv, 1, NUM_CPU_BLOCKS, queues=(stores, loads, expedited))
    release = threading.Event()
    try:
        # A regular load that cannot finish until released occupies its queue.
        loads.submit(100, lambda: release.wait(30))
        assert worker.submit_load(1, CPULoadStoreSpec([2]), gpu(6), expedited=True)
        worker.wait({1})  # returns although the regular queue is blocked
        assert [r.job_id for r in worker.get_finished()] == [1]
        assert not release.is_set()
    finally:
        release.set()
        worker.shutdown()


def test_an_expedited_load_copies_the_same_bytes():
    kv = make_kv_caches(NUM_DEVICE_BLOCKS, PAGES, seed=3)
    with running(make_worker(kv, 1, NUM_CPU_BLOCKS)) as worker:
        want = [t.tensor[7].clone() for t in kv.tensors]
        assert worker.submit_store(1, gpu(7), CPULoadStoreSpec([5]))
        worker.wait({1})
        assert worker.submit_load(2, CPULoadStoreSpec([5]), gpu(8), expedited=True)
        worker.wait({2})
        assert {r.job_id for r in worker.get_finished()} == {1, 2}
        for t, w in zip(kv.tensors, want, strict=True):
            assert torch.equal(t.tensor[8], w)


# -- scheduler side -------------------------------------------------------------


def ctx(req_id: str) -> ReqContext:
    return ReqContext(req_id=req_id)


def manager() -> FailureAwareManager:
    return FailureAwareManager(CPUOffloadingManager(num_chunks=4))


def keys(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def test_a_failed_store_frees_its_cpu_blocks_instead_of_recording_them():
    m = manager()
    out = m.prepare_store(keys("k1", "k2"), ctx("a"))
    assert set(m.keys_of_store(out.store_spec)) == set(keys("k1", "k2"))
    m.store_failed(m.keys_of_store(out.store_spec))
    m.complete_store(list(out.keys_to_store), ctx("a"))  # what vLLM calls
    assert m.lookup(b"k1", ctx("b")) == LookupResult.MISS
    # The space is free again: four new blocks fit.
    assert m.prepare_store(keys("n1", "n2", "n3", "n4"), ctx("b")) is not None


class CountedKey:
    """A key that counts how often it is hashed."""

    hashed = 0

    def __hash__(self) -> int:
        CountedKey.hashed += 1
        return id(self)


class KeepingEverything:
    """vLLM's manager, reduced to what a store calls."""

    def prepare_store(self, keys, req_context):
        return PrepareStoreOutput(list(keys), CPULoadStoreSpec([0]), [])

    def complete_store(self, keys, req_context, success=True):
        self.completed = success


def test_stores_that_do_not_fail_cost_no_work_per_key():
    """The scheduler stores every request's new blocks every step; while no
    store failed, our manager adds nothing per key to vLLM's bookkeeping."""
    m = FailureAwareManager(KeepingEverything())
    stored = [CountedKey() for _ in range(64)]
    CountedKey.hashed = 0
    out = m.prepare_store(stored, ctx("a"))
    m.complete_store(out.keys_to_store, ctx("a"))
    assert CountedKey.hashed == 0 and m.inner.completed is True
    # A failure is still matched by its keys.
    failed = m.prepare_store(stored, ctx("b"))
    m.store_failed(m.keys_of_store(failed.store_spec))
    m.complete_store(list(failed.keys_to_store), ctx("b"))
    assert m.inner.completed is False


def test_a_request_whose_load_failed_gets_no_more_hits_until_it_finishes():
    m = manager()
    out = m.prepare_store(keys("k1"), ctx("a"))
    m.complete_store(list(out.keys_to_store), ctx("a"))
    assert m.lookup(b"k1", ctx("b")) == LookupResult.HIT  # a good store: kept
    m.load_failed("b")
    assert m.lookup(b"k1", ctx("b")) == LookupResult.MISS
    assert m.lookup(b"k1", ctx("c")) == LookupResult.HIT  # others unaffected
    m.on_request_finished(ctx("b"))
    assert m.lookup(b"k1", ctx("b")) == LookupResult.HIT


def test_the_router_turns_reported_failures_into_manager_calls():
    m = manager()
    router = FailureRouter(m, num_workers=2)
    store_out = m.prepare_store(keys("k1"), ctx("a"))
    router.expect(
        metadata(
            load_jobs={8: load("b", 3)},
            store_jobs={7: TransferJob("a", gpu(1), store_out.store_spec)},
        )
    )
    router.route(worker_report({7: 1, 8: 1}, failed={7, 8}))  # worker 0: both failed
    assert m.lookup(b"k1", ctx("b")) == LookupResult.MISS  # load failure: b
    router.route(worker_report({7: 1, 8: 1}))  # worker 1: both done
    # vLLM's own completion of job 7 now frees the keys (success=False).
    m.complete_store(list(store_out.keys_to_store), ctx("a"))
    assert m.lookup(b"k1", ctx("c")) == LookupResult.MISS


def test_a_store_issued_while_its_requests_sync_load_failed_is_not_kept():
    """Its blocks were computed from what the failed load left behind."""
    m = manager()
    router = FailureRouter(m, num_workers=1)
    store_out = m.prepare_store(keys("k1"), ctx("a"))
    store_job = TransferJob("a", gpu(4), store_out.store_spec)
    router.expect(metadata(load_jobs={1: sync_load("a", 3)}, store_jobs={2: store_job}))
    router.route(worker_report({1: 1}, failed={1}))  # the store will succeed
    router.route(worker_report({2: 1}))
    m.complete_store(list(store_out.keys_to_store), ctx("a"))
    assert m.lookup(b"k1", ctx("c")) == LookupResult.MISS


def test_a_store_of_blocks_another_connector_failed_to_load_is_not_kept():
    """Beside a P/D connector in vLLM's MultiConnector: a synchronous load of
    that connector fails, vLLM gets its device blocks in
    ``KVConnectorOutput.invalid_block_ids`` and recomputes them, but our
    store of the same step already copies them as the failed load left them
    (tests/e2e/test_pd_multi_connector.py served those bytes back as CPU
    hits, with wrong outputs)."""
    m = manager()
    router = FailureRouter(m, num_workers=1)
    bad = m.prepare_store(keys("k1"), ctx("a"))
    good = m.prepare_store(keys("k2"), ctx("b"))
    router.expect(
        metadata(
            store_jobs={
                1: TransferJob("a", gpu(3, 4), bad.store_spec),
                2: TransferJob("b", gpu(5), good.store_spec),
            }
        )
    )
    router.invalidate_blocks({4})  # the other connector's failed load
    router.route(worker_report({1: 1, 2: 1}))  # both copies "succeeded"
    m.complete_store(list(bad.keys_to_store), ctx("a"))
    m.complete_store(list(good.keys_to_store), ctx("b"))
    assert m.lookup(b"k1", ctx("c")) == LookupResult.MISS
    assert m.lookup(b"k2", ctx("c")) == LookupResult.HIT


# -- sync loads: their device blocks out of reach until they succeeded ---------

BLOCK = 16


def request(req_id: str, *hashes: str) -> SimpleNamespace:
    """A request of len(hashes) full blocks whose block hashes are ``hashes``."""
    return SimpleNamespace(
        request_id=req_id,
        block_hashes=[h.encode() for h in hashes],
        num_tokens=BLOCK * len(hashes),
    )


def blocks(*ids: int) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def sync_load(req_id: str, *block_ids: int) -> SimpleNamespace:
    """vLLM 0.33's TransferJob of a synchronous load (0.32's has no sync)."""
    return SimpleNamespace(
        req_id=req_id,
        src_spec=CPULoadStoreSpec(list(block_ids)),
        dst_spec=gpu(*block_ids),
        sync=True,
    )


def quarantined_sync_load(q: SyncLoadQuarantine, loader) -> None:
    """``loader`` hits its first block on the device and syncs-loads the two
    after it into device blocks 11 and 12 (job 1), as vLLM schedules it."""
    q.on_lookup(loader, BLOCK, (2 * BLOCK, False))
    q.on_alloc(loader, blocks(10, 11, 12), 2 * BLOCK)


def test_no_request_reaches_the_blocks_of_a_sync_load_in_flight():
    q = SyncLoadQuarantine(BLOCK)
    quarantined_sync_load(q, request("a", "d0", "d1", "d2"))
    # Same step, before the metadata is built: prefixes through d1 wait ...
    assert q.must_wait(request("b", "d0", "d1", "x2"))
    # ... a prefix that shares only the block "a" did not load does not.
    assert not q.must_wait(request("c", "d0", "y1"))
    q.on_metadata(metadata(load_jobs={1: sync_load("a", 11, 12)}))
    assert q.must_wait(request("b", "d0", "d1", "x2"))  # until it is reported
    q.release(1, failed=False)
    assert not q.must_wait(request("b", "d0", "d1", "x2"))


def test_a_failed_sync_load_leaves_the_device_prefix_cache():
    q = SyncLoadQuarantine(BLOCK)
    evicted: list[set[int]] = []
    q.bind(SimpleNamespace(evict_blocks=evicted.append))  # vLLM's KV cache manager
    quarantined_sync_load(q, request("a", "d0", "d1", "d2"))
    q.on_metadata(metadata(load_jobs={1: sync_load("a", 11, 12)}))
    q.release(1, failed=True)
    assert evicted == [{11, 12}]  # not block 10, a good device hit
    assert not q.must_wait(request("b", "d0", "d1"))


def test_an_async_hit_is_not_quarantined():
    q = SyncLoadQuarantine(BLOCK)
    loader = request("a", "d0", "d1")
    q.on_lookup(loader, 0, (2 * BLOCK, True))  # loaded before it is scheduled
    q.on_alloc(loader, blocks(3, 4), 2 * BLOCK)
    assert not q.must_wait(request("b", "d0", "d1"))


def test_a_fault_cap_holds_when_two_copy_threads_draw_at_once():
    faults = FaultInjector.parse("load:1:1")
    both_drawing = threading.Barrier(2, timeout=1)

    class MeetingRng:
        """Each draw waits (at most 1 s) for the other thread's draw."""

        def random(self) -> float:
            try:
                both_drawing.wait()
            except threading.BrokenBarrierError:
                pass  # the other thread waits for this one's draw first
            return 0.0

    faults.rng = MeetingRng()
    threads = [
        threading.Thread(target=faults.apply, args=("load", job, None, None, False))
        for job in (1, 2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(faults.injected) == 1
