"""NPUOffloadingSpec: configuration keys and CPU pool sizing."""

import pytest
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from tests.unit.kv_helpers import GUIDE_EXTRA, make_config, make_kv_caches, running
from vllm_ascend.kv_offload.config import OffloadConfigError, cpu_block_bytes
from vllm_ascend.kv_offload.manager import FailureAwareManager
from vllm_ascend.kv_offload.npu import NPUOffloadingSpec


@pytest.mark.parametrize("bpc", [1, 2, 4])
def test_guide_num_cpu_blocks_counts_blocks_of_block_size_tokens(bpc):
    spec = NPUOffloadingSpec(make_config(GUIDE_EXTRA, blocks_per_chunk=bpc))
    assert spec.num_chunks == 1000
    assert spec.blocks_per_chunk == bpc


def test_cpu_bytes_to_use_is_accepted_as_in_vllm():
    block = cpu_block_bytes(make_config({}))
    assert block == 65536
    spec = NPUOffloadingSpec(make_config({"cpu_bytes_to_use": 10 * block + 5}))
    assert spec.num_chunks == 10


def test_cpu_block_bytes_covers_all_workers_and_sub_blocks():
    config = make_config({}, worker_kv_bytes_per_block=1000, blocks_per_chunk=3)
    # 3000 bytes rounded up to vLLM's 4096-byte alignment.
    assert cpu_block_bytes(config) == 4096
    config = make_config({}, worker_kv_bytes_per_block=65536, world_size=2)
    assert cpu_block_bytes(config) == 131072


def test_both_sizes_agreeing_is_fine_and_disagreeing_is_an_error():
    ok = {"num_cpu_blocks": 4, "cpu_bytes_to_use": 4 * 65536}
    assert NPUOffloadingSpec(make_config(ok)).num_chunks == 4
    bad = {"num_cpu_blocks": 4, "cpu_bytes_to_use": 100 * 65536}
    with pytest.raises(OffloadConfigError, match="set only one"):
        NPUOffloadingSpec(make_config(bad))


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_vllm_eviction_policies_are_reused(policy):
    spec = NPUOffloadingSpec(
        make_config({"num_cpu_blocks": 8, "eviction_policy": policy})
    )
    assert spec.eviction_policy == policy
    manager = spec.get_manager()
    # vLLM's manager, wrapped to hear about failed transfers.
    assert isinstance(manager, FailureAwareManager)
    assert isinstance(manager.inner, CPUOffloadingManager)


def test_worker_pool_is_exactly_num_cpu_blocks_times_one_cpu_block():
    page_bytes = [32768, 32768]
    for bpc in (1, 2):
        config = make_config(
            {"num_cpu_blocks": 7},
            worker_kv_bytes_per_block=sum(page_bytes),
            blocks_per_chunk=bpc,
        )
        spec = NPUOffloadingSpec(config)
        with running(spec.get_worker(make_kv_caches(4, page_bytes))) as worker:
            # One CPU block = bpc device blocks of every cached tensor.
            assert worker.pool.nbytes == 7 * bpc * sum(page_bytes)
            assert worker.pool.tensor.shape == (7, bpc * sum(page_bytes))
