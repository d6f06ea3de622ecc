"""A test-only spec whose loads deliver wrong KV: the negative control.

It proves the e2e tests can fail: if outputs stayed equal with corrupted
loads, the loaded KV would not be what the model reads.
"""

from __future__ import annotations

from vllm_ascend.kv_offload.npu import NPUOffloadingSpec
from vllm_ascend.kv_offload.worker import NPUOffloadingWorker


class CorruptingWorker(NPUOffloadingWorker):
    def submit_load(self, job_id, src_spec, dst_spec, expedited=False):
        # Flip the CPU copy's bytes before loading it (the pool is host
        # memory on every backend), so wrong KV reaches the device.
        rows = self.pool.tensor[src_spec.block_ids]
        self.pool.tensor[src_spec.block_ids] = rows ^ 0x55
        return super().submit_load(job_id, src_spec, dst_spec, expedited)


class CorruptingOffloadingSpec(NPUOffloadingSpec):
    worker_cls = CorruptingWorker
