"""Worker side of NPU offloading: submits and tracks KV transfers.

The same worker runs on ``npu``, ``cuda`` and ``cpu``: the copy engine builds a
job's descriptors, and a ``TransferQueue`` per kind of job decides where the
copies run (a dedicated stream, or a thread on the CPU backend). There are
three: stores, loads, and expedited loads (vLLM >= 0.33 waits for those
within the step, so they must not queue behind regular loads).

Failures never escape into the engine, and are never hidden. Every job
``submit_store``/``submit_load`` accepted is reported exactly once by
``get_finished``; one that failed (at submission or while copying) is
reported with ``success=False``, which vLLM's own connector does not handle
(it asserts). ``connector.AscendOffloadingConnector`` therefore calls
``divert_failures()``: from then on failed jobs are reported to vLLM as
finished without transfer stats, and the connector collects them with
``take_failed_jobs()`` and reports them through vLLM's public connector hooks
(blocks to recompute, CPU blocks never stored). Without that call a failure
stays loud.
"""

from __future__ import annotations

import ctypes
import functools
import os
import random
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from vllm_ascend.kv_offload.copy_engine import CopyEngine, CpuBlockPool, Descriptors
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.transfer_queue import (
    FinishedJob,
    TransferQueue,
    make_transfer_queue,
)

logger = init_logger(__name__)

FAULTS_ENV = "VLLM_ASCEND_KV_OFFLOAD_FAULTS"
FAULTS_LOG_ENV = "VLLM_ASCEND_KV_OFFLOAD_FAULTS_LOG"
FAULT_KINDS = (
    "store",
    "load",
    "expedited_load",
    "store_submit",
    "load_submit",
    "expedited_load_submit",
)
# What a failed copy leaves behind in the injected faults: recognisably wrong
# bytes, so that using them would change the model's output.
GARBAGE_BYTE = 0x5A


class FaultInjector:
    """TEST ONLY: makes chosen transfer jobs fail, to exercise failure handling.

    Off unless ``VLLM_ASCEND_KV_OFFLOAD_FAULTS`` is set when this module is
    first imported (``FAULTS`` below), or a test passes one to the worker.
    The value is a comma-separated list of ``KIND:PROBABILITY[:MAX_COUNT]``
    and an optional ``seed:N``, e.g. ``"load:0.5,store:1:3,seed:7"``:

    * ``store``, ``load``: the job's copy runs, then its destination is
      overwritten with garbage (host memory only, so on the CPU backend) and
      the job raises on the copy thread or stream: a copy that failed half-way.
    * ``expedited_load``: the same, for expedited loads only (vLLM >= 0.33's
      synchronous loads); ``load`` covers regular loads.
    * ``store_submit``, ``load_submit``, ``expedited_load_submit``: submitting
      the job raises.

    ``MAX_COUNT`` caps how many faults of that kind are injected. With
    ``VLLM_ASCEND_KV_OFFLOAD_FAULTS_LOG=PATH`` each injected fault appends a
    line ``KIND JOB_ID`` to PATH, so a test in another process can count them.
    """

    def __init__(
        self,
        rates: dict[str, tuple[float, int | None]],
        seed: int = 0,
        log_path: str | None = None,
    ):
        unknown = set(rates) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(
                f"{FAULTS_ENV}: unknown fault kind(s) {sorted(unknown)}; "
                f"use {', '.join(FAULT_KINDS)}"
            )
        self.rates = rates
        self.rng = random.Random(seed)
        self.log_path = log_path
        self.injected: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, spec: str, log_path: str | None = None) -> FaultInjector:
        rates: dict[str, tuple[float, int | None]] = {}
        seed = 0
        for item in filter(None, (p.strip() for p in spec.split(","))):
            kind, *values = item.split(":")
            try:
                if kind == "seed" and len(values) == 1:
                    seed = int(values[0])
                    continue
                if len(values) not in (1, 2):
                    raise ValueError(item)
                rate = float(values[0])
                limit = int(values[1]) if len(values) == 2 else None
            except ValueError:
                raise ValueError(
                    f"{FAULTS_ENV}={spec!r}: cannot read {item!r}; write "
                    "KIND:PROBABILITY[:MAX_COUNT] or seed:N, e.g. load:0.5,store:1"
                ) from None
            rates[kind] = (rate, limit)
        return cls(rates, seed=seed, log_path=log_path)

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        spec = os.environ.get(FAULTS_ENV)
        if not spec:
            return None
        faults = cls.parse(spec, os.environ.get(FAULTS_LOG_ENV))
        logger.warning(
            "KV offload: TEST fault injection is on: %s=%s",
            FAULTS_ENV,
            spec,
        )
        return faults

    def count(self, kind: str) -> int:
        return sum(1 for k, _ in self.injected if k == kind)

    def _draw(self, kind: str, job_id: int) -> bool:
        rate, limit = self.rates.get(kind, (0.0, None))
        if rate <= 0 or (limit is not None and self.count(kind) >= limit):
            return False
        if self.rng.random() >= rate:
            return False
        with self._lock:
            self.injected.append((kind, job_id))
            if self.log_path:
                with open(self.log_path, "a") as f:
                    f.write(f"{kind} {job_id}\n")
        return True

    def apply(
        self,
        direction: str,
        job_id: int,
        desc: Descriptors,
        copy: Callable[[], object],
        host_destination: bool,
    ) -> Callable[[], object]:
        """The job's copy function, possibly replaced by a failing one.

        ``host_destination``: whether ``desc.dst`` is host memory, which the
        failing copy can then overwrite with garbage.
        """
        if self._draw(f"{direction}_submit", job_id):
            raise RuntimeError(f"injected fault: {direction} job {job_id} at submit")
        if not self._draw(direction, job_id):
            return copy

        def failing_copy() -> None:
            copy()
            if host_destination:
                _scribble(desc)
            raise RuntimeError(f"injected fault: {direction} job {job_id} copy")

        return failing_copy


