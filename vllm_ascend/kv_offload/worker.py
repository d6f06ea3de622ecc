"""Worker side of NPU offloading: submits and tracks KV transfers.

The same worker runs on ``npu``, ``cuda`` and ``cpu``: the copy engine builds a
job's descriptors, and a per-direction ``TransferQueue`` decides where the
copies run (a dedicated stream, or a thread on the CPU backend).
"""

from __future__ import annotations

import time

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
from vllm_ascend.kv_offload.transfer_queue import TransferQueue, make_transfer_queue
from vllm_ascend.logger import init_logger

logger = init_logger(__name__)


def host_pinning_available(device: torch.device) -> bool:
    """Whether page-locked host memory can be allocated for ``device``."""
    if device.type == "cpu":
        return False
    try:
        return bool(torch.empty(1, pin_memory=True, device="cpu").is_pinned())
    except RuntimeError:
        return False


class NPUOffloadingWorker(OffloadingWorker):
    """Moves KV blocks between the device cache and a CPU block pool."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_cpu_blocks: int,
    ):
        if not kv_caches.tensors:
            raise ValueError("NPUOffloadingWorker needs at least one KV cache tensor")
        self.device = kv_caches.tensors[0].tensor.device
        pin = host_pinning_available(self.device)
        if not pin:
            logger.info(
                "KV offload: page-locked host memory is not available on %s; "
                "the CPU block pool uses pageable memory",
                self.device.type,
            )
        t0 = time.perf_counter()
        self.pool = CpuBlockPool(
            page_bytes=[t.page_size_bytes for t in kv_caches.tensors],
            blocks_per_chunk=blocks_per_chunk,
            num_cpu_blocks=num_cpu_blocks,
            pin_memory=pin,
        )
        logger.info(
            "KV offload: CPU block pool of %d blocks x %d bytes (%.2f GiB, %s) "
            "allocated in %.2f s for %d KV cache tensors on %s",
            num_cpu_blocks,
            self.pool.row_bytes,
            self.pool.nbytes / 2**30,
            "pinned" if pin else "pageable",
            time.perf_counter() - t0,
            len(kv_caches.tensors),
            self.device,
        )
        self.engine = CopyEngine(kv_caches, self.pool)
        self._stores = make_transfer_queue(self.device, "store")
        self._loads = make_transfer_queue(self.device, "load")
        # job_id -> bytes, for the TransferResult.
        self._job_bytes: dict[int, int] = {}

    def _submit(
        self,
        queue: TransferQueue,
        job_id: int,
        device_spec: LoadStoreSpec,
        cpu_spec: LoadStoreSpec,
        to_cpu: bool,
    ) -> bool:
        assert isinstance(device_spec, GPULoadStoreSpec)
        assert isinstance(cpu_spec, BlockIDsLoadStoreSpec)
        desc: Descriptors = self.engine.build(
            device_spec, np.asarray(cpu_spec.block_ids), to_cpu=to_cpu
        )
        self._job_bytes[job_id] = desc.num_bytes
        queue.submit(job_id, lambda: self.engine.submit(desc))
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
        """CPU -> device. ``expedited`` (vLLM >= 0.33) changes nothing here:
        loads already have a queue of their own."""
        return self._submit(self._loads, job_id, dst_spec, src_spec, to_cpu=False)

    def get_finished(self) -> list[TransferResult]:
        results = []
        for job in self._stores.poll() + self._loads.poll():
            results.append(
                TransferResult(
                    job_id=job.job_id,
                    success=job.success,
                    transfer_size=self._job_bytes.pop(job.job_id, 0),
                    transfer_time=job.seconds,
                )
            )
        return results

    def wait(self, job_ids: set[int]) -> None:
        self._stores.wait(job_ids)
        self._loads.wait(job_ids)

    def shutdown(self) -> None:
        self._stores.shutdown()
        self._loads.shutdown()
        self._job_bytes.clear()
