"""The CPU block pool's memory: exactly the asked size, resident from the
start (on the CPU: a faulted-in anonymous mmap), given back at release; the
host-memory guard counts exactly what is allocated; the pool is a layout
over memory, private or borrowed.

In pieces (``host_pieces.py``): rows never straddle two pieces, no merged
copy runs from one into another, a job over rows of many pieces is
byte-exact through the worker on every copy path, and a 1 TiB pool's
arithmetic holds in address space reserved, never touched. (npu memory and
pieces, against the simulated ACL runtime: npu_sim/test_pool_memory.py.)"""

from __future__ import annotations

import mmap
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from tests.unit.kv_helpers import make_kv_caches, store_then_load
from tests.unit.tier_helpers import smaps
from vllm_ascend.kv_offload import host_memory, ops
from vllm_ascend.kv_offload.copy_engine import CopyEngine
from vllm_ascend.kv_offload.cpu_pool import CpuBlockPool, PoolLayout, private_pool
from vllm_ascend.kv_offload.host_memory import BORROWED, HostMemory, borrowed
from vllm_ascend.kv_offload.host_pieces import (
    DEFAULT_PIECE_BYTES,
    SVM_ALIGNMENT,
    PiecePlan,
    PiecesRefused,
    take_pieces,
)
from vllm_ascend.kv_offload.worker import NPUOffloadingWorker

PAGE = mmap.PAGESIZE
PAGES = [4096, 2048]  # a row of 6 KiB per device block
SMALL = 64 * 2**10  # the smallest host_piece_bytes: 1 row per unit here
GiB, TiB = 2**30, 2**40
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


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
    asked = num_blocks * 2 * sum(pages)
    # The process's totals also count what another thread maps meanwhile (a
    # malloc arena is 64 MiB): of three pools, one must measure exactly.
    for _ in range(3):
        mapped0, resident0 = process_memory()
        pool = private_pool(pages, 2, num_blocks, "cpu")
        mapped1, resident1 = process_memory()
        mapped, resident = mapped1 - mapped0, resident1 - resident0
        if mapped < asked + SLACK and resident < asked + SLACK:
            break
        pool.release()
    assert pool.memory.nbytes == asked == pool.nbytes
    # The kernel maps whole pages; the mapping holds the pool and is
    # resident from the start (faulted in, not at the first store).
    assert asked <= mapped < asked + SLACK
    assert asked - SLACK < resident < asked + SLACK
    seen = smaps(pool.base, starting=True)  # may be merged with a neighbour
    assert seen is not None
    assert int(seen["Size"]) * 1024 >= asked and int(seen["Rss"]) * 1024 >= asked
    assert pool.memory.kind == host_memory.PAGEABLE and not pool.pinned
    base = pool.base
    pool.release()
    assert pool.released and pool.tensor is None
    assert smaps(base, starting=True) is None  # unmapped
    pool.release()  # idempotent


def test_private_and_region_pools_share_one_layout():
    """A region's pool is that layout over borrowed memory, left to its owner."""
    pages = [100, 200]
    private = PoolLayout.of(pages, 2, 8)
    assert list(private.tensor_offsets) == [0, 200]
    assert private.row_bytes == private.slot_bytes == 600
    # A rank's slot at offset 1000 of rows of 4096 bytes.
    region = PoolLayout.of(pages, 2, 8, slot_offset=1000, row_bytes=4096)
    assert list(region.tensor_offsets) == [1000, 1200]
    assert (region.row_bytes, region.slot_bytes) == (4096, 600)
    base = torch.zeros(8 * 4096, dtype=torch.int8)
    pool = CpuBlockPool(region, borrowed(base, pinned=True))
    assert pool.base == base.data_ptr() and pool.pinned
    assert pool.memory.kind == BORROWED and pool.nbytes == 8 * 600
    pool.release()
    pool.release()
    assert base.untyped_storage().nbytes() == 8 * 4096  # not ours to free


# -- a pool in pieces ---------------------------------------------------------


def test_merged_copies_stop_at_unit_boundaries():
    """One tensor fills a row, so consecutive rows merge into one copy;
    they do so within a unit, never across the gap to the next."""
    kv = make_kv_caches(64, [8192])
    # 512 KiB less the gaps, / 16: units of 3 rows of 8 KiB.
    pool = private_pool([8192], 1, 16, "cpu", piece_bytes=8 * SMALL)
    try:
        assert pool.tensors[0].shape == (3, 8192)
        engine = CopyEngine(kv, pool)
        spec = GPULoadStoreSpec(list(range(10)), group_sizes=[10], block_indices=[0])
        desc = engine.build(spec, np.arange(3, 13), to_cpu=True)
        copies = ops.coalesce(desc.src, desc.dst, desc.sizes)[2]
        # Rows 3..12: units 1, 2, 3 whole, then row 12 of unit 4.
        assert copies.tolist() == [3 * 8192] * 3 + [8192]
    finally:
        pool.release()


