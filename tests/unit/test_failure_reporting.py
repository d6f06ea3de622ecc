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
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from tests.fault_injection import FaultInjectingWorker, FaultInjector
from tests.unit.kv_helpers import make_kv_caches
from vllm_ascend.kv_offload.connector import (
    AscendOffloadingConnector,
    AscendOffloadingConnectorMetadata,
    AscendOffloadingWorkerMetadata,
)
from vllm_ascend.kv_offload.manager import FailureAwareManager
from vllm_ascend.kv_offload.worker import NPUOffloadingWorker

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
    """A worker-side connector over vLLM's real connector worker and ours."""

    def __init__(self, faults: str | None = None, num_groups: int = 1):
        self.worker = FaultInjectingWorker(
            make_kv_caches(NUM_DEVICE_BLOCKS, PAGES),
            blocks_per_chunk=1,
            num_cpu_blocks=NUM_CPU_BLOCKS,
        )
        self.worker.faults = FaultInjector.parse(faults) if faults else None
        spec = SimpleNamespace(
            replicated_layout=False,
            config=SimpleNamespace(
                canonical_layout=False, parallel=SimpleNamespace(rank=0)
            ),
            get_worker=lambda kv_caches: self.worker,
        )
        kv_cache_config = SimpleNamespace(kv_cache_groups=[None] * num_groups)
        c = object.__new__(AscendOffloadingConnector)
        # What __init__ sets on the worker side (it needs a whole engine).
        c.connector_scheduler = None
        c.connector_worker = OffloadingConnectorWorker(spec, None, kv_cache_config)
        c.connector_worker._init_worker(None)
        c._report_block_ids = num_groups == 1
        c._load_jobs = {}
        c._load_error_block_ids = set()
        c._failed_recving = set()
        c._failed_jobs = set()
        c._connector_metadata = None
        self.worker.divert_failures()  # what register_kv_caches ends with
        self.c = c
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

    def close(self):
        self.worker.shutdown()


@pytest.fixture
def side_factory():
    made: list[WorkerSide] = []

    def make(**kwargs) -> WorkerSide:
        made.append(WorkerSide(**kwargs))
        return made[-1]

    yield make
    for side in made:
        side.close()


def test_a_failed_load_reports_its_device_blocks_in_the_step_it_finishes(
    side_factory,
):
    side = side_factory(faults="load:1")
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
    assert meta.transfer_stats.load.bytes == 2 * sum(PAGES)


def test_a_load_refused_at_submission_is_reported_the_same_way(side_factory):
    side = side_factory(faults="load_submit:1")
    results, errors, meta = side.step(metadata(load_jobs={3: load("c", 9)}))
    assert results.finished_recving == {"c"} and errors == {9}
    assert meta.failed_jobs == {3}


def test_with_several_kv_cache_groups_a_failed_load_fails_its_request(
    side_factory,
):
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


def test_without_diversion_the_worker_reports_failures_to_vllm_truthfully():
    worker = FaultInjectingWorker(
        make_kv_caches(NUM_DEVICE_BLOCKS, PAGES), 1, NUM_CPU_BLOCKS
    )
    worker.faults = FaultInjector.parse("load:1,store_submit:1")
    try:
        # A connector that does not collect failures gets vLLM's contract.
        assert not worker.submit_store(1, gpu(1), CPULoadStoreSpec([1]))
        assert worker.submit_load(2, CPULoadStoreSpec([1]), gpu(3))
        worker.wait({2})
        [result] = worker.get_finished()
        assert (result.job_id, result.success) == (2, False)
        assert worker.take_failed_jobs() == []
    finally:
        worker.shutdown()


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
    worker = NPUOffloadingWorker(
        make_kv_caches(NUM_DEVICE_BLOCKS, PAGES), 1, NUM_CPU_BLOCKS
    )
    release = threading.Event()
    try:
        # A regular load that cannot finish until released occupies its queue.
        worker._loads.submit(100, lambda: release.wait(30))
        assert worker.submit_load(1, CPULoadStoreSpec([2]), gpu(6), expedited=True)
        worker.wait({1})  # returns although the regular queue is blocked
        assert [r.job_id for r in worker.get_finished()] == [1]
        assert not release.is_set()
    finally:
        release.set()
        worker.shutdown()


