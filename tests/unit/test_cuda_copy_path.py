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

from tests.unit.kv_helpers import make_kv_caches, make_worker, store_then_load
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
    worker = make_worker(kv, blocks_per_chunk=1, num_cpu_blocks=8)
    try:
        assert worker.copy_path == VLLM_BATCH
        # 3 and 4 adjacent: merged into one copy. The queue orders each job
        # after the compute stream (the poisoning) and wait() synchronizes.
        spec = GPULoadStoreSpec([11, 3, 4, 20], group_sizes=[4], block_indices=[0])
        results = store_then_load(worker, kv, spec, [7, 6, 5, 4])
        assert sorted(j for j, r in results.items() if r.success) == [1, 2]
    finally:
        worker.shutdown()
