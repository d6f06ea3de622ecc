"""NPUOffloadingWorker under random stores, loads, waits, polls and faults.

A hypothesis state machine drives the worker directly (synthetic CPU caches)
the way vLLM's connector does, respecting the same protocol: a CPU block is
not written while it is being read or written, a device block is not touched
while a job uses it. A reference model maps every (CPU block, slot) to the
bytes it must hold; every successfully loaded byte is checked against it, and
every job is reported exactly once, failed exactly when a fault was injected.

Then: shutdown with jobs in flight (prompt, no thread left, pool freed). How
the connector reports failed jobs to vLLM: test_failure_reporting_worker.py
and test_failure_reporting_scheduler.py.
"""

from __future__ import annotations

import gc
import random
import time
import weakref
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec, TransferResult
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from tests.fault_injection import FaultInjectingWorker, FaultInjector
from tests.unit.conftest import kv_offload_threads
from tests.unit.kv_helpers import make_kv_caches, make_worker
from vllm_ascend.kv_offload.cpu_pool import CpuBlockPool
from vllm_ascend.kv_offload.transfer_queue import ThreadTransferQueue

PAGES = [256, 128, 384]  # unequal parts, e.g. K, V and a third
NUM_DEVICE_BLOCKS = 24
NUM_CPU_BLOCKS = 10
FAULTS = "load:0.25,store:0.25,load_submit:0.1,store_submit:0.1"

Slot = tuple[int, int]  # (CPU block, slot within it)
SEEDS = st.integers(0, 2**32 - 1)


@dataclass
class Job:
    is_store: bool
    device_blocks: list[int]
    cpu_blocks: list[int]
    slots: list[Slot]  # slot of each device block, in order
    # Store: the device bytes at submission; load: the CPU bytes expected.
    pages: list[list[bytes]]