@pytest.mark.parametrize("copy_path", ["auto", "torch"])
@pytest.mark.parametrize("bpc, first", [(1, 0), (2, 1)])
def test_a_pool_of_many_pieces_is_byte_exact_through_the_worker(copy_path, bpc, first):
    """A small piece limit cuts the pool into units of whole rows, one row a
    unit here (64 KiB / 16 is less than a row), never adjacent: a copy the
    op merges cannot run into the next unit."""
    kv = make_kv_caches(48, PAGES, seed=bpc)
    original = [t.tensor.clone() for t in kv.tensors]
    pool = private_pool(PAGES, bpc, 40, "cpu", piece_bytes=SMALL)
    worker = NPUOffloadingWorker(kv, pool=pool, copy_path=copy_path)
    try:
        row, addresses = bpc * sum(PAGES), pool.row_addresses(np.arange(40))
        units = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in pool.tensors]
        assert units == [(a, a + row) for a in addresses.tolist()]
        assert (np.diff(addresses) > row).all()
        assert pool.memory.nbytes == 40 * row == pool.nbytes
        dev_blocks = list(range(3, 3 + 2 * 9, 2)) + [40, 41, 42]  # 12 blocks
        n_cpu = -(-(first + len(dev_blocks)) // bpc)
        # CPU blocks in every corner of the pool, not in order.
        cpu_blocks = np.random.default_rng(bpc).permutation(40)[:n_cpu].tolist()
        spec = GPULoadStoreSpec(dev_blocks, group_sizes=[12], block_indices=[first])
        results = store_then_load(worker, kv, spec, cpu_blocks)
        assert all(r.success for r in results.values()) and len(results) == 2
        # The rows hold the device pages where the addressing says.
        for k, dev in enumerate(dev_blocks):
            slot = first + k
            row = pool.row(cpu_blocks[slot // bpc])
            at = (slot % bpc) * PAGES[0]
            assert torch.equal(row[at : at + PAGES[0]], original[0][dev])
        assert worker.pool_info().pieces == pool.memory.pieces
    finally:
        worker.shutdown()
    assert pool.released and pool.tensors == []


# -- a 1 TiB pool ---------------------------------------------------------


def refusing_above(limit: int, plan: PiecePlan):
    """A runtime that refuses one call of more than ``limit`` bytes."""

    def take(first_unit: int, units: int) -> int:
        size = plan.piece_span(first_unit, units)
        if size > limit:
            raise RuntimeError(f"ACL error 207001 ({size} bytes)")
        return first_unit

    return take


# Rows of a DeepSeek-V3 block at TP16 (8.99 MB) and of a 32 MiB block.
@pytest.mark.parametrize("row_bytes", [9_428_992, 32 * 2**20])
def test_a_1_tib_pool_is_planned_in_pieces_of_whole_rows(row_bytes):
    """Planned, taken in pieces, and its rows addressed over 1 TiB of address
    space reserved (PROT_NONE, MAP_NORESERVE), never touched: every row's
    address is inside its unit, and rows of different units never adjacent."""
    rows = TiB // row_bytes
    plan = PiecePlan.of(rows, row_bytes, DEFAULT_PIECE_BYTES, SVM_ALIGNMENT)
    pieces, failures = take_pieces(
        plan, refusing_above(DEFAULT_PIECE_BYTES, plan), lambda h: None
    )
    assert failures == []
    # 16 units a piece (the floor a refused piece halves down to is one),
    # each piece at most 64 GiB: 16 or 17 pieces for 1 TiB of whole rows.
    assert plan.units_per_piece == 16
    assert len(pieces) == -(-plan.num_units // 16) in (16, 17)
    assert all(p.nbytes <= 64 * GiB for p in pieces)
    assert sum(plan.rows_of_unit(u) for u in range(plan.num_units)) == rows
    assert plan.unit_rows * row_bytes <= 4 * GiB
    assert plan.stride % SVM_ALIGNMENT == 0  # every unit 64 KiB-aligned
    assert plan.stride > plan.unit_rows * row_bytes  # and a gap after each
    units = [u for p in pieces for u in range(p.first_unit, p.first_unit + p.units)]
    assert units == list(range(plan.num_units))

    reserved = mmap.mmap(
        -1,
        plan.span + SVM_ALIGNMENT,
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE,
        prot=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # not writable: nothing writes it
        whole = torch.frombuffer(reserved, dtype=torch.int8)
    first = -whole.data_ptr() % SVM_ALIGNMENT
    views = [
        whole[first + o : first + o + plan.rows_of_unit(u) * row_bytes]
        for u, o in enumerate(plan.unit_offsets().tolist())
    ]
    memory = HostMemory(views, plan.row_span, "reserved", False)
    pool = CpuBlockPool(PoolLayout.of([row_bytes], 1, rows), memory)
    addresses = pool.row_addresses(np.arange(rows))
    unit = np.arange(rows) // plan.unit_rows
    starts = np.asarray([t.data_ptr() for t in pool.tensors])
    ends = starts + np.asarray([t.numel() for t in pool.tensors])
    assert (addresses >= starts[unit]).all()
    assert (addresses + row_bytes <= ends[unit]).all()  # no row straddles
    assert (starts % SVM_ALIGNMENT == 0).all()
    boundary = np.flatnonzero(np.diff(unit))  # last row of each unit
    assert (addresses[boundary + 1] > addresses[boundary] + row_bytes).all()
    del pool, memory, views, whole
    reserved.close()


def test_a_refused_piece_is_retried_at_half_its_size_down_to_one_unit():
    plan = PiecePlan.of(TiB // 2**25, 2**25, DEFAULT_PIECE_BYTES, SVM_ALIGNMENT)
    # Refused above 40 GiB (vLLM's fork saw failures above 96-128 GiB).
    pieces, failures = take_pieces(plan, refusing_above(40 * GiB, plan), lambda h: None)
    assert len(failures) == 1 and "207001" in failures[0]  # once, then smaller
    assert len(pieces) == -(-plan.num_units // 8)  # 16 units refused, 8 taken
    assert all(p.nbytes <= 40 * GiB for p in pieces)
    with pytest.raises(PiecesRefused) as refused:  # not even one unit: 4 GiB
        take_pieces(plan, refusing_above(3 * GiB, plan), lambda h: None)
    assert len(refused.value.failures) == 5  # 64 -> 32 -> 16 -> 8 -> 4 GiB


def test_a_refusal_gives_back_every_piece_even_when_one_fails_to_go():
    plan = PiecePlan.of(8, 4096, 2 * 4096, 4096)
    taken: list = []
    given_back: list = []

    def take(unit: int, units: int) -> int:
        if unit + units > 4:  # the second half refused, even unit by unit
            raise RuntimeError("refused")
        taken.append(unit)
        return unit

    def give_back(handle: int) -> None:
        given_back.append(handle)
        if handle == taken[-1]:  # the last piece taken fails to go
            raise RuntimeError("error 507000")

    with pytest.raises(PiecesRefused) as refused:
        take_pieces(plan, take, give_back)
    assert len(taken) > 1 and given_back == taken[::-1]  # every one, failed or not
    assert "giving back the piece of" in str(refused.value)
    assert "error 507000" in str(refused.value)


def test_on_cuda_each_piece_is_registered_through_vllms_host_register(
    monkeypatch, caplog
):
    """cudaHostRegister per piece (vLLM's host_register, False when
    refused): a refused piece halved, every piece unregistered at release
    before the mapping goes, also after one failed to (logged). One start-up
    line per pool (docs/host_memory.md), not one from the memory and another
    from the pool repeating its kind and pieces."""
    from vllm.v1.kv_offload.cpu import host_register

    calls, limit = [], 300 * 2**10  # what the runtime takes at most

    def register(addr: int, size: int) -> bool:
        calls.append(("register", addr, size))
        return size <= limit

    monkeypatch.setattr(host_register, "host_register", register)

    def unregister(addr: int) -> None:
        calls.append(("unregister", addr))
        if len(calls) == 1:
            raise RuntimeError("cudaHostUnregister failed")

    monkeypatch.setattr(host_register, "host_unregister", unregister)
    with caplog.at_level("INFO"):
        pool = private_pool([4096], 1, 128, "cuda", piece_bytes=2**20)
    memory = pool.memory
    assert (memory.kind, memory.pinned) == (host_memory.CUDA_REGISTERED, True)
    taken = [(a, n) for op, a, n in calls if n <= limit]
    refused = [n for op, a, n in calls if n > limit]
    assert len(refused) == 1  # the pieces after it keep the smaller size
    assert memory.pieces == len(taken) >= 2
    # Every unit of rows inside exactly one registered piece.
    for unit in memory.units:
        start, end = unit.data_ptr(), unit.data_ptr() + unit.numel()
        assert sum(a <= start and end <= a + n for a, n in taken) == 1
    (line,) = [m for m in caplog.messages if m.startswith("KV offload: CPU block pool")]
    assert line.startswith("KV offload: CPU block pool of 128 blocks x 4096 bytes")
    assert f"of {host_memory.CUDA_REGISTERED} in {memory.pieces} pieces (" in line
    calls.clear()
    pool.release()
    assert calls == [("unregister", a) for a, _ in reversed(taken)]
    assert "cudaHostUnregister failed" in caplog.text


@pytest.mark.parametrize("doc", ["docs/host_memory.md", "docs/host_memory.zh.md"])
def test_the_docs_sample_line_is_what_the_command_beside_it_logs(doc, caplog):
    """The sample under "What the log says" is the pool's line for the
    command beside it (all but the time it took)."""
    text = (Path(__file__).parents[2] / doc).read_text()
    assert "private_pool([65536], 1, 1000, 'cpu').release()" in text
    (sample,) = re.findall(r"^KV offload: CPU block pool of .*$", text, re.M)
    with caplog.at_level("INFO"):
        private_pool([65536], 1, 1000, "cpu").release()
    (line,) = [m for m in caplog.messages if "CPU block pool" in m]
    timeless = re.compile(r"allocated in [0-9.]+ s")
    assert timeless.sub("", line) == timeless.sub("", sample)
