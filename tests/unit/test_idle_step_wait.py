"""Steps that compute nothing wait for transfers instead of spinning.

While every request waits for its KV, vLLM steps the engine again as soon as
a step returns. On the CPU backend those steps take CPU from the copy they
wait for, so a step with nothing scheduled waits (bounded) until a transfer
finishes; a step that computes tokens never waits.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from tests.unit.conftest import make_connector
from tests.unit.kv_helpers import cpu_queues, make_kv_caches, make_worker
from vllm_ascend.kv_offload import connector
from vllm_ascend.kv_offload.connector import AscendOffloadingConnectorMetadata
from vllm_ascend.kv_offload.transfer_queue import ThreadTransferQueue


def gated_job(gate: threading.Event):
    return lambda: gate.wait(5)


# -- TransferQueue.wait_any --------------------------------------------------


def test_wait_any_returns_false_at_once_when_nothing_is_in_flight():
    q = ThreadTransferQueue("test")
    start = time.perf_counter()
    assert q.wait_any(1.0) is False
    assert time.perf_counter() - start < 0.5  # not the 1 s timeout
    q.shutdown()


def test_wait_any_returns_as_soon_as_a_job_finishes():
    q = ThreadTransferQueue("test")
    gate = threading.Event()
    q.submit(1, gated_job(gate))
    threading.Timer(0.05, gate.set).start()
    start = time.perf_counter()
    assert q.wait_any(5.0) is True
    assert time.perf_counter() - start < 1.0  # the job's 0.05 s, not the 5 s
    assert [j.job_id for j in q.poll()] == [1]
    q.shutdown()


def test_wait_any_gives_up_at_the_timeout_while_a_copy_runs():
    q = ThreadTransferQueue("test")
    gate = threading.Event()
    q.submit(1, gated_job(gate))
    start = time.perf_counter()
    assert q.wait_any(0.05) is True
    assert 0.04 < time.perf_counter() - start < 1.0
    assert q.poll() == []  # still running: nothing to report yet
    gate.set()
    q.shutdown()


def test_wait_any_returns_at_once_when_a_finished_job_awaits_polling():
    q = ThreadTransferQueue("test")
    q.submit(1, lambda: None)
    q.wait({1})
    start = time.perf_counter()
    assert q.wait_any(1.0) is True
    assert time.perf_counter() - start < 0.5  # not the 1 s timeout
    q.shutdown()


# -- NPUOffloadingWorker.wait_for_progress ------------------------------------


def test_worker_waits_for_a_load_in_flight_then_reports_it():
    kv = make_kv_caches(8, [1 << 12])
    stores, loads, expedited = cpu_queues()
    worker = make_worker(kv, 1, 8, queues=(stores, loads, expedited))
    gate = threading.Event()
    loads.submit(99, gated_job(gate))  # a load that takes 0.05 s
    threading.Timer(0.05, gate.set).start()
    start = time.perf_counter()
    worker.wait_for_progress(5.0)
    assert time.perf_counter() - start < 1.0
    assert [r.job_id for r in worker.get_finished()] == [99]
    worker.shutdown()


def test_worker_with_nothing_in_flight_does_not_wait():
    kv = make_kv_caches(8, [1 << 12])
    worker = make_worker(kv, 1, 8)
    spec = GPULoadStoreSpec([0], group_sizes=[1], block_indices=[0])
    assert worker.submit_store(1, spec, CPULoadStoreSpec([0]))
    worker.wait({1})
    assert [r.job_id for r in worker.get_finished()] == [1]
    start = time.perf_counter()
    worker.wait_for_progress(1.0)
    assert time.perf_counter() - start < 0.5  # not the 1 s timeout
    worker.shutdown()


# -- the connector: only steps that compute nothing wait ---------------------


@pytest.fixture
def worker_side(monkeypatch):
    """A worker-side connector (built by its constructor) whose offloading
    worker records the waits it is asked for."""
    c = make_connector("worker")
    waits: list[float] = []
    monkeypatch.setattr(c.connector_worker.worker, "wait_for_progress", waits.append)
    yield c, waits
    c.shutdown()


def test_scheduler_marks_steps_that_schedule_no_tokens_as_idle(monkeypatch):
    c = make_connector("scheduler")
    gpu = GPULoadStoreSpec([1], group_sizes=[1], block_indices=[0])
    load = TransferJob("a", CPULoadStoreSpec([1]), gpu)
    vllm_meta = OffloadingConnectorMetadata(load_jobs={1: load}, store_jobs={})
    monkeypatch.setattr(
        c.connector_scheduler, "build_connector_meta", lambda so: vllm_meta
    )

    idle = c.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))
    busy = c.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=17))

    for meta in (idle, busy):
        assert isinstance(meta, AscendOffloadingConnectorMetadata)
        assert meta.load_jobs is vllm_meta.load_jobs  # vLLM's fields carried over
    assert idle.idle_step and not busy.idle_step


def test_idle_step_waits_for_transfers_before_polling(worker_side):
    c, waits = worker_side
    meta = AscendOffloadingConnectorMetadata(load_jobs={}, store_jobs={})
    meta.idle_step = True
    c.bind_connector_metadata(meta)
    assert c.get_finished(set()) == (set(), set())
    assert waits == [connector.IDLE_STEP_WAIT_S]


def test_step_that_computes_does_not_wait(worker_side):
    c, waits = worker_side
    c.bind_connector_metadata(
        AscendOffloadingConnectorMetadata(load_jobs={}, store_jobs={})
    )
    c.get_finished(set())
    assert waits == []