class WorkerMachine(RuleBasedStateMachine):
    @initialize(
        bpc=st.sampled_from([1, 2, 3]), faults=st.booleans(), seed=st.integers(0, 2**16)
    )
    def start(self, bpc, faults, seed):
        self.threads_before = set(kv_offload_threads())
        self.kv = make_kv_caches(NUM_DEVICE_BLOCKS, PAGES, seed=seed)
        self.faults = FaultInjector.parse(f"{FAULTS},seed:{seed}") if faults else None
        self.worker = make_worker(self.kv, bpc, NUM_CPU_BLOCKS, FaultInjectingWorker)
        self.worker.faults = self.faults
        self.bpc = bpc
        self.rng = np.random.default_rng(seed)
        self.ref: dict[Slot, list[bytes]] = {}
        self.jobs: dict[int, Job] = {}
        self.stored_layouts: list[tuple[tuple[int, ...], int, int]] = []
        self.next_job = 0
        self.loads_checked = 0
        # Something stored from the start, so loads can begin at step one.
        for n in (2, 3, 4):
            self.store(n=n, skip=seed % bpc, seed=seed + n)
        self.worker.wait(set(self.jobs))
        self._poll()

    # -- helpers -----------------------------------------------------------

    def _device_page(self, block: int) -> list[bytes]:
        return [t.tensor[block].numpy().tobytes() for t in self.kv.tensors]

    def _busy_device(self) -> set[int]:
        return {b for job in self.jobs.values() for b in job.device_blocks}

    def _cpu_in_use(self, stores_only: bool) -> set[int]:
        return {
            b
            for job in self.jobs.values()
            if job.is_store or not stores_only
            for b in job.cpu_blocks
        }

    def _layout(self, skip: int, n: int, cpu_blocks) -> list[Slot]:
        return [
            (cpu_blocks[(skip + k) // self.bpc], (skip + k) % self.bpc)
            for k in range(n)
        ]

    def _injected(self, kind: str, job_id: int) -> bool:
        return self.faults is not None and (kind, job_id) in self.faults.injected

    def _submitted(self, job_id: int, ok: bool, job: Job) -> None:
        kind = "store" if job.is_store else "load"
        # Refused exactly when a submit fault was injected.
        assert ok == (not self._injected(f"{kind}_submit", job_id))
        if ok:
            self.jobs[job_id] = job
        elif job.is_store:
            # vLLM drops a failed store's blocks; so does the model.
            for slot in job.slots:
                self.ref.pop(slot, None)

    def _finish(self, result: TransferResult) -> None:
        job = self.jobs.pop(result.job_id)  # KeyError: reported twice/unknown
        kind = "store" if job.is_store else "load"
        assert result.success == (not self._injected(kind, result.job_id))
        if not result.success:
            if job.is_store:
                for slot in job.slots:
                    self.ref.pop(slot, None)
            return
        assert result.transfer_size == len(job.device_blocks) * sum(PAGES)
        if job.is_store:
            for slot, page in zip(job.slots, job.pages, strict=True):
                self.ref[slot] = page
            return
        for block, page in zip(job.device_blocks, job.pages, strict=True):
            assert self._device_page(block) == page, f"device block {block}"
        self.loads_checked += 1

    def _poll(self) -> set[int]:
        results = self.worker.get_finished()
        for result in results:
            self._finish(result)
        return {r.job_id for r in results}

    # -- rules -------------------------------------------------------------

    # Which jobs are still in flight depends on the copy thread's timing, so
    # rules draw a seed (always the same kind of draw, as hypothesis needs
    # for replaying) and pick among the current candidates with it.

    @rule(n=st.integers(1, 6), skip=st.integers(0, 2), seed=SEEDS)
    def store(self, n, skip, seed):
        rng = random.Random(seed)
        skip %= self.bpc
        n_cpu = -(-(skip + n) // self.bpc)
        free_dev = sorted(set(range(NUM_DEVICE_BLOCKS)) - self._busy_device())
        free_cpu = sorted(set(range(NUM_CPU_BLOCKS)) - self._cpu_in_use(False))
        if len(free_dev) < n or len(free_cpu) < n_cpu:
            return
        dev = rng.sample(free_dev, n)
        cpu = rng.sample(free_cpu, n_cpu)
        job_id, self.next_job = self.next_job, self.next_job + 1
        spec = GPULoadStoreSpec(dev, group_sizes=[n], block_indices=[skip])
        pages = [self._device_page(b) for b in dev]
        job = Job(True, dev, cpu, self._layout(skip, n, cpu), pages)
        ok = self.worker.submit_store(job_id, spec, CPULoadStoreSpec(cpu))
        self._submitted(job_id, ok, job)
        if ok:
            self.stored_layouts.append((tuple(cpu), skip, n))

    @precondition(lambda self: self.stored_layouts)
    @rule(seed=SEEDS)
    def load(self, seed):
        """Loads what an earlier store wrote (as vLLM loads stored chunks)."""
        rng = random.Random(seed)
        cpu, skip, n = rng.choice(self.stored_layouts)
        writers = {
            job_id
            for job_id, job in self.jobs.items()
            if job.is_store and set(job.cpu_blocks) & set(cpu)
        }
        if writers:
            # vLLM loads a block only once its store completed: wait for it.
            self.worker.wait(writers)
            self._poll()
        slots = self._layout(skip, n, cpu)
        free_dev = sorted(set(range(NUM_DEVICE_BLOCKS)) - self._busy_device())
        if not all(s in self.ref for s in slots) or len(free_dev) < n:
            return  # a failed store lost it, or the device is busy
        dev = rng.sample(free_dev, n)
        job_id, self.next_job = self.next_job, self.next_job + 1
        spec = GPULoadStoreSpec(dev, group_sizes=[n], block_indices=[skip])
        job = Job(False, dev, list(cpu), slots, [self.ref[s] for s in slots])
        ok = self.worker.submit_load(job_id, CPULoadStoreSpec(list(cpu)), spec)
        self._submitted(job_id, ok, job)

    @rule(seed=SEEDS)
    def compute_writes_a_device_block(self, seed):
        free_dev = sorted(set(range(NUM_DEVICE_BLOCKS)) - self._busy_device())
        if not free_dev:
            return
        block = random.Random(seed).choice(free_dev)
        for t in self.kv.tensors:
            t.tensor[block] = torch.from_numpy(
                self.rng.integers(-128, 128, t.tensor.shape[1], dtype=np.int8)
            )

    @rule()
    def poll(self):
        self._poll()

    @rule(seed=SEEDS)
    def wait_then_poll(self, seed):
        if not self.jobs:
            return
        rng = random.Random(seed)
        ids = set(rng.sample(sorted(self.jobs), rng.randint(1, len(self.jobs))))
        self.worker.wait(ids)
        # Waited jobs are done: the next poll reports every one of them.
        assert ids <= self._poll()

    @invariant()
    def one_thread_per_queue(self):
        # stores, loads, expedited loads
        if hasattr(self, "worker"):
            assert len(kv_offload_threads()) <= len(self.threads_before) + 3

    def teardown(self):
        if not hasattr(self, "worker"):
            return
        self.worker.wait(set(self.jobs))
        self._poll()
        assert not self.jobs, "jobs never reported"
        pool = weakref.ref(self.worker.pool.tensor)
        start = time.perf_counter()
        self.worker.shutdown()
        assert time.perf_counter() - start < 5
        assert set(kv_offload_threads()) <= self.threads_before
        assert self.worker.pool.tensor is None
        # Freed on release (no cycle holds it), not at some later GC.
        assert pool() is None, "CPU pool still referenced after shutdown"
        # Refused after shutdown, never reported.
        spec = GPULoadStoreSpec([0], group_sizes=[1], block_indices=[0])
        assert not self.worker.submit_store(10**6, spec, CPULoadStoreSpec([0]))
        assert self.worker.get_finished() == []


TestWorkerStateMachine = WorkerMachine.TestCase
TestWorkerStateMachine.settings = settings(
    max_examples=80,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- shutdown with jobs in flight -------------------------------------------


def test_queue_shutdown_drops_queued_jobs_and_returns_promptly():
    before = set(kv_offload_threads())
    q = ThreadTransferQueue("test")
    for job in range(20):  # 20 x 0.2 s of copying queued
        q.submit(job, lambda: time.sleep(0.2))
    time.sleep(0.05)
    start = time.perf_counter()
    assert q.shutdown()
    # At most the job in progress (0.2 s), not the 4 s queued; generous
    # for a busy 2-core machine.
    assert time.perf_counter() - start < 2.0
    done = q.poll()
    assert sorted(j.job_id for j in done) == list(range(20))
    assert sum(j.success for j in done) <= 2  # the rest were dropped, failed
    assert set(kv_offload_threads()) <= before  # its thread has ended
    with pytest.raises(RuntimeError, match="shut down"):
        q.submit(99, lambda: None)
    q.wait({5})  # waiting on a dropped job returns


def test_worker_shutdown_with_large_jobs_in_flight_frees_everything():
    before = set(kv_offload_threads())
    kv = make_kv_caches(64, [1 << 18, 1 << 18])  # 512 KiB per block
    worker = make_worker(kv, 1, 64, FaultInjectingWorker)
    pool = weakref.ref(worker.pool.tensor)
    spec = GPULoadStoreSpec(list(range(64)), group_sizes=[64], block_indices=[0])
    for job in range(32):  # 32 jobs of 32 MiB
        assert worker.submit_store(job, spec, CPULoadStoreSpec(list(range(64))))
    start = time.perf_counter()
    worker.shutdown()
    assert time.perf_counter() - start < 5
    assert set(kv_offload_threads()) <= before
    gc.collect()
    assert pool() is None
    worker.shutdown()  # idempotent


@pytest.mark.parametrize("error", [RuntimeError("broken"), KeyboardInterrupt()])
def test_a_self_check_that_raises_leaves_no_copy_thread_and_frees_the_pool(
    monkeypatch, error
):
    """Not only a failed check (``SelfCheckFailed``): one that raises stops
    the worker's queues and gives its pool back before the error goes on."""
    before = set(kv_offload_threads())
    released = []
    release = CpuBlockPool.release
    monkeypatch.setattr(
        CpuBlockPool, "release", lambda pool: (released.append(pool), release(pool))
    )

    def check(*args, **kwargs):
        raise error

    with pytest.raises(type(error)):
        make_worker(make_kv_caches(8, PAGES), 1, 4, self_check=check)
    assert set(kv_offload_threads()) <= before  # its queues' threads ended
    assert len(released) == 1


def test_fault_spec_is_parsed_and_bad_specs_name_the_variable():
    faults = FaultInjector.parse("load:1:2,store:0,seed:3")
    assert faults.rates == {"load": (1.0, 2), "store": (0.0, None)}
    with pytest.raises(ValueError, match="VLLM_ASCEND_KV_OFFLOAD_FAULTS"):
        FaultInjector.parse("load=1")
    with pytest.raises(ValueError, match="unknown fault kind"):
        FaultInjector.parse("bogus:1")