def _scribble(desc: Descriptors) -> None:
    # Test-only path: one memset per fragment is fine here.
    for addr, size in zip(desc.dst.tolist(), desc.sizes.tolist(), strict=True):
        ctypes.memset(addr, GARBAGE_BYTE, size)


# Parsed once per process; None (no faults) unless the test variable is set.
FAULTS: FaultInjector | None = FaultInjector.from_env()


def host_pinning_available(device: torch.device) -> bool:
    """Whether page-locked host memory can be allocated for ``device``."""
    if device.type == "cpu":
        return False
    try:
        return bool(torch.empty(1, pin_memory=True, device="cpu").is_pinned())
    except RuntimeError:
        return False


def allocate_pool(
    page_bytes: list[int], blocks_per_chunk: int, num_cpu_blocks: int, pin: bool
) -> CpuBlockPool:
    """The CPU block pool, pinned if possible, else pageable (and says so)."""
    try:
        return CpuBlockPool(page_bytes, blocks_per_chunk, num_cpu_blocks, pin)
    except RuntimeError as e:
        row_bytes = sum(page_bytes) * blocks_per_chunk
        gib = num_cpu_blocks * row_bytes / 2**30
        if pin:
            logger.warning(
                "KV offload: could not pin %.2f GiB of host memory (%s); the CPU "
                "block pool falls back to pageable memory (slower transfers)",
                gib,
                e,
            )
            return allocate_pool(page_bytes, blocks_per_chunk, num_cpu_blocks, False)
        raise MemoryError(
            f"KV offload: the CPU block pool of {num_cpu_blocks} blocks x "
            f"{row_bytes} bytes ({gib:.2f} GiB) could not be allocated ({e}); "
            "lower num_cpu_blocks (or cpu_bytes_to_use) in "
            "kv_connector_extra_config"
        ) from e


