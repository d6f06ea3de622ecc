"""The SIMULATED ACL runtime itself follows the documented rules, the limits
of real runtimes it can be set to, and the ACL headers' constants, so that
the tests of the core under it mean something."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from tests.unit.npu_sim import sim_acl
from tests.unit.npu_sim.sim_acl import (
    ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    ACL_ERROR_HOST_MEMORY_NOT_REGISTERED,
    ACL_ERROR_INVALID_PARAM,
    ACL_ERROR_RT_ADDR_UNALIGNED,
    ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
    ACL_ERROR_RT_INVALID_MEMORY_TYPE,
    ACL_ERROR_RT_MEMORY_ALLOCATION,
    ACL_ERROR_RT_PARAM_INVALID,
    ACL_HOST_REG_MAPPED,
    ACL_HOST_REG_PINNED,
    ATTRS,
    BATCH,
    D2H,
    FREE_HOST,
    H2H,
    HOST_REGISTER,
    HOST_UNREGISTER,
    LOC_DEVICE,
    LOC_HOST,
    LOC_UNREGISTERED,
    MALLOC_HOST,
    MAPPED_PINNED,
    REPORT,
    SINGLE,
    SIZE_MAX,
    STREAM,
    SVM,
    SYNC,
    Pools,
    Region,
    SimAcl,
)


class _BatchAttr(ctypes.Structure):  # aclrtMemcpyBatchAttr
    _fields_ = [
        ("dst_id", ctypes.c_uint32),
        ("dst_type", ctypes.c_int),
        ("src_id", ctypes.c_uint32),
        ("src_type", ctypes.c_int),
        ("rsv", ctypes.c_uint8 * 16),
    ]


def _raw_batch(sim, dsts, dmax, srcs, sizes, attrs, idx):
    """Calls the SIMULATED aclrtMemcpyBatchAsync directly: (rc, failIndex)."""
    n, k = len(sizes), len(attrs)
    arrays = (
        (ctypes.c_void_p * n)(*dsts),
        (ctypes.c_size_t * n)(*dmax),
        (ctypes.c_void_p * n)(*srcs),
        (ctypes.c_size_t * n)(*sizes),
        (_BatchAttr * k)(*[_BatchAttr(*a) for a in attrs]),
        (ctypes.c_size_t * k)(*idx),
    )
    sim.keep_alive.append(arrays)  # read again when the copy runs
    fail, size = ctypes.c_size_t(0), ctypes.c_size_t
    args = (*arrays[:4], size(n), *arrays[4:], size(k), ctypes.byref(fail))
    return sim.lib.aclrtMemcpyBatchAsync(*args, ctypes.c_void_p(STREAM)), fail.value


def test_sim_runtime_follows_the_documented_rules(sim: SimAcl) -> None:
    """Checks the simulation itself, so that the tests above mean something."""
    pools = Pools(sim, 1 << 16)
    dev, pin, page = (
        p.ctypes.data for p in (pools.device, pools.pinned, pools.pageable)
    )
    h2d = (3, LOC_DEVICE, 0, LOC_HOST)  # dstLoc (id, type), srcLoc (id, type)

    def batch(dsts, srcs, dmax=None, attr=h2d, first_index=0):
        sizes = [8] * len(dsts)
        return _raw_batch(sim, dsts, dmax or sizes, srcs, sizes, [attr], [first_index])

    n = 4097
    over_cap = batch([dev + 8 * i for i in range(n)], [pin + 8 * i for i in range(n)])
    assert batch([dev], [pin]) == (0, SIZE_MAX)
    assert over_cap == (ACL_ERROR_INVALID_PARAM, SIZE_MAX)
    assert batch([dev], [pin], first_index=1) == (ACL_ERROR_INVALID_PARAM, SIZE_MAX)
    too_big = batch([dev, dev + 8], [pin, pin + 8], dmax=[8, 4])
    assert too_big == (ACL_ERROR_INVALID_PARAM, 1)  # size > destMax
    undeclared_pageable = batch([dev, dev + 8], [pin, page])
    assert undeclared_pageable == (ACL_ERROR_RT_INVALID_MEMORY_TYPE, 1)
    wrong_device = batch([dev], [pin], attr=(4, LOC_DEVICE, 0, LOC_HOST))
    assert wrong_device == (ACL_ERROR_RT_INVALID_MEMORY_TYPE, 0)
    host_to_host = batch([pin + 64], [pin], attr=(0, LOC_HOST, 0, LOC_HOST))
    assert host_to_host == (ACL_ERROR_INVALID_PARAM, 0)
    # Pageable memory declared as such is allowed and copied synchronously.
    assert sim.stat("pending") == 1  # the one valid pinned batch above, queued
    pools.device[:8] = 0
    declared_pageable = batch([dev], [page], attr=(3, LOC_DEVICE, 0, LOC_UNREGISTERED))
    assert declared_pageable == (0, SIZE_MAX)
    assert sim.stat("sync_copies") == 1
    # Copied by the call itself, after the work queued before it.
    assert sim.stat("pending") == 0
    np.testing.assert_array_equal(pools.device[:8], pools.pageable[:8])

    memcpy = sim.lib.aclrtMemcpyAsync
    # Host-to-host is documented to return "feature not supported".
    assert memcpy(pin + 64, 8, pin, 8, H2H, STREAM) == ACL_ERROR_RT_FEATURE_NOT_SUPPORT
    assert memcpy(dev, 8, pin, 8, D2H, STREAM) == ACL_ERROR_RT_INVALID_MEMORY_TYPE


def test_sim_host_register_follows_the_documented_rules(sim: SimAcl) -> None:
    region = Region(8 * 4096)
    register, unregister = sim.lib.aclrtHostRegisterV2, sim.lib.aclrtHostUnregister
    a = region.addr
    assert register(a + 64, 4096, ACL_HOST_REG_PINNED) == ACL_ERROR_RT_ADDR_UNALIGNED
    assert register(a, 4096, 0) == ACL_ERROR_INVALID_PARAM
    assert register(a, 4096, ACL_HOST_REG_MAPPED | 0x4) == ACL_ERROR_INVALID_PARAM
    assert register(a, 0, ACL_HOST_REG_PINNED) == ACL_ERROR_INVALID_PARAM
    assert register(a, 4096, ACL_HOST_REG_PINNED | ACL_HOST_REG_MAPPED) == 0
    assert register(a, 8192, ACL_HOST_REG_PINNED) == (
        ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED
    )
    assert unregister(a + 4096) == ACL_ERROR_HOST_MEMORY_NOT_REGISTERED
    assert unregister(a) == 0 and unregister(a) == ACL_ERROR_HOST_MEMORY_NOT_REGISTERED
    # Memory registered by other means (aclrtMallocHost, device memory: the
    # test hook) is neither registrable again nor unregistrable.
    device = np.zeros(4096, np.uint8)
    sim.register(device, LOC_DEVICE)
    assert register(a + 8192, 4096, ACL_HOST_REG_PINNED) == 0
    assert unregister(device.ctypes.data) == ACL_ERROR_HOST_MEMORY_NOT_REGISTERED


def test_sim_enforces_the_host_memory_limits_of_real_runtimes(sim: SimAcl) -> None:
    """Configurable from the tests: a per-call size limit (a 910B host
    refused one aclrtMallocHost above ~200-250 GB with 207001), Ascend SVM's
    64 KiB alignment, and A5, which rejects PINNED (107000) and takes MAPPED
    alone (simacl_set's max_host_bytes, host_alignment and a5). Off by
    default, and after a reset."""
    region = Region(8 * SVM)
    register, malloc = sim.lib.aclrtHostRegisterV2, sim.lib.aclrtMallocHost
    aligned = region.addr + (-region.addr % SVM)  # a 64 KiB boundary
    off = aligned + 4096  # page-aligned, not 64 KiB-aligned

    sim.set(max_host_bytes=2 * SVM, host_alignment=SVM)
    assert register(off, 4096, MAPPED_PINNED) == ACL_ERROR_RT_ADDR_UNALIGNED
    assert register(aligned, 3 * SVM, MAPPED_PINNED) == ACL_ERROR_RT_MEMORY_ALLOCATION
    assert register(aligned, 2 * SVM, MAPPED_PINNED) == 0
    ptr = ctypes.c_void_p()
    assert malloc(ctypes.byref(ptr), 3 * SVM) == ACL_ERROR_RT_MEMORY_ALLOCATION
    assert malloc(ctypes.byref(ptr), 2 * SVM) == 0 and ptr.value % SVM == 0
    sim.host_free(ptr.value)

    sim.set(a5=1)  # the limits above kept
    second = aligned + 4 * SVM
    for flags in (MAPPED_PINNED, ACL_HOST_REG_PINNED):
        assert register(second, SVM, flags) == ACL_ERROR_RT_PARAM_INVALID
    with pytest.raises(RuntimeError, match="A5 rejects ACL_HOST_REG_PINNED"):
        sim.host_register(second, SVM)
    sim.host_register(second, SVM, ACL_HOST_REG_MAPPED)
    assert sim.location_of(second) == LOC_HOST

    sim.reset()  # no limits
    assert register(off, 64 * SVM, MAPPED_PINNED) == 0


def test_sim_a_misspelled_switch_or_counter_is_an_error(sim: SimAcl) -> None:
    """No assertion passes on a name the simulation does not know (a switch
    left unset, a counter read as 0); every name the tests read is known
    from the start."""
    with pytest.raises(KeyError, match="no switch 'batch_unsuported'"):
        sim.set(batch_unsuported=1)
    with pytest.raises(KeyError, match="counts no 'sync_copy'"):
        sim.stat("sync_copy")
    calls = (BATCH, SINGLE, ATTRS, SYNC, HOST_REGISTER, HOST_UNREGISTER)
    calls += (MALLOC_HOST, FREE_HOST)
    counters = ("pending", "sync_copies", "faulted_entries", "max_entries")
    counters += ("last_stream", *(f"report.{k}" for k in REPORT))
    assert all(sim.stat(name) == 0 for name in calls + counters)
    assert sim.stat("last_kind") == sim.stat("last_register_flag") == -1


def test_sim_constants_match_the_acl_headers(torch_npu_dir) -> None:
    include = torch_npu_dir / "include" / "acl"
    text = "".join(p.read_text() for p in include.rglob("*.h"))
    # The harness's names of the header's constants are the header's names.
    for name in (
        "ACL_ERROR_INVALID_PARAM ACL_ERROR_RT_PARAM_INVALID "
        "ACL_ERROR_RT_INVALID_MEMORY_TYPE ACL_ERROR_RT_FEATURE_NOT_SUPPORT "
        "ACL_ERROR_RT_INTERNAL_ERROR ACL_ERROR_RT_ADDR_UNALIGNED "
        "ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED ACL_ERROR_HOST_MEMORY_NOT_REGISTERED"
    ).split():
        assert re.search(rf"\b{name}\b\s*=?\s*{getattr(sim_acl, name)}\b", text), name
    for name in ("ACL_HOST_REG_MAPPED", "ACL_HOST_REG_PINNED"):
        found = re.search(rf"#define\s+{name}\s+(0x[0-9A-Fa-f]+)UL", text)
        assert found and int(found.group(1), 16) == getattr(sim_acl, name), name
    # The declarations and enum orders the simulation and this module assume.
    for pattern in (
        r"aclError aclrtHostRegisterV2\(void \*ptr, uint64_t size, uint32_t flag\)",
        r"aclError aclrtHostUnregister\(void \*ptr\)",
        r"ACL_MEM_LOCATION_TYPE_HOST = 0[^\n]*\n\s*ACL_MEM_LOCATION_TYPE_DEVICE,"
        r"\s*\n\s*ACL_MEM_LOCATION_TYPE_UNREGISTERED,",
        r"ACL_MEMCPY_HOST_TO_HOST,\s*ACL_MEMCPY_HOST_TO_DEVICE,\s*"
        r"ACL_MEMCPY_DEVICE_TO_HOST,",
    ):
        assert re.search(pattern, text), pattern
