"""Where copies run: the one device-specific seam of the offload worker.

A ``TransferQueue`` runs the jobs of one direction (device->CPU stores or
CPU->device loads) in submission order, asynchronously, and reports each
finished job with its duration.

* ``StreamTransferQueue`` (``npu``, ``cuda``): a dedicated device stream.
  A job first waits for the compute stream, so a store never reads a block
  the model is still writing and a load lands after pending writes to its
  destination blocks; its end event fires only when the data is in place.
* ``ThreadTransferQueue`` (``cpu``, vLLM's CPU backend): a background thread.
  The copy op releases the GIL, so copies overlap the model's forward pass.
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

from vllm_ascend.logger import init_logger

logger = init_logger(__name__)

# A job's copy work: enqueues (or performs) the copies on the current stream.
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
    def shutdown(self) -> None:
        """Finish or drop pending work and release resources; idempotent."""


def make_transfer_queue(device: torch.device, name: str) -> TransferQueue:
    if device.type == "cpu":
        return ThreadTransferQueue(name)
    return StreamTransferQueue(device)


@dataclass
class _StreamJob:
    job_id: int
    start: torch.Event
    end: torch.Event


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
        # Order after all compute queued so far on the caller's stream.
        self.stream.wait_stream(torch.accelerator.current_stream(self.device))
        with self.stream:
            start.record(self.stream)
            copy()
            end.record(self.stream)
        self._jobs.append(_StreamJob(job_id, start, end))

    def poll(self) -> list[FinishedJob]:
        done: list[FinishedJob] = []
        # One stream runs jobs in order: stop at the first unfinished one.
        while self._jobs and self._jobs[0].end.query():
            job = self._jobs.popleft()
            seconds = job.start.elapsed_time(job.end) * 1e-3
            done.append(FinishedJob(job.job_id, True, seconds))
            self._events += (job.start, job.end)
        return done

    def wait(self, job_ids: set[int]) -> None:
        for job in list(self._jobs):
            if job.job_id in job_ids:
                job.end.synchronize()

    def shutdown(self) -> None:
        if self._jobs:
            self._jobs[-1].end.synchronize()
        self._jobs.clear()
        self._events.clear()


class ThreadTransferQueue(TransferQueue):
    """Jobs on a background thread, for devices without streams (CPU)."""

    _STOP = None

    def __init__(self, name: str):
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._finished: list[FinishedJob] = []
        self._pending: dict[int, threading.Event] = {}
        self._thread = threading.Thread(
            target=self._run, name=f"kv-offload-{name}", daemon=True
        )
        self._thread.start()

    def submit(self, job_id: int, copy: CopyFn) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("transfer queue is shut down")
        with self._lock:
            self._pending[job_id] = threading.Event()
        self._todo.put((job_id, copy))

    def _run(self) -> None:
        while (item := self._todo.get()) is not self._STOP:
            job_id, copy = item
            start = time.perf_counter()
            try:
                copy()
                success = True
            except Exception:
                logger.exception("KV offload copy job %d failed", job_id)
                success = False
            seconds = time.perf_counter() - start
            with self._lock:
                self._finished.append(FinishedJob(job_id, success, seconds))
                done = self._pending.pop(job_id)
            done.set()

    def poll(self) -> list[FinishedJob]:
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        with self._lock:
            events = [self._pending[j] for j in job_ids if j in self._pending]
        for event in events:
            event.wait()

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._todo.put(self._STOP)
            self._thread.join()