def test_an_expedited_load_copies_the_same_bytes():
    kv = make_kv_caches(NUM_DEVICE_BLOCKS, PAGES, seed=3)
    worker = NPUOffloadingWorker(kv, 1, NUM_CPU_BLOCKS)
    try:
        want = [t.tensor[7].clone() for t in kv.tensors]
        assert worker.submit_store(1, gpu(7), CPULoadStoreSpec([5]))
        worker.wait({1})
        assert worker.submit_load(2, CPULoadStoreSpec([5]), gpu(8), expedited=True)
        worker.wait({2})
        assert {r.job_id for r in worker.get_finished()} == {1, 2}
        for t, w in zip(kv.tensors, want, strict=True):
            assert torch.equal(t.tensor[8], w)
    finally:
        worker.shutdown()


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
    assert m.keys_of_store(out.store_spec) == frozenset(keys("k1", "k2"))
    m.store_failed(m.keys_of_store(out.store_spec))
    m.complete_store(list(out.keys_to_store), ctx("a"))  # what vLLM calls
    assert m.lookup(b"k1", ctx("b")) == LookupResult.MISS
    # The space is free again: four new blocks fit.
    assert m.prepare_store(keys("n1", "n2", "n3", "n4"), ctx("b")) is not None


def test_a_good_store_is_recorded_as_vllm_would():
    m = manager()
    out = m.prepare_store(keys("k1"), ctx("a"))
    m.complete_store(list(out.keys_to_store), ctx("a"))
    assert m.lookup(b"k1", ctx("b")) == LookupResult.HIT


def test_a_request_whose_load_failed_gets_no_more_hits_until_it_finishes():
    m = manager()
    out = m.prepare_store(keys("k1"), ctx("a"))
    m.complete_store(list(out.keys_to_store), ctx("a"))
    m.load_failed("b")
    assert m.lookup(b"k1", ctx("b")) == LookupResult.MISS
    assert m.lookup(b"k1", ctx("c")) == LookupResult.HIT  # others unaffected
    m.on_request_finished(ctx("b"))
    assert m.lookup(b"k1", ctx("b")) == LookupResult.HIT


def test_the_connector_turns_reported_failures_into_manager_calls():
    m = manager()
    c = object.__new__(AscendOffloadingConnector)
    c._manager = m
    c._num_workers = 2
    c._job_failure_target = {}
    c._job_reports_due = {}
    completed: list[dict] = []
    c.connector_scheduler = SimpleNamespace(
        update_connector_output=lambda out: completed.append(
            dict(out.kv_connector_worker_meta.completed_jobs)
        ),
    )
    store_out = m.prepare_store(keys("k1"), ctx("a"))
    c._expect_reports(7, (True, m.keys_of_store(store_out.store_spec)))
    c._expect_reports(8, (False, "b"))

    def report(completed_jobs, failed):
        meta = AscendOffloadingWorkerMetadata(failed_jobs=failed)
        meta.completed_jobs.update(completed_jobs)
        c.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))

    report({7: 1, 8: 1}, failed={7, 8})  # worker 0: both failed
    assert m.lookup(b"k1", ctx("b")) == LookupResult.MISS  # load failure: b
    assert 7 in c._job_reports_due  # worker 1 still to report
    report({7: 1, 8: 1}, failed=set())
    assert c._job_reports_due == {} and c._job_failure_target == {}
    # vLLM's own completion of job 7 now frees the keys (success=False).
    m.complete_store(list(store_out.keys_to_store), ctx("a"))
    assert m.lookup(b"k1", ctx("c")) == LookupResult.MISS
    assert completed == [{7: 1, 8: 1}, {7: 1, 8: 1}]


def test_metadata_keeps_vllms_fields():
    vllm_meta = OffloadingConnectorMetadata(load_jobs={1: load("a", 1)}, store_jobs={})
    c = object.__new__(AscendOffloadingConnector)
    c.connector_scheduler = SimpleNamespace(build_connector_meta=lambda so: vllm_meta)
    c._manager = manager()
    c._num_workers = 1
    c._job_failure_target = {}
    c._job_reports_due = {}
    meta = c.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=3))
    assert meta.load_jobs is vllm_meta.load_jobs and not meta.idle_step
    assert c._job_failure_target == {1: (False, "a")}
