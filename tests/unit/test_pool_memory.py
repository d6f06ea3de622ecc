"""The CPU block pool's memory: exactly the asked size, resident from the
start (on the CPU: a faulted-in anonymous mmap), given back at release; the
host-memory guard counts exactly what is allocated; the pool is a layout
over memory, private or borrowed. (npu memory: test_npu_acl_sim.py.)"""

from __future__ import annotations

import mmap

import pytest
import torch

from tests.unit.kv_helpers import make_config, make_kv_caches
from vllm_ascend.kv_offload import cpu_pool, host_memory
from vllm_ascend.kv_offload.cpu_pool import CpuBlockPool, PoolLayout, private_pool
from vllm_ascend.kv_offload.host_ledger import live_pools
from vllm_ascend.kv_offload.host_memory import BORROWED, borrowed
from vllm_ascend.kv_offload.npu import NPUOffloadingSpec

PAGE = mmap.PAGESIZE


def mapping_of(addr: int) -> dict[str, int] | None:
    """Size, Rss (bytes) of this process's mapping that starts at ``addr``,
    from /proc/self/smaps; None if there is none."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start = int(head.split("-")[0], 16)
                found = {} if start == addr else None
            elif found is not None and head in ("Size:", "Rss:"):
                found[head[:-1]] = int(line.split()[1]) * 1024
                if len(found) == 2:
                    return found
    return None


def process_memory() -> tuple[int, int]:
    """(mapped, resident) bytes of this process: VmSize, VmRSS."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmSize", "VmRSS"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmSize"], fields["VmRSS"]


# Python may map a new 1 MiB arena meanwhile; torch's caching host allocator
# would round these sizes up to the next power of two (8 MiB -> 8 MiB is
# exact, so the second size is what tells: 5.2 MB -> 8 MiB).
SLACK = 2**20 + PAGE


@pytest.mark.parametrize(
    "pages, num_blocks", [([PAGE * 16], 64), ([1000, 3000, 77], 640)]
)
def test_cpu_pool_is_mapped_and_resident_at_exactly_its_size(pages, num_blocks):
    # A first pool warms up what allocating one initialises (torch, numpy).
    private_pool(pages, 1, 1, "cpu").release()
    mapped0, resident0 = process_memory()
    pool = private_pool(pages, 2, num_blocks, "cpu")
    mapped1, resident1 = process_memory()
    asked = num_blocks * 2 * sum(pages)
    assert pool.memory.nbytes == asked == pool.nbytes
    # The kernel maps whole pages; the mapping holds the pool and is
    # resident from the start (faulted in, not at the first store).
    assert asked <= mapped1 - mapped0 < asked + SLACK
    assert asked - SLACK < resident1 - resident0 < asked + SLACK
    seen = mapping_of(pool.base)  # may be merged with a neighbouring mapping
    assert seen is not None and seen["Size"] >= asked and seen["Rss"] >= asked
    assert pool.memory.kind == host_memory.PAGEABLE and not pool.pinned
    pool.release()
    assert pool.released and pool.tensor is None


def test_released_pool_is_unmapped():
    pool = private_pool([PAGE], 1, 32, "cpu")
    base = pool.base
    assert mapping_of(base) is not None
    pool.release()
    assert mapping_of(base) is None
    pool.release()  # idempotent


def test_the_guard_counts_exactly_what_is_allocated(host_ledger_dir):
    """What the host-memory guard checked and recorded in the host's ledger
    is the pool's size, byte for byte."""
    kv = make_kv_caches(4, [4096, 12288])
    spec = NPUOffloadingSpec(
        make_config({"num_cpu_blocks": 10}, worker_kv_bytes_per_block=16384)
    )
    reservation = spec.reserve_host_memory(kv)
    pool = spec.allocate_pool(kv)
    try:
        recorded = [p.nbytes for p in live_pools(host_ledger_dir)]
        assert recorded == [pool.memory.nbytes] == [10 * (4096 + 12288)]
    finally:
        pool.release()
        reservation.release()


def test_an_allocation_the_host_refuses_names_num_cpu_blocks(monkeypatch):
    def refuse(*args, **kwargs):
        raise MemoryError("mmap: Cannot allocate memory")

    monkeypatch.setattr(cpu_pool, "allocate_host_memory", refuse)
    with pytest.raises(MemoryError, match="lower num_cpu_blocks"):
        private_pool([256], 1, 10**6, "cpu")


def test_private_and_region_pools_share_one_layout():
    pages = [100, 200]
    private = PoolLayout.of(pages, 2, 8)
    assert list(private.tensor_offsets) == [0, 200]
    assert private.row_bytes == private.slot_bytes == 600
    # A rank's slot at offset 1000 of rows of 4096 bytes.
    region = PoolLayout.of(pages, 2, 8, slot_offset=1000, row_bytes=4096)
    assert list(region.tensor_offsets) == [1000, 1200]
    assert (region.row_bytes, region.slot_bytes) == (4096, 600)


def test_a_pool_over_borrowed_memory_leaves_it_to_its_owner():
    base = torch.zeros(8 * 4096, dtype=torch.int8)
    layout = PoolLayout.of([100, 200], 1, 8, slot_offset=1000, row_bytes=4096)
    pool = CpuBlockPool(layout, borrowed(base, pinned=True))
    assert pool.base == base.data_ptr() and pool.pinned
    assert pool.memory.kind == BORROWED and pool.nbytes == 8 * 300
    pool.release()
    pool.release()
    assert base.untyped_storage().nbytes() == 8 * 4096  # not ours to free
