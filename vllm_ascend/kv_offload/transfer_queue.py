"""Where copies run: the offload worker's device-specific job queues.

One of five places that differ per device; the others are the copy op's
backends (``ops.py``, ``csrc/kv_offload/``), pinned or pageable pool memory
(``cpu_pool.py``), host registration of the shared region
(``region.py``) and the Ascend KV layouts (``kv_layout.py``).

A ``TransferQueue`` runs the jobs of one kind (device->CPU stores,
CPU->device loads, or expedited loads) in submission order, asynchronously,
and reports each finished job with its duration.

* ``StreamTransferQueue`` (``npu``, ``cuda``): a dedicated device stream.
  A job first waits for the compute stream, so a store never reads a block
  the model is still writing and a load lands after pending writes to its
  destination blocks; its end event fires only when the data is in place.
  Until then the queue keeps what the job's copy function returned: the op's
  workspace, host memory (the batch copy APIs' descriptor arrays) that the
  enqueued copies may still read.
* ``ThreadTransferQueue`` (``cpu``, vLLM's CPU backend): a background thread.
  The copy op releases the GIL, so copies overlap the model's forward pass.
  The thread runs off vLLM's OpenMP cores where vLLM left any free
  (``cpu_threads.pin_copy_thread``; issue 18).

Failures: a job whose copy raises (anything, even ``SystemExit``) is
reported with ``success=False`` (never re-raised into the engine); ``submit``
raises only if the job could not be started, and the caller reports that job
failed. Every job ``submit`` accepted is reported exactly once, also when
``shutdown`` races with it. On the thread queue ``shutdown`` drops jobs not
yet started, so it returns after at most the one copy in progress; on a
stream, copies already enqueued cannot be withdrawn, so it waits for all of
them.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_ascend.kv_offload import cpu_threads
from vllm_ascend.kv_offload.logger import init_logger

logger = init_logger(__name__)

# A job's copy work: enqueues (or performs) the copies on the current stream;
# what it returns must live until they have completed (``CopyEngine.swap``).
CopyFn = Callable[[], object]


@dataclass(frozen=True)
class FinishedJob:
    job_id: int
    success: bool
    seconds: float


class TransferQueue(ABC):
    """Runs one direction's copy jobs in order, off the caller's critical path."""

    @abstractmethod
    def submit(self, job_id: int, copy: CopyFn) -> None:
        """Start ``copy`` after every earlier job of this queue."""

    @abstractmethod
    def poll(self) -> list[FinishedJob]:
        """Jobs finished since the last poll, in completion order."""

    @abstractmethod
    def wait(self, job_ids: set[int]) -> None:
        """Block until the named jobs (those still pending here) are done."""

    @abstractmethod
    def wait_any(self, timeout_s: float) -> bool:
        """Block until some job finishes (or one awaits ``poll``), at most
        ``timeout_s``. Returns False at once, without waiting, if there is
        nothing to wait for here."""

    @abstractmethod
    def shutdown(self) -> bool:
        """Finish or drop pending work and release resources; idempotent.

        Returns whether no copy can touch memory any more (the caller may
        then free the buffers the jobs used).
        """


def make_transfer_queue(device: torch.device, name: str) -> TransferQueue:
    if device.type == "cpu":
        return ThreadTransferQueue(name)
    return StreamTransferQueue(device)


@dataclass
class _StreamJob:
    job_id: int
    start: torch.Event
    end: torch.Event
    # What the copy function returned (the op's workspace): referenced until
    # ``end`` has completed, then dropped (poll, wait, shutdown).
    keep_alive: object = None


class StreamTransferQueue(TransferQueue):
    """Jobs on one dedicated stream of an accelerator (torch_npu or CUDA)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.Stream(device=device)
        self._jobs: deque[_StreamJob] = deque()
        self._events: list[torch.Event] = []

    def _event(self) -> torch.Event:
        return self._events.pop() if self._events else torch.Event(enable_timing=True)

    def submit(self, job_id: int, copy: CopyFn) -> None:
        start, end = self._event(), self._event()
        compute = torch.accelerator.current_stream(self.device)
        # Order after all compute queued so far on the caller's stream.
        self.stream.wait_stream(compute)
        with self.stream:
            start.record(self.stream)
            try:
                keep_alive = copy()
            except Exception:
                # Part of the job may already be queued here. Later compute
                # (e.g. recomputing the blocks of a failed load) must not race
                # with it, so the compute stream waits for this stream. (The
                # workspace the op would have returned is gone: the npu op
                # waits for the batch calls it queued before raising, ops.h.)
                compute.wait_stream(self.stream)
                raise
            end.record(self.stream)
        self._jobs.append(_StreamJob(job_id, start, end, keep_alive))

    def poll(self) -> list[FinishedJob]:
        done: list[FinishedJob] = []
        # One stream runs jobs in order: stop at the first unfinished one.
        while self._jobs:
            job = self._jobs[0]
            try:
                if not job.end.query():
                    break
                seconds = job.start.elapsed_time(job.end) * 1e-3
                success = True
            except RuntimeError:
                # The runtime reports an asynchronous copy error here.
                logger.exception("KV offload copy job %d failed", job.job_id)
                seconds, success = 0.0, False
            self._jobs.popleft()
            done.append(FinishedJob(job.job_id, success, seconds))
            if success:
                self._events += (job.start, job.end)
        return done

    def wait(self, job_ids: set[int]) -> None:
        for job in list(self._jobs):
            if job.job_id in job_ids:
                job.end.synchronize()
                job.keep_alive = None  # its copies have completed

    def wait_any(self, timeout_s: float) -> bool:
        # The copies run on a DMA engine: polling costs them nothing.
        return False

    def shutdown(self) -> bool:
        # Copies already queued on a stream cannot be withdrawn: wait for them.
        try:
            self.stream.synchronize()
        except RuntimeError:
            logger.exception("KV offload: stream failed while shutting down")
        self._jobs.clear()  # and with them their workspaces, now unused
        self._events.clear()
        return True


