"""Copy engine descriptors and worker round trips on synthetic CPU caches."""

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from tests.unit.conftest import kv_offload_threads
from tests.unit.kv_helpers import make_kv_caches, make_worker, store_then_load
from vllm_ascend.kv_offload.copy_engine import CopyEngine
from vllm_ascend.kv_offload.copy_paths import TORCH, candidate_paths
from vllm_ascend.kv_offload.cpu_pool import private_pool

PAGES = [256, 256, 512]  # e.g. K, V and a larger third part


def engine_for(bpc, pages=PAGES, **kv_kwargs):
    """Caches of 16 device blocks of ``pages``, and an engine between them and
    a private pool of 8 CPU blocks of ``bpc`` device blocks each."""
    kv = make_kv_caches(16, pages, **kv_kwargs)
    pool = private_pool([t.page_size_bytes for t in kv.tensors], bpc, 8, "cpu")
    return kv, CopyEngine(kv, pool), pool


def cpu_page_addr(pool, tensor_idx, cpu_block, slot):
    return (
        pool.base
        + cpu_block * pool.row_bytes
        + int(pool.tensor_offsets[tensor_idx])
        + slot * PAGES[tensor_idx]
    )


def test_one_fragment_per_block_and_tensor_with_exact_addresses():
    """A store copies device pages to CPU slots; a load swaps source and
    destination."""
    kv, engine, pool = engine_for(bpc=1)
    spec = GPULoadStoreSpec([5, 9], group_sizes=[2], block_indices=[0])
    desc = engine.build(spec, np.array([3, 1]), to_cpu=True)
    load = engine.build(spec, np.array([3, 1]), to_cpu=False)
    assert torch.equal(desc.src, load.dst)
    assert torch.equal(desc.dst, load.src)

    assert desc.num_fragments == 2 * len(PAGES)
    assert desc.num_bytes == 2 * sum(PAGES)
    src, dst, sizes = desc.src.tolist(), desc.dst.tolist(), desc.sizes.tolist()
    i = 0
    for t, page in enumerate(PAGES):
        for dev_block, cpu_block in [(5, 3), (9, 1)]:
            assert src[i] == kv.tensors[t].tensor[dev_block].data_ptr()
            assert dst[i] == cpu_page_addr(pool, t, cpu_block, 0)
            assert sizes[i] == page
            i += 1


@pytest.mark.parametrize(
    "bpc, first, slots",
    [
        # Four logical blocks -> two CPU blocks, two slots each.
        (2, 0, [(6, 0), (6, 1), (2, 0), (2, 1)]),
        # Logical blocks 6..10 of the request: 6 sits in slot 2 of its CPU
        # block, so the first CPU block's leading slots are skipped.
        (4, 6, [(7, 2), (7, 3), (0, 0), (0, 1), (0, 2)]),
    ],
    ids=["consecutive-blocks-share-a-cpu-block", "partial-first-cpu-block"],
)
def test_block_size_factor_packs_device_blocks_into_cpu_block_slots(bpc, first, slots):
    _, engine, pool = engine_for(bpc)
    n, rows = len(slots), list(dict.fromkeys(row for row, _ in slots))
    spec = GPULoadStoreSpec(list(range(n)), group_sizes=[n], block_indices=[first])
    desc = engine.build(spec, np.array(rows), to_cpu=True)
    dst = desc.dst.view(len(PAGES), n).tolist()
    for t in range(len(PAGES)):
        assert dst[t] == [cpu_page_addr(pool, t, row, slot) for row, slot in slots]


def test_groups_use_their_own_tensors_and_blocks():
    kv, engine, pool = engine_for(bpc=1, groups=[[0, 1], [2]])
    spec = GPULoadStoreSpec([3, 4, 10], group_sizes=[2, 1], block_indices=[0, 0])
    desc = engine.build(spec, np.array([0, 1, 5]), to_cpu=True)
    assert desc.num_fragments == 2 * 2 + 1
    assert desc.dst.tolist()[-1] == cpu_page_addr(pool, 2, 5, 0)
    assert desc.src.tolist()[-1] == kv.tensors[2].tensor[10].data_ptr()