class NPUOffloadingWorker(OffloadingWorker):
    """Moves KV blocks between the device cache and a CPU block pool."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_cpu_blocks: int,
        faults: FaultInjector | None = None,
    ):
        if not kv_caches.tensors:
            raise ValueError("NPUOffloadingWorker needs at least one KV cache tensor")
        self.device = kv_caches.tensors[0].tensor.device
        self.faults = faults if faults is not None else FAULTS
        pin = host_pinning_available(self.device)
        if not pin:
            # Expected on the CPU backend; on an accelerator it costs speed.
            log = logger.info if self.device.type == "cpu" else logger.warning
            log(
                "KV offload: page-locked host memory is not available on %s; "
                "the CPU block pool uses pageable memory",
                self.device.type,
            )
        t0 = time.perf_counter()
        self.pool = allocate_pool(
            [t.page_size_bytes for t in kv_caches.tensors],
            blocks_per_chunk,
            num_cpu_blocks,
            pin,
        )
        logger.info(
            "KV offload: CPU block pool of %d blocks x %d bytes (%.2f GiB, %s) "
            "allocated in %.2f s for %d KV cache tensors on %s",
            num_cpu_blocks,
            self.pool.row_bytes,
            self.pool.nbytes / 2**30,
            "pinned" if self.pool.pinned else "pageable",
            time.perf_counter() - t0,
            len(kv_caches.tensors),
            self.device,
        )
        self.engine = CopyEngine(kv_caches, self.pool)
        self._stores = make_transfer_queue(self.device, "store")
        self._loads = make_transfer_queue(self.device, "load")
        self._expedited_loads = make_transfer_queue(self.device, "load-expedited")
        self._queues = (self._stores, self._loads, self._expedited_loads)
        # job_id -> bytes, for the TransferResult.
        self._job_bytes: dict[int, int] = {}
        # Jobs that failed at submission; reported by the next get_finished.
        self._refused: list[int] = []
        self._divert_failures = False
        self._failed_jobs: list[int] = []
        self._closed = False

    def divert_failures(self) -> None:
        """Report failed jobs to vLLM as finished (without stats) and keep
        them for ``take_failed_jobs``; for a connector that reports failures
        through vLLM's public hooks itself."""
        self._divert_failures = True

    def take_failed_jobs(self) -> list[int]:
        """Jobs reported failed since the last call (diverted failures)."""
        failed, self._failed_jobs = self._failed_jobs, []
        return failed

    def _submit(
        self,
        queue: TransferQueue,
        job_id: int,
        device_spec: LoadStoreSpec,
        cpu_spec: LoadStoreSpec,
        to_cpu: bool,
    ) -> bool:
        direction = "store" if to_cpu else "load"
        if queue is self._expedited_loads:
            direction = "expedited_load"
        if self._closed:
            logger.warning("KV offload: %s job %d after shutdown", direction, job_id)
            return self._refuse(job_id)
        try:
            assert isinstance(device_spec, GPULoadStoreSpec)
            assert isinstance(cpu_spec, BlockIDsLoadStoreSpec)
            desc: Descriptors = self.engine.build(
                device_spec, np.asarray(cpu_spec.block_ids), to_cpu=to_cpu
            )
            copy = functools.partial(self.engine.submit, desc)
            if self.faults is not None:
                host_destination = to_cpu or self.device.type == "cpu"
                copy = self.faults.apply(
                    direction, job_id, desc, copy, host_destination
                )
            self._job_bytes[job_id] = desc.num_bytes
            queue.submit(job_id, copy)
        except Exception:
            # Reported to the connector by the False return; the engine goes on.
            logger.exception(
                "KV offload: %s job %d could not be submitted", direction, job_id
            )
            self._job_bytes.pop(job_id, None)
            return self._refuse(job_id)
        return True

    def _refuse(self, job_id: int) -> bool:
        if not self._divert_failures:
            return False  # vLLM's contract: nothing is reported for it later
        # Accepted as far as vLLM knows; finishes failed at the next poll.
        self._refused.append(job_id)
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Device -> CPU, after the compute that wrote the blocks."""
        return self._submit(self._stores, job_id, src_spec, dst_spec, to_cpu=True)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """CPU -> device. An ``expedited`` load (vLLM >= 0.33: the step waits
        for it before its forward pass) runs on a queue of its own, so it never
        waits behind regular loads."""
        queue = self._expedited_loads if expedited else self._loads
        return self._submit(queue, job_id, dst_spec, src_spec, to_cpu=False)

    def get_finished(self) -> list[TransferResult]:
        finished = [FinishedJob(j, False, 0.0) for j in self._refused]
        self._refused.clear()
        for queue in self._queues:
            finished += queue.poll()
        results = []
        for job in finished:
            size = self._job_bytes.pop(job.job_id, 0)
            if job.success:
                results.append(TransferResult(job.job_id, True, size, job.seconds))
            elif self._divert_failures:
                # Failed jobs moved no useful bytes: no transfer stats.
                self._failed_jobs.append(job.job_id)
                results.append(TransferResult(job.job_id, True, None, None))
            else:
                results.append(TransferResult(job.job_id, False, size, job.seconds))
        return results

    def wait(self, job_ids: set[int]) -> None:
        for queue in self._queues:
            queue.wait(job_ids)

    def wait_for_progress(self, timeout_s: float) -> None:
        """Blocks until a job in flight finishes, at most ``timeout_s``.

        For engine steps that compute nothing and only wait for transfers:
        without it vLLM steps again at once, over and over, and on the CPU
        backend each step takes CPU time from the copy it is waiting for.
        Loads come first (requests wait on them); stores only when no load is
        in flight. Returns at once on streams (their DMA does not compete).
        """
        for queue in (self._expedited_loads, self._loads, self._stores):
            if queue.wait_any(timeout_s):
                return

    def shutdown(self) -> None:
        """Drops queued jobs, waits for copies in progress, frees the pool."""
        if self._closed:
            return
        self._closed = True
        stopped = [q.shutdown() for q in self._queues]
        self._job_bytes.clear()
        if all(stopped):
            # Release the (possibly pinned) host memory now, not at GC.
            self.pool.release()
