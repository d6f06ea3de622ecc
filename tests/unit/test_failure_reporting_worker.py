"""How a failed transfer reaches vLLM, through its public connector hooks:
the worker side.

vLLM's own connector worker (``OffloadingConnectorWorker``, run unmodified
here) asserts that every transfer succeeded. Our worker diverts failures: vLLM
sees the job finish, and ``AscendOffloadingConnector`` reports what failed: a
failed load's device blocks (``get_block_ids_with_load_errors``, in the same
step as vLLM sees the job finish), or its request (``failed_recving``) with
several KV cache groups; failed job ids in the worker metadata. Also here:
expedited loads, and the fault injector's cap under concurrent copy threads.
What the scheduler side makes of the reports:
test_failure_reporting_scheduler.py.

Failures are injected with tests/fault_injection.py (rate 1 = every job).
"""

from __future__ import annotations

import threading

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from tests.fault_injection import FaultInjectingWorker, FaultInjector
from tests.unit.conftest import CONNECTOR_BLOCK_SIZE, make_connector
from tests.unit.kv_helpers import (
    cpu_queues,
    gpu,
    load,
    make_kv_caches,
    make_worker,
    metadata,
    running,
    store,
)
from vllm_ascend.kv_offload.connector import AscendOffloadingConnectorMetadata
from vllm_ascend.kv_offload.failures import (
    AscendOffloadingWorkerMetadata,
    WorkerFailureLog,
)

PAGES = [256, 128]
NUM_DEVICE_BLOCKS = 16
NUM_CPU_BLOCKS = 8


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


# -- fault injection ----------------------------------------------------------


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
