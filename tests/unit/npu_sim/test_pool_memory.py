"""The CPU block pool's memory on npu (``host_memory.py``, ``acl_host.py``)
through the core's host calls under the SIMULATED ACL runtime: exact-size
aclrtMallocHost, a registered mmap, pageable when both are refused, pieces
retried smaller and 64 KiB-aligned, every piece given back."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from tests.unit.kv_helpers import make_kv_caches
from tests.unit.npu_sim.sim_acl import (
    ACL_ERROR_RT_INTERNAL_ERROR,
    ACL_ERROR_RT_MEMORY_ALLOCATION,
    ACL_HOST_REG_MAPPED,
    FREE_HOST,
    HOST_REGISTER,
    HOST_UNREGISTER,
    LOC_DEVICE,
    LOC_HOST,
    LOC_UNREGISTERED,
    MALLOC_HOST,
    MAPPED_PINNED,
    SVM,
    SimAcl,
)
from vllm_ascend.kv_offload import acl_host, host_memory, ops
from vllm_ascend.kv_offload.copy_engine import CopyEngine
from vllm_ascend.kv_offload.cpu_pool import CpuBlockPool, PoolLayout
from vllm_ascend.kv_offload.host_pieces import DEFAULT_PIECE_BYTES

NEW_KERNEL, OLD_KERNEL = "6.8.0-generic", "5.10.0-60.18.0.50.oe2203.aarch64"


def npu_memory(sim: SimAcl, rows: int, row_bytes: int, malloc=True, **kwargs):
    """host_memory's npu pool memory through acl_host.AclHostApi over the
    core's calls, linked against the SIMULATED runtime (instead of the native
    op's); without ``malloc``, every aclrtMallocHost is refused (the
    registered mmap is what is left)."""

    def refused(size: int) -> int:
        raise RuntimeError(f"aclrtMallocHost({size} bytes) refused by the test")

    alloc = sim.host_alloc if malloc else refused
    api = acl_host.AclHostApi(
        alloc, sim.host_free, sim.host_register, sim.host_unregister
    )
    kwargs.setdefault("kernel", NEW_KERNEL)
    return host_memory.allocate_host_memory(rows, row_bytes, "npu", acl=api, **kwargs)


def test_sim_npu_pool_memory_is_acl_malloc_host_of_the_exact_size(sim) -> None:
    nbytes = 3 * 4096 + 100
    memory = npu_memory(sim, 1, nbytes)
    assert (memory.kind, memory.pinned, memory.nbytes, memory.pieces) == (
        acl_host.ACL_MALLOC_HOST,
        True,
        nbytes,
        1,
    )
    (unit,) = memory.units
    assert unit.numel() == nbytes
    base = unit.data_ptr()
    assert sim.location_of(base) == sim.location_of(base + nbytes - 1) == LOC_HOST
    unit.fill_(3)  # it is ordinary host memory to the CPU
    del unit
    assert sim.stat(MALLOC_HOST) == 1 and sim.stat(HOST_REGISTER) == 0
    memory.release()
    assert sim.stat(FREE_HOST) == 1  # freed at release, not at exit
    assert sim.location_of(base) == LOC_UNREGISTERED


def test_sim_npu_pool_memory_is_pageable_when_acl_refuses_both(sim, monkeypatch):
    warnings = []
    monkeypatch.setattr(host_memory.logger, "warning", lambda *a: warnings.append(a))
    sim.set(max_host_bytes=4096)  # less than the pool's one unit
    memory = npu_memory(sim, 2, 4096)
    assert (memory.kind, memory.pinned) == (host_memory.PAGEABLE, False)
    message = warnings[-1][0] % warnings[-1][1:]
    assert "aclrtMallocHost: a piece of 8192 bytes: kv_offload_host_alloc(" in message
    assert f"ACL error {ACL_ERROR_RT_MEMORY_ALLOCATION}" in message
    assert "aclrtHostRegisterV2: a piece of 8192 bytes: " in message
    assert "MAPPED alone: " in message  # both flags were tried
    assert "self-check" in message
    memory.release()
    assert sim.stat(HOST_UNREGISTER) == 0 and sim.stat(FREE_HOST) == 0


def test_sim_npu_pool_memory_is_not_registered_on_old_kernels(sim) -> None:
    memory = npu_memory(sim, 2, 4096, malloc=False, kernel=OLD_KERNEL)
    assert memory.kind == host_memory.PAGEABLE
    assert sim.stat(HOST_REGISTER) == 0  # CANN: "causes exceptions" there


def round_trip(sim: SimAcl, memory, rows: int, row_bytes: int) -> None:
    """Stores device blocks into every row of ``memory`` (a pool of ``rows``
    rows, in any order) through the copy engine's addressing and the
    SIMULATED runtime, loads them back into poisoned blocks: byte-exact, and
    no copy straddles two pieces (the runtime would refuse it). Releases
    ``memory``."""
    kv = make_kv_caches(rows, [row_bytes], seed=rows)
    device = kv.tensors[0].tensor
    sim.register(device.view(torch.uint8).numpy(), LOC_DEVICE, device_id=0)
    original = device.clone()
    pool = CpuBlockPool(PoolLayout.of([row_bytes], 1, rows), memory)
    engine = CopyEngine(kv, pool)
    spec = GPULoadStoreSpec(list(range(rows)), group_sizes=[rows], block_indices=[0])
    cpu = np.random.default_rng(rows).permutation(rows)
    for to_cpu in (True, False):
        desc = engine.build(spec, cpu, to_cpu=to_cpu)
        src, dst, size, first = ops.coalesce(desc.src, desc.dst, desc.sizes)
        sim.copy(src, dst, size, first)
        if to_cpu:
            for dev, row in enumerate(cpu.tolist()):
                assert torch.equal(pool.row(row), original[dev])
            device.fill_(0x5A)
    assert torch.equal(device, original)
    pool.release()  # as the worker does: gives ``memory`` back


LIMITED = {"max_host_bytes": 600 * 1024, "host_alignment": SVM}  # < a 1 MiB piece
# 64 rows of 4 KiB in 1 MiB pieces: 16 units of one row, 64 KiB apart (SVM
# alignment); two rows in one piece (the default size).
PIECES, ONE_PIECE = (64, 2**20), (2, DEFAULT_PIECE_BYTES)


@pytest.mark.parametrize(
    ("limits", "malloc", "layout", "kind", "flag", "pieces", "mallocs", "freed_by"),
    [
        # aclrtMallocHost fails (one piece): an mmap, registered MAPPED|PINNED.
        pytest.param(None, True, ONE_PIECE, acl_host.ACL_REGISTERED,
                     MAPPED_PINNED, 1, 1, HOST_UNREGISTER, id="malloc-host-fails"),
        # A piece over the runtime's per-call limit (207001) is allocated as
        # two of half the size: the refused one, then 8 halves.
        pytest.param(LIMITED, True, PIECES, acl_host.ACL_MALLOC_HOST, -1, 8, 1 + 8,
                     FREE_HOST, id="malloc-host-retried-smaller"),
        # A5: PINNED refused (107000), MAPPED alone accepted, pieces larger
        # than the runtime takes registered at half the size.
        pytest.param({**LIMITED, "a5": 1}, False, PIECES,
                     acl_host.ACL_REGISTERED_MAPPED, ACL_HOST_REG_MAPPED, 8, 0,
                     HOST_UNREGISTER, id="a5"),
    ],
)  # fmt: skip
def test_sim_npu_pool_memory_is_pinned_in_aligned_pieces_whatever_acl_refuses(
    sim, limits, malloc, layout, kind, flag, pieces, mallocs, freed_by
) -> None:
    """Every row of the pool page-locked, each unit 64 KiB-aligned (Ascend
    SVM; the simulation refuses any other address when limited), byte-exact
    through the runtime, and every piece given back at release."""
    if limits is None:
        sim.inject(MALLOC_HOST, 1, ACL_ERROR_RT_INTERNAL_ERROR)
    else:
        sim.set(**limits)
    rows, piece_bytes = layout
    memory = npu_memory(sim, rows, 4096, malloc=malloc, piece_bytes=piece_bytes)
    assert (memory.kind, memory.pinned, memory.pieces) == (kind, True, pieces)
    if kind == acl_host.ACL_MALLOC_HOST:
        assert set(memory.piece_bytes) == {512 * 1024}
    assert sim.stat("last_register_flag") == flag
    assert sim.stat(MALLOC_HOST) == mallocs
    units = [(u.data_ptr(), u.numel()) for u in memory.units]
    assert all(addr % SVM == 0 for addr, _ in units)
    for addr, n in units:
        assert sim.location_of(addr) == sim.location_of(addr + n - 1) == LOC_HOST
    round_trip(sim, memory, rows, 4096)
    gc.collect()
    assert sim.stat(freed_by) == pieces
    assert all(sim.location_of(addr) == LOC_UNREGISTERED for addr, _ in units)


def test_sim_acl_malloc_host_is_freed_only_after_its_last_view(sim) -> None:
    memory = npu_memory(sim, 1, 4096)
    view = memory.units[0][:10]
    memory.release()
    assert sim.stat(FREE_HOST) == 0  # a view still reads it
    del view
    assert sim.stat(FREE_HOST) == 1
