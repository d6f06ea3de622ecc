"""Worker side of NPU offloading: submits and tracks KV transfers.

The same worker runs on ``npu``, ``cuda`` and ``cpu``: the copy engine builds a
job's descriptors, and a ``TransferQueue`` per kind of job decides where the
copies run (a dedicated stream, or a thread on the CPU backend). There are
three: stores, loads, and expedited loads (vLLM >= 0.33 waits for those
within the step, so they must not queue behind regular loads).

Failures never escape into the engine, and are never hidden: every job
``submit_store``/``submit_load`` accepted is reported exactly once by
``get_finished``, a failed one as ``failures.JobLedger`` says: with
``success=False`` (vLLM's own connector asserts: a failure stays loud), or,
once ``connector.AscendOffloadingConnector`` called ``divert_failures()``, as
finished without transfer stats, for the connector to report through vLLM's
public hooks (``take_failed_jobs``: blocks to recompute, never stored).
"""

from __future__ import annotations

import functools

from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from vllm_ascend.kv_offload.copy_engine import CopyEngine, Descriptors
from vllm_ascend.kv_offload.cpu_pool import CpuBlockPool
from vllm_ascend.kv_offload.failures import JobLedger
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.pool_metrics import PoolInfo
from vllm_ascend.kv_offload.self_check import (
    SelfCheck,
    SelfCheckResult,
    choose_copy_path,
    run_self_check,
)
from vllm_ascend.kv_offload.transfer_queue import (
    CopyFn,
    TransferQueue,
    make_transfer_queue,
)

logger = init_logger(__name__)


class NPUOffloadingWorker(OffloadingWorker):
    """Moves KV blocks between the device cache and a CPU block pool."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        pool: CpuBlockPool,
        copy_path: str = "auto",
        *,
        engine: CopyEngine | None = None,
        queues: tuple[TransferQueue, TransferQueue, TransferQueue] | None = None,
        self_check: SelfCheck = run_self_check,
    ):
        """``pool``: the CPU block pool the spec assembled for this worker
        (``cpu_pool.private_pool``, or a shared region's ``region.slot_pool``);
        the worker releases it at shutdown, as its memory's owner said.
        ``copy_path``: the setting of that name (``copy_paths.py``). Raises
        ``self_check.SelfCheckFailed`` if no copy path is byte-exact.

        The collaborators default to the real ones for the KV caches'
        device; a test passes its own (e.g. on a device this machine lacks):
        ``engine`` builds and submits the copies, ``queues`` (stores, loads,
        expedited loads) run them, ``self_check`` is ``run_self_check``."""
        if not kv_caches.tensors:
            raise ValueError("NPUOffloadingWorker needs at least one KV cache tensor")
        self.device = kv_caches.tensors[0].tensor.device
        self.pool = pool
        self.engine = engine or CopyEngine(kv_caches, pool)
        self._queues = queues or tuple(
            make_transfer_queue(self.device, kind)
            for kind in ("store", "load", "load-expedited")
        )
        self._stores, self._loads, self._expedited_loads = self._queues
        # Each accepted job until get_finished reports it.
        self._jobs = JobLedger()
        self._closed = False
        # Before serving: the start-up self-check picks the copy path and
        # returns its copy function, bound; or offloading is refused.
        try:
            self.self_check: SelfCheckResult = choose_copy_path(
                self.device,
                [t.page_size_bytes for t in kv_caches.tensors],
                copy_path,
                pool=pool,
                queues=(self._stores, self._loads),
                buffers=self.engine.buffers(),
                check=self_check,
            )
        except BaseException:
            self.shutdown()  # the queues stop, the pool goes back: then raise
            raise
        assert self.self_check.path is not None and self.self_check.swap is not None
        self.copy_path: str = self.self_check.path
        self.engine.use(self.self_check.swap)

    def pool_info(self) -> PoolInfo:
        """What this worker's pool is, for ``/metrics`` (``pool_metrics``)."""
        return PoolInfo(
            memory_kind=self.pool.memory.kind,
            pinned=self.pool.pinned,
            pieces=self.pool.memory.pieces,
            copy_path=self.copy_path,
        )

    def divert_failures(self) -> None:
        """Report failed jobs to vLLM as finished (without stats) and keep
        them for ``take_failed_jobs``; for a connector that reports failures
        through vLLM's public hooks itself."""
        self._jobs.divert()

    def take_failed_jobs(self) -> list[int]:
        """Jobs reported failed since the last call (diverted failures)."""
        return self._jobs.take_failed()

    def _submit(
        self,
        queue: TransferQueue,
        direction: str,
        job_id: int,
        device_spec: LoadStoreSpec,
        cpu_spec: LoadStoreSpec,
    ) -> bool:
        to_cpu = direction == "store"
        if self._closed:
            logger.warning("KV offload: %s job %d after shutdown", direction, job_id)
            return self._jobs.refuse(job_id)
        try:
            assert isinstance(device_spec, GPULoadStoreSpec)
            assert isinstance(cpu_spec, BlockIDsLoadStoreSpec)
            desc = self.engine.build(device_spec, cpu_spec.block_ids, to_cpu=to_cpu)
            copy = self.copy_job(direction, job_id, desc)
            self._jobs.accept(job_id, desc.num_bytes, store=to_cpu)
            queue.submit(job_id, copy)
        except Exception:
            # Reported to the connector by the False return; the engine goes on.
            logger.exception(
                "KV offload: %s job %d could not be submitted", direction, job_id
            )
            self._jobs.forget(job_id)
            return self._jobs.refuse(job_id)
        return True

    def copy_job(self, kind: str, job_id: int, desc: Descriptors) -> CopyFn:
        """What the job's queue runs: the self-check's bound copy function on
        ``desc`` (no frame of ours between the queue and the op). ``kind``:
        "store", "load" or "expedited_load". A seam for tests
        (tests/fault_injection.py), which make chosen jobs fail."""
        return functools.partial(self.engine.swap, desc.src, desc.dst, desc.sizes)

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Device -> CPU, after the compute that wrote the blocks."""
        return self._submit(self._stores, "store", job_id, src_spec, dst_spec)

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
        kind = "expedited_load" if expedited else "load"
        queue = self._expedited_loads if expedited else self._loads
        return self._submit(queue, kind, job_id, dst_spec, src_spec)

    def get_finished(self) -> list[TransferResult]:
        return self._jobs.report(job for q in self._queues for job in q.poll())

    def queued_bytes(self) -> tuple[int, int]:
        """Bytes of the (store, load) jobs submitted and not yet reported
        finished: what a new job of each direction waits behind
        (``load_wait.py``)."""
        return self._jobs.queued_bytes()

    def wait(self, job_ids: set[int]) -> None:
        for queue in self._queues:
            queue.wait(job_ids)

    def wait_for_progress(self, timeout_s: float) -> None:
        """Blocks until a job in flight finishes, at most ``timeout_s``.

        For engine steps that compute nothing and only wait for transfers:
        without it vLLM steps again at once, over and over, and on the CPU
        backend each step takes CPU time from the copy it is waiting for
        (docs/e2e_benchmark.md). Loads come first (requests wait on them);
        stores only when no load is in flight. Returns at once on streams
        (their DMA does not compete).
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
        self._jobs.clear()
        if all(stopped):
            # Release the (possibly pinned) host memory now, not at GC; a
            # shared region's owner decided what that means.
            self.pool.release()
