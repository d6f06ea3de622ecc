"""The SIMULATED ACL runtime as the npu backend's tests see it: a ctypes
view of ``tests/sim_acl/sim_acl.cpp`` linked with the real ACL-facing core
(``SimAcl``), the constants of the ACL headers it follows, and the memory
and jobs the tests copy (``Pools``, ``Job``, ``Region``). Not CANN: see
this package's ``conftest.py``."""

from __future__ import annotations

import ctypes
import importlib.util
import mmap
import os
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
SIM_SRC = ROOT / "tests" / "sim_acl"
SIM_BUILD = ROOT / ".cache" / "sim_acl_build"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# Values from the torch-npu 2.13.0 ACL headers (checked by test_sim_constants).
LOC_HOST, LOC_DEVICE, LOC_UNREGISTERED = 0, 1, 2  # aclrtMemLocationType
H2H, H2D, D2H = 0, 1, 2  # aclrtMemcpyKind
ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_RT_PARAM_INVALID = 107000
ACL_ERROR_RT_INVALID_MEMORY_TYPE = 107016
ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000
ACL_ERROR_RT_INTERNAL_ERROR = 507000
SIZE_MAX = 2**64 - 1
STREAM = 0x5EA  # an opaque stream handle; the simulation only records it
BATCH = "aclrtMemcpyBatchAsync"
SINGLE = "aclrtMemcpyAsync"
ATTRS = "aclrtPointerGetAttributes"
SYNC = "aclrtSynchronizeStream"
ACL_ERROR_RT_COPY_DATA = 507052  # the simulation's error for a faulted copy
ACL_HOST_REG_MAPPED = 0x2
ACL_HOST_REG_PINNED = 0x10000000
MAPPED_PINNED = ACL_HOST_REG_MAPPED | ACL_HOST_REG_PINNED
SVM = 64 * 2**10  # Ascend SVM's alignment of host buffers
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001
ACL_ERROR_RT_ADDR_UNALIGNED = 107008
ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 507910
ACL_ERROR_HOST_MEMORY_NOT_REGISTERED = 507911
HOST_REGISTER = "aclrtHostRegisterV2"
HOST_UNREGISTER = "aclrtHostUnregister"
MALLOC_HOST, FREE_HOST = "aclrtMallocHost", "aclrtFreeHost"
# What AclBatchCopier::copy reported, as the harness records it (simacl_stat).
REPORT = ("direction", "fallback_started", "batch_calls", "single_calls")
REPORT += ("workspace_bytes",)  # the workspace the harness gave copy()
UNKNOWN_STAT = -(2**63)  # simacl_stat's answer for a name it does not know


