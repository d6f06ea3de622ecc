"""The host-memory guard: the CPU block pool is checked once, by the worker
that allocates it, right before it does, against the host memory available
then (after vLLM's own allocations: on its CPU backend the KV cache is host
memory too). The scheduler side allocates nothing and checks nothing.

Host memory is faked (``host_guard.host_available_bytes``); the worker is a
recorder, so no test allocates a pool; each test has a host ledger of its
own (``host_ledger_dir``), empty: no other worker on the host.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)

from tests.unit.kv_helpers import make_config, make_kv_caches
from tests.unit.tier_helpers import refusal
from vllm_ascend.kv_offload.npu import NPUOffloadingSpec

GiB, MiB = 2**30, 2**20
BLOCK = 65536  # bytes of one CPU block: make_config's default, one 64 KiB page


class PoolRecorder:
    """Stands in for the worker: records the pools it was built on."""

    built: list[int] = []

    def __init__(self, kv_caches, pool, copy_path: str = "auto"):
        PoolRecorder.built.append(pool.num_blocks)


class RecordingSpec(NPUOffloadingSpec):
    """Allocates nothing: its pool is the layout the spec asked for."""

    worker_cls = PoolRecorder

    def allocate_pool(self, kv_caches):
        return SimpleNamespace(
            num_blocks=self.num_chunks,
            release=lambda: None,
            on_release=lambda callback: None,
        )


@pytest.fixture(autouse=True)
def no_pools_yet(host_ledger_dir):
    PoolRecorder.built = []


def kv() -> CanonicalKVCaches:
    """A small KV cache in host memory (as on vLLM's CPU backend)."""
    return make_kv_caches(4, [BLOCK])


def unwritten_kv(blocks: int, page: int, device: str = "cpu") -> CanonicalKVCaches:
    """A KV cache of one ``[blocks, page]`` tensor never written (no memory
    used for it on "cpu"; "meta": not host memory, as on an NPU or GPU)."""
    tensor = torch.empty((blocks, page), dtype=torch.int8, device=device)
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=tensor, page_size_bytes=page)],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=page)]],
    )


def test_the_scheduler_side_checks_no_memory(available):
    """Built after the workers allocated their pools, it must not count them
    (it used to, and refused pools that had been allocated fine)."""
    available(0)
    spec = NPUOffloadingSpec(make_config({"num_cpu_blocks": 1000}))
    assert spec.num_chunks == 1000
    spec.get_manager()


def test_the_largest_pool_that_fits_is_allocated_and_one_block_more_is_not(
    available,
):
    available(GiB)  # 90 % of it holds 14745 blocks of 64 KiB
    message = refusal(
        lambda: RecordingSpec(make_config({"num_cpu_blocks": 14746})).get_worker(kv())
    )
    assert "['num_cpu_blocks']=14746" in message
    assert "lower num_cpu_blocks to 14745" in message
    assert "1.00 GiB of host memory available" in message
    assert PoolRecorder.built == []  # refused before anything was allocated

    spec = RecordingSpec(make_config({"num_cpu_blocks": 14745}))
    worker = spec.get_worker(kv())
    assert PoolRecorder.built == [14745]
    available(0)  # checked once: the worker exists now
    assert spec.get_worker(kv()) is worker


def test_cpu_bytes_to_use_is_checked_in_its_own_terms(available):
    available(GiB)
    message = refusal(
        lambda: RecordingSpec(make_config({"cpu_bytes_to_use": 2 * GiB})).get_worker(
            kv()
        )
    )
    assert f"['cpu_bytes_to_use']={2 * GiB}" in message
    assert f"lower cpu_bytes_to_use to {14745 * BLOCK}" in message


def test_memory_vllm_allocated_after_start_up_counts_and_the_fix_names_it(
    available,
):
    """vLLM's CPU backend allocates its KV cache (host memory) after the
    spec is built and before the pool: the pool must fit in what is left,
    and the error says which of the two to lower, and to what."""
    available(200 * MiB)  # when the spec is built
    spec = RecordingSpec(make_config({"num_cpu_blocks": 2400}))  # 150 MiB
    kv_cache = make_kv_caches(1024, [BLOCK])  # 64 MiB of host memory
    available(136 * MiB)  # what the KV cache left
    message = refusal(lambda: spec.get_worker(kv_cache))
    assert "lower num_cpu_blocks to 1958" in message  # 90 % of 136 MiB
    # 150 MiB fit in 90 % of 136 + 30.67 MiB: the KV cache may keep 33.33 MiB.
    assert "takes 64.00 MiB of host memory" in message
    assert "set kv_cache_memory_bytes to at most 34952533" in message
    assert PoolRecorder.built == []


def test_the_fix_for_vllm_cpu_kvcache_space_is_in_its_unit(available, monkeypatch):
    """VLLM_CPU_KVCACHE_SPACE counts whole GiB: the fix says which value."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    page = 64 * MiB
    kv_cache = unwritten_kv(128, page)  # 8 GiB of KV cache
    available(12 * GiB)  # what the KV cache left
    spec = RecordingSpec(make_config({"num_cpu_blocks": 240}, page))  # 15 GiB
    message = refusal(lambda: spec.get_worker(kv_cache))
    assert "lower num_cpu_blocks to 172" in message  # 90 % of 12 GiB
    # 15 GiB fit in 90 % of 12 + 4.67 GiB: 3 of the 8 GiB may stay.
    assert "lower VLLM_CPU_KVCACHE_SPACE from 8 to 3" in message
    assert PoolRecorder.built == []


def test_a_kv_cache_outside_host_memory_is_not_offered_as_the_fix(available):
    available(GiB)
    spec = RecordingSpec(make_config({"num_cpu_blocks": 20000}))
    message = refusal(lambda: spec.get_worker(unwritten_kv(4, BLOCK, "meta")))
    assert "lower num_cpu_blocks to 14745" in message
    assert "VLLM_CPU_KVCACHE_SPACE" not in message


@pytest.mark.parametrize(
    "chunk, fix",
    [
        ({}, "one device block (128 tokens) already"),
        ({"block_size": 256}, "lower block_size from 256 to 128"),
        ({"blocks_per_chunk": 2}, "lower blocks_per_chunk from 2 to 1"),
    ],
)
def test_a_block_larger_than_the_limit_says_what_makes_blocks_smaller(
    available, chunk, fix
):
    bpc = 2 if chunk else 1
    available(bpc * BLOCK)  # 90 % of it holds no block
    spec = RecordingSpec(
        make_config({"num_cpu_blocks": 1, **chunk}, blocks_per_chunk=bpc)
    )
    message = refusal(lambda: spec.get_worker(kv()))
    assert f"one CPU block ({bpc * BLOCK} bytes)" in message
    assert fix in message
    assert "num_cpu_blocks to 0" not in message