def test_aliased_layers_are_copied_once():
    _, engine, _ = engine_for(bpc=1, pages=PAGES[:1], groups=[[0, 0]])
    spec = GPULoadStoreSpec([1, 2], group_sizes=[2], block_indices=[0])
    assert engine.build(spec, np.array([0, 1]), to_cpu=True).num_fragments == 2


def test_inconsistent_job_is_rejected():
    _, engine, _ = engine_for(bpc=1)
    spec = GPULoadStoreSpec([1, 2, 3], group_sizes=[3], block_indices=[0])
    with pytest.raises(ValueError, match="too few"):
        engine.build(spec, np.array([0, 1]), to_cpu=True)
    with pytest.raises(ValueError, match="use 3 and 3"):
        engine.build(spec, np.array([0, 1, 2, 3]), to_cpu=True)


def test_build_on_a_released_pool_raises():
    _, engine, pool = engine_for(bpc=1)
    spec = GPULoadStoreSpec([5, 9], group_sizes=[2], block_indices=[0])
    engine.build(spec, np.array([3, 1]), to_cpu=True)  # fine while it lives
    pool.release()
    # Its base is 0 now: descriptors would name small non-null addresses.
    with pytest.raises(RuntimeError, match="the CPU block pool has been released"):
        engine.build(spec, np.array([3, 1]), to_cpu=True)


def test_swap_returns_the_copy_count_and_the_workspace():
    kv, engine, pool = engine_for(bpc=1, pages=PAGES[:1], seed=4)
    # Two adjacent device blocks into two adjacent CPU rows: one merged copy.
    spec = GPULoadStoreSpec([2, 3], group_sizes=[2], block_indices=[0])
    desc = engine.build(spec, np.array([4, 5]), to_cpu=True)
    assert engine.swap is None  # no copy function until use()
    path = candidate_paths("cpu")[0]
    engine.use(path.bind(engine.buffers()))
    copies, workspace = engine.swap(desc.src, desc.dst, desc.sizes)
    assert (desc.num_fragments, copies) == (2, 1)
    # "cpu" copies synchronously: nothing to keep alive (the torch path, a
    # build without native code, has no workspace at all).
    if path.name == TORCH:
        assert workspace is None
    else:
        assert workspace.dtype == torch.uint8 and workspace.numel() == 0
    stored = pool.tensor[4:6].view(-1)
    assert torch.equal(stored, kv.tensors[0].tensor[2:4].reshape(-1).view(torch.int8))


@pytest.mark.parametrize("bpc, first", [(1, 0), (2, 0), (4, 1), (4, 3)])
def test_worker_round_trip_is_byte_exact(bpc, first):
    kv = make_kv_caches(32, PAGES, seed=bpc + first)
    worker = make_worker(kv, bpc, 8)
    try:
        dev_blocks = [11, 3, 4, 20, 7, 8]
        n_cpu = -(-(first % bpc + len(dev_blocks)) // bpc)
        cpu_blocks = list(range(7, 7 - n_cpu, -1))
        spec = GPULoadStoreSpec(dev_blocks, group_sizes=[6], block_indices=[first])
        results = store_then_load(worker, kv, spec, cpu_blocks)
        assert set(results) == {1, 2}
        for r in results.values():
            assert r.success
            assert r.transfer_size == len(dev_blocks) * sum(PAGES)
            assert r.transfer_time is not None and r.transfer_time >= 0
    finally:
        worker.shutdown()


def test_worker_shutdown_with_jobs_in_flight_returns():
    kv = make_kv_caches(64, [1 << 16])
    before = set(kv_offload_threads())
    worker = make_worker(kv, 1, 64)
    spec = GPULoadStoreSpec(list(range(64)), group_sizes=[64], block_indices=[0])
    for job in range(8):
        worker.submit_store(job, spec, CPULoadStoreSpec(list(range(64))))
    worker.shutdown()
    assert set(kv_offload_threads()) <= before  # its copy threads have ended
