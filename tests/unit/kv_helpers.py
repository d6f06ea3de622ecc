"""Synthetic KV caches, offloading configs, workers and transfer jobs for unit
tests (no engine)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

if TYPE_CHECKING:
    from vllm_ascend.kv_offload.connector import AscendOffloadingConnectorMetadata

# The guide's kv_connector_extra_config (docs/user_guide.md) and its spec.
OUR_SPEC = {
    "spec_name": "NPUOffloadingSpec",
    "spec_module_path": "vllm_ascend.kv_offload.npu",
}
GUIDE_EXTRA = {"num_cpu_blocks": 1000, "block_size": 128, **OUR_SPEC}
BLOCK = 65536  # bytes of one CPU block in make_config's default


def make_config(
    extra: dict,
    worker_kv_bytes_per_block: int = 65536,
    blocks_per_chunk: int = 1,
    tokens_per_block: int = 128,
    world_size: int = 1,
    rank: int = 0,
    replicated_layout: bool = False,
    engine_id: str = "test-engine",
) -> OffloadingConfig:
    """``replicated_layout``: vLLM's flag for KV every rank holds the same
    (MLA under tensor parallelism)."""
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=tokens_per_block,
                layer_names=("layers.0.attn", "layers.1.attn"),
                group_id=0,
            ),
        ),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=engine_id,
        model=OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=OffloadingCacheConfig(
            tokens_per_hash=tokens_per_block, blocks_per_chunk=blocks_per_chunk
        ),
        replicated_layout=replicated_layout,
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def make_kv_caches(
    num_blocks: int,
    page_bytes: list[int],
    groups: list[list[int]] | None = None,
    seed: int = 0,
    device: str = "cpu",
) -> CanonicalKVCaches:
    """One int8 ``[num_blocks, page]`` tensor per entry of ``page_bytes`` on
    ``device``, filled with random bytes; ``groups`` lists the tensor indices
    per group (default: one group holding every tensor)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        CanonicalKVCacheTensor(
            tensor=torch.randint(
                -128, 128, (num_blocks, page), dtype=torch.int8, generator=gen
            ).to(device),
            page_size_bytes=page,
        )
        for page in page_bytes
    ]
    groups = groups if groups is not None else [list(range(len(page_bytes)))]
    refs = [
        [CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page_bytes[i]) for i in g]
        for g in groups
    ]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def parts_of(cache) -> list[torch.Tensor]:
    """The tensors of one layer's entry in a ``kv_caches`` dict (a tensor,
    or a tuple/list of them as vllm-ascend registers)."""
    return [cache] if isinstance(cache, torch.Tensor) else list(cache)


def cpu_queues() -> tuple:
    """A worker's three queues (stores, loads, expedited loads) on the CPU
    backend, for a test that submits to one of them itself."""
    from vllm_ascend.kv_offload.transfer_queue import ThreadTransferQueue

    return tuple(ThreadTransferQueue(n) for n in ("store", "load", "load-expedited"))


def make_worker(
    kv_caches: CanonicalKVCaches,
    blocks_per_chunk: int,
    num_cpu_blocks: int,
    worker_cls: type | None = None,
    **kwargs,
):
    """A worker (``NPUOffloadingWorker`` or ``worker_cls``) on a private pool
    of ``num_cpu_blocks`` blocks of ``blocks_per_chunk`` device blocks, as
    ``NPUOffloadingSpec.get_worker`` assembles one."""
    from vllm_ascend.kv_offload.cpu_pool import private_pool
    from vllm_ascend.kv_offload.worker import NPUOffloadingWorker

    pages = [t.page_size_bytes for t in kv_caches.tensors]
    device = kv_caches.tensors[0].tensor.device.type if pages else "cpu"
    pool = private_pool(pages, blocks_per_chunk, num_cpu_blocks, device)
    return (worker_cls or NPUOffloadingWorker)(kv_caches, pool, **kwargs)


def worker_report(completed_jobs: dict, failed=()):
    """One worker's metadata of a step (``AscendOffloadingWorkerMetadata``):
    the jobs it finished, ``failed`` among them."""
    from vllm_ascend.kv_offload.failures import AscendOffloadingWorkerMetadata

    meta = AscendOffloadingWorkerMetadata(failed_jobs=set(failed))
    meta.completed_jobs.update(completed_jobs)
    return meta


@contextlib.contextmanager
def running(worker) -> Iterator:
    """``worker``, shut down however the block ends."""
    try:
        yield worker
    finally:
        worker.shutdown()


def store_then_load(worker, kv: CanonicalKVCaches, spec, cpu_blocks: list[int]):
    """Stores ``spec``'s device blocks into ``cpu_blocks`` (job 1), poisons
    them on the device, loads them back (job 2) and checks every KV cache
    tensor is as before; returns the jobs' TransferResults by job id."""
    original = [t.tensor.clone() for t in kv.tensors]
    assert worker.submit_store(1, spec, CPULoadStoreSpec(cpu_blocks))
    worker.wait({1})
    for t in kv.tensors:
        t.tensor[list(spec.block_ids)] = 0x5A
    assert worker.submit_load(2, CPULoadStoreSpec(cpu_blocks), spec)
    worker.wait({2})
    for t, before in zip(kv.tensors, original, strict=True):
        assert torch.equal(t.tensor, before)
    return {r.job_id: r for r in worker.get_finished()}


# Transfer jobs between device blocks and the CPU blocks of the same ids, and
# the scheduler's connector metadata carrying them to the workers.


def gpu(*blocks: int) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(list(blocks), group_sizes=[len(blocks)], block_indices=[0])


def load(req: str, *blocks: int) -> TransferJob:
    return TransferJob(req, CPULoadStoreSpec(list(blocks)), gpu(*blocks))


def store(req: str, *blocks: int) -> TransferJob:
    return TransferJob(req, gpu(*blocks), CPULoadStoreSpec(list(blocks)))


def metadata(load_jobs=None, store_jobs=None) -> AscendOffloadingConnectorMetadata:
    from vllm_ascend.kv_offload.connector import AscendOffloadingConnectorMetadata

    return AscendOffloadingConnectorMetadata(
        load_jobs=load_jobs or {}, store_jobs=store_jobs or {}
    )