class ThreadTransferQueue(TransferQueue):
    """Jobs on a background thread, for devices without streams (CPU)."""

    _STOP = None
    # A copy job moves at most a few hundred MiB; if the thread is still busy
    # after this long, shutdown gives up waiting (and keeps the buffers).
    SHUTDOWN_TIMEOUT_S = 30.0

    def __init__(self, name: str):
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        # Guards the fields below; notified whenever a job finishes.
        self._changed = threading.Condition()
        self._finished: list[FinishedJob] = []
        self._pending: set[int] = set()
        self._closing = False
        self._stopped = False  # the thread has ended (normally or not)
        self._thread = threading.Thread(
            target=self._run, name=f"kv-offload-{name}", daemon=True
        )
        self._thread.start()

    def submit(self, job_id: int, copy: CopyFn) -> None:
        # Checked and enqueued under the lock that shutdown takes: a job is
        # either refused here or queued ahead of the thread's stop marker.
        with self._changed:
            if self._closing or self._stopped or not self._thread.is_alive():
                raise RuntimeError("transfer queue is shut down")
            self._pending.add(job_id)
            self._todo.put((job_id, copy))

    def _run(self) -> None:
        try:
            # Off the core vLLM's OpenMP master thread spins on, which this
            # thread would otherwise inherit from the worker's main thread.
            cpu_threads.pin_copy_thread()
            while (item := self._todo.get()) is not self._STOP:
                job_id, copy = item
                start = time.perf_counter()
                success = False
                if not self._closing:  # at shutdown, drop jobs not yet started
                    try:
                        copy()
                        success = True
                    except BaseException:
                        # Even SystemExit fails only this job: the thread
                        # must live on to report every later one.
                        logger.exception("KV offload copy job %d failed", job_id)
                seconds = time.perf_counter() - start
                with self._changed:
                    self._finished.append(FinishedJob(job_id, success, seconds))
                    self._pending.discard(job_id)
                    self._changed.notify_all()
        finally:
            # The thread is ending: whatever it has not reported fails now,
            # and nothing more is accepted, so no waiter is left behind.
            with self._changed:
                self._stopped = True
                for job_id in sorted(self._pending):
                    self._finished.append(FinishedJob(job_id, False, 0.0))
                if self._pending:
                    logger.error(
                        "KV offload: copy thread %s ended with %d jobs "
                        "unreported; they are reported failed",
                        self._thread.name,
                        len(self._pending),
                    )
                self._pending.clear()
                self._changed.notify_all()

    def poll(self) -> list[FinishedJob]:
        with self._changed:
            done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._pending.isdisjoint(job_ids))

    def wait_any(self, timeout_s: float) -> bool:
        with self._changed:
            if not self._pending and not self._finished:
                return False
            self._changed.wait_for(lambda: bool(self._finished), timeout_s)
        return True

    def shutdown(self) -> bool:
        with self._changed:  # after any submit under way (see submit)
            if not self._closing:
                self._closing = True
                self._todo.put(self._STOP)
        self._thread.join(self.SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning(
                "KV offload: copy thread %s still busy after %.0f s at shutdown",
                self._thread.name,
                self.SHUTDOWN_TIMEOUT_S,
            )
            return False
        return True