class SimAcl:
    """ctypes view of one SIMULATED ACL runtime plus the real core."""

    def __init__(self, path: Path) -> None:
        lib = self.lib = ctypes.CDLL(str(path))  # RTLD_LOCAL: one state per file
        u64, i64 = ctypes.c_uint64, ctypes.c_int64
        i32, u32 = ctypes.c_int, ctypes.c_uint32
        size, ptr, text = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p
        err = [text, size]  # every core call's error buffer
        for fn, argtypes in {
            "core_copy": [ptr, ptr, ptr, ptr, size, ptr, i64, i32, i32, *err],
            "register": [ptr, size, i32, u32],
            "inject_failure": [text, size, i32, size],
            "stat": [text],
            "set": [text, i64],
            "core_host_register": [u64, u64, u32, *err],
            "core_host_unregister": [u64, *err],
            "core_host_alloc": [u64, ctypes.POINTER(u64), *err],
            "core_host_free": [u64, *err],
            "location_of": [ptr],
            "core_sync": [ptr],
            # ACL functions tests call directly (the nobatch runtime: no V2)
            HOST_REGISTER: [ptr, u64, u32],
            HOST_UNREGISTER: [ptr],
            MALLOC_HOST: [ctypes.POINTER(ptr), size],
            SINGLE: [ptr, size, ptr, size, i32, ptr],
        }.items():
            if not fn.startswith("acl"):  # our hooks: every build has them
                getattr(lib, f"simacl_{fn}").argtypes = argtypes
            elif hasattr(lib, fn):  # an ACL call this build may lack
                getattr(lib, fn).argtypes = argtypes
        lib.simacl_stat.restype = i64
        # ctypes arrays handed to the simulated runtime directly (_raw_batch):
        # it may read them until the stream runs, so they live until reset.
        self.keep_alive: list[object] = []

    def reset(self) -> None:
        self.lib.simacl_reset()  # drops queued copies first
        self.lib.simacl_core_reset()
        self.keep_alive.clear()

    def sync(self) -> int:
        """Runs the copies queued on STREAM, then frees the workspaces the
        harness kept (as the transfer queue does after a job's end event);
        returns the ACL code of aclrtSynchronizeStream."""
        return self.lib.simacl_core_sync(STREAM)

    def stat(self, name: str) -> int:
        """simacl_stat: calls of an ACL function, or a counter of the
        simulation ("pending", "sync_copies", "faulted_entries", ...); a
        name it does not know raises KeyError."""
        value = self.lib.simacl_stat(name.encode())
        if value == UNKNOWN_STAT:
            raise KeyError(f"the simulation counts no {name!r}")
        return value

    def set(self, **switches: int) -> None:
        """simacl_set: batch_unsupported, host_register_location, ...; a
        switch it does not know raises KeyError."""
        for name, value in switches.items():
            if self.lib.simacl_set(name.encode(), int(value)) != 0:
                raise KeyError(f"the simulation has no switch {name!r}")

    def register(self, buf: np.ndarray, location: int, device_id: int = 0) -> None:
        self.lib.simacl_register(buf.ctypes.data, buf.nbytes, location, device_id)

    def core(self, fn: str, *args) -> None:
        """Calls the real core through simacl_core_<fn>; its error raises."""
        err = ctypes.create_string_buffer(4096)
        if getattr(self.lib, f"simacl_core_{fn}")(*args, err, len(err)):
            raise RuntimeError(err.value.decode())

    def host_register(self, addr: int, size: int, flags: int = MAPPED_PINNED) -> None:
        """The core's register_host_range (acl_host_register.cpp)."""
        self.core("host_register", addr, size, flags)

    def host_unregister(self, addr: int) -> None:
        self.core("host_unregister", addr)

    def host_alloc(self, size: int) -> int:
        """The core's allocate_host (aclrtMallocHost)."""
        addr = ctypes.c_uint64()
        self.core("host_alloc", size, ctypes.byref(addr))
        return addr.value

    def host_free(self, addr: int) -> None:
        self.core("host_free", addr)

    def location_of(self, addr: int) -> int:
        return self.lib.simacl_location_of(addr)

    def inject(self, api: str, nth_call: int, code: int, fail_index=SIZE_MAX) -> None:
        self.lib.simacl_inject_failure(api.encode(), nth_call, code, fail_index)

    def copy(
        self,
        src,
        dst,
        sizes,
        fragments=None,
        *,
        sync: bool = True,
        workspace_bytes: int = -1,
        free_workspace_at_return: bool = False,
        per_copy: bool = False,
    ) -> dict:
        """Runs AclBatchCopier::copy on the regions through simacl_core_copy
        (the workspace and per_copy arguments: sim_acl.cpp), raising its
        error; with ``sync`` the stream is then synchronized (as the transfer
        queue waits for the job's end event) and a failed synchronize raises.
        Returns what copy() reported."""
        n = len(sizes)
        frags = np.arange(n) if fragments is None else fragments
        cols = [np.ascontiguousarray(c, dtype=np.uint64) for c in (src, dst, sizes)]
        cols.append(np.ascontiguousarray(frags, dtype=np.int64))
        flags = (int(free_workspace_at_return), int(per_copy))
        addrs = [c.ctypes.data for c in cols]
        self.core("copy", *addrs, n, STREAM, workspace_bytes, *flags)
        if sync and (code := self.sync()) != 0:
            raise RuntimeError(f"aclrtSynchronizeStream failed with ACL error {code}")
        report = {k: self.stat(f"report.{k}") for k in REPORT}
        report["direction"] = ("h2d", "d2h")[report["direction"]]
        report["fallback_started"] = bool(report["fallback_started"])
        return report


