"""On an NVIDIA GPU, KV moves through vLLM's own ``swap_blocks_batch``
(``copy_paths.VLLM_BATCH``), verified by the start-up self-check like any
path, and a worker's store and load are byte-exact through it.

Needs a CUDA GPU and a CUDA build of vLLM: skipped here (vLLM's CPU build,
no GPU). ``scripts/device_check_cuda.sh`` runs it on such a machine.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from tests.unit.kv_helpers import make_kv_caches, make_worker
from vllm_ascend.kv_offload.copy_paths import VLLM_BATCH, Available, candidate_paths
from vllm_ascend.kv_offload.self_check import run_self_check

HAS_VLLM_OP = Available.here("cuda").vllm_swap is not None
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_VLLM_OP),
    reason="needs a CUDA GPU and a CUDA build of vLLM (its swap_blocks_batch op)",
)
PAGES = [4096, 4096, 1024]


def test_cuda_tries_vllms_op_first():
    assert [p.name for p in candidate_paths("cuda")] == [VLLM_BATCH, "torch"]


def test_the_self_check_passes_on_vllms_op():
    result = run_self_check("cuda", PAGES)
    assert result.passed, result.failure
    assert result.path == VLLM_BATCH and result.swap is not None


def test_a_worker_round_trip_through_vllms_op_is_byte_exact():
    kv = make_kv_caches(32, PAGES, seed=3, device="cuda")
    original = [t.tensor.clone() for t in kv.tensors]
    worker = make_worker(kv, blocks_per_chunk=1, num_cpu_blocks=8)
    try:
        assert worker.copy_path == VLLM_BATCH
        dev_blocks = [11, 3, 4, 20]  # 3 and 4 adjacent: merged into one copy
        spec = GPULoadStoreSpec(dev_blocks, group_sizes=[4], block_indices=[0])
        assert worker.submit_store(1, spec, CPULoadStoreSpec([7, 6, 5, 4]))
        worker.wait({1})
        for t in kv.tensors:
            t.tensor[dev_blocks] = 0x5A
        torch.cuda.synchronize()
        assert worker.submit_load(2, CPULoadStoreSpec([7, 6, 5, 4]), spec)
        worker.wait({2})
        torch.cuda.synchronize()
        assert sorted(r.job_id for r in worker.get_finished() if r.success) == [1, 2]
        for t, want in zip(kv.tensors, original, strict=True):
            assert torch.equal(t.tensor, want)
    finally:
        worker.shutdown()