def _load_fetcher():
    spec = importlib.util.spec_from_file_location(
        "check_npu_compile", ROOT / "tools" / "check_npu_compile.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FETCHER = _load_fetcher()


class Pools:
    """A "device" pool, a pinned host pool and a pageable host pool, all
    plain host memory that the simulation is told to treat as such."""

    def __init__(self, sim: SimAcl, nbytes: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.device = rng.integers(0, 256, nbytes, dtype=np.uint8)
        self.pinned = rng.integers(0, 256, nbytes, dtype=np.uint8)
        self.pageable = rng.integers(0, 256, nbytes, dtype=np.uint8)
        sim.register(self.device, LOC_DEVICE, device_id=3)
        sim.register(self.pinned, LOC_HOST)

    @staticmethod
    def addr(buf: np.ndarray, offset) -> np.ndarray:
        return buf.ctypes.data + np.asarray(offset, dtype=np.uint64)


def batch_workspace_bytes(n: int) -> int:
    """What the core asks its caller for, n regions: one aclrtMemcpyBatchAttr
    (32 bytes) and its attrsIndexes entry (8), then srcs, dsts and sizes (8
    bytes per region each), all of which aclrtMemcpyBatchAsync is given."""
    return 32 + 8 + 3 * 8 * n


class Job:
    """n regions of ``size`` bytes from ``src_buf`` to ``dst_buf``, in
    disjoint, non-adjacent slots (stride 2 * size) shuffled on each side:
    their addresses, and what ``dst_buf`` holds once they are copied
    (``want``)."""

    def __init__(self, src_buf, dst_buf, n: int, size: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.src_buf, self.dst_buf, self.size = src_buf, dst_buf, size
        self.src_off, self.dst_off = [rng.permutation(n) * 2 * size for _ in range(2)]
        self.src = Pools.addr(src_buf, self.src_off)
        self.dst = Pools.addr(dst_buf, self.dst_off)
        self.want = self.after(dst_buf, n)

    def after(self, dst_before: np.ndarray, k: int) -> np.ndarray:
        """What ``dst_before`` holds once the job's first k regions are copied."""
        want = dst_before.copy()
        offsets = zip(self.src_off[:k].tolist(), self.dst_off[:k].tolist(), strict=True)
        for s, d in offsets:
            want[d : d + self.size] = self.src_buf[s : s + self.size]
        return want

    def run(self, sim: SimAcl, **kwargs) -> dict:
        """``SimAcl.copy`` of the job (its keyword arguments: ``kwargs``)."""
        return sim.copy(self.src, self.dst, [self.size] * len(self.src), **kwargs)


def pools_job(
    sim: SimAcl, n: int, size: int, direction: str = "h2d", seed: int = 0
) -> tuple[Pools, Job]:
    """Pools of room for a job of n scattered regions, and that job between
    the pinned and the device pool (``direction``)."""
    pools = Pools(sim, 2 * n * size)
    bufs = (pools.pinned, pools.device)
    return pools, Job(*(bufs if direction == "h2d" else bufs[::-1]), n, size, seed)


class Region:
    """Page-aligned pageable host memory, as vLLM's mmap region is."""

    def __init__(self, nbytes: int, seed: int = 7) -> None:
        self.map = mmap.mmap(-1, nbytes)
        self.buf = np.frombuffer(self.map, dtype=np.uint8)
        self.buf[:] = np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8)
        self.addr = self.buf.ctypes.data
        self.nbytes = nbytes
