"""The npu backend without an NPU: it compiles against the torch-npu
wheel's headers, and SIMULATION tests of its ACL-facing core.

``csrc/kv_offload/npu/acl_batch_copy.cpp`` -- the code of the "npu" backend that calls
ACL -- is linked against ``tests/sim_acl/sim_acl.cpp``, a SIMULATED ACL
runtime: "device" memory is host memory registered as such, and copies are
memcpy tasks queued on the stream that run when it is synchronized, reading
the batch API's host arrays THEN (the docs do not say the runtime copies them
at enqueue). It is NOT CANN and no NPU is involved. These tests show that the
core batches, fills the batch attributes, detects the direction, translates
failIndex, falls back, reports errors and keeps its descriptor arrays in the
caller's workspace as intended under the documented ACL semantics; they say
nothing about real Ascend hardware (docs/npu_backend.md). They run everywhere,
CI included: only the headers of the torch-npu wheel are needed (fetched
once, without installing torch_npu, by tools/check_npu_compile.py).
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import mmap
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from tests.unit.kv_helpers import make_kv_caches
from vllm_ascend.kv_offload import acl_host, host_memory, ops
from vllm_ascend.kv_offload.copy_engine import CopyEngine
from vllm_ascend.kv_offload.cpu_pool import CpuBlockPool, PoolLayout
from vllm_ascend.kv_offload.host_pieces import DEFAULT_PIECE_BYTES

ROOT = Path(__file__).resolve().parents[2]
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


@pytest.fixture(scope="module")
def torch_npu_dir() -> Path:
    """The torch-npu wheel's package dir with its headers (fetched once):
    without it the tests skip here, and fail in CI."""
    try:
        return FETCHER.fetch_headers()
    except FETCHER.HeadersUnavailable as e:
        reason = f"ACL headers (torch-npu wheel) unavailable: {e}"
        if IN_CI:
            pytest.fail(reason + " -- CI must run the npu backend's checks")
        pytest.skip(reason)


def test_npu_backend_compiles_against_torch_npu_headers(torch_npu_dir) -> None:
    """csrc/kv_offload/npu/*.cpp plus dispatch.cpp with the npu backend on
    compile, warnings as errors, in CMake's compile-only mode. Nothing is
    linked or run -- that needs CANN and an NPU (docs/npu_backend.md)."""
    assert FETCHER.compile_check(torch_npu_dir) == FETCHER.EXIT_OK


@pytest.fixture(scope="module")
def sim_libs(torch_npu_dir) -> dict[str, SimAcl]:
    cmake = shutil.which("cmake") or "cmake"
    configure = [cmake, "-S", str(SIM_SRC), "-B", str(SIM_BUILD)]
    configure.append(f"-DSIM_ACL_TORCH_NPU_DIR={torch_npu_dir}")
    jobs = str(os.cpu_count() or 2)
    for cmd in (configure, [cmake, "--build", str(SIM_BUILD), "-j", jobs]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.fail(
                f"SIMULATION build failed: {' '.join(cmd)}\n"
                f"{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
            )
    return {
        "batch": SimAcl(SIM_BUILD / "libvllm_ascend_sim_acl.so"),
        "nobatch": SimAcl(SIM_BUILD / "libvllm_ascend_sim_acl_nobatch.so"),
    }


@pytest.fixture
def sim(sim_libs) -> SimAcl:
    """The simulated runtime with the batch API, freshly reset."""
    sim_libs["batch"].reset()
    return sim_libs["batch"]


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


def test_sim_bad_entry_in_second_batch_names_the_callers_fragment(sim: SimAcl) -> None:
    n, size, bad = 10_000, 8, 5000
    pools, job = pools_job(sim, n, size, seed=2)
    job.src[bad] = Pools.addr(pools.pageable, 0)  # not the pinned memory attrs declare
    before = pools.device.copy()
    # As if the dispatcher had merged 3 fragments into every region.
    with pytest.raises(RuntimeError) as info:
        job.run(sim, fragments=np.arange(n) * 3)
    msg = str(info.value)
    assert msg.startswith("swap_blocks_batch(device='npu'): aclrtMemcpyBatchAsync")
    assert f"ACL error {ACL_ERROR_RT_INVALID_MEMORY_TYPE}" in msg
    assert f"at fragment {3 * bad} (entry {bad - 4096} of call 2 of 3" in msg
    assert "SIMULATED ACL: entry 904: memory location differs" in msg
    assert sim.stat(BATCH) == 2  # stopped at the failing call
    # The first call's 4096 copies happened (no rollback); the rest did not.
    # They ran before copy() threw: the harness frees the workspace when it
    # throws (as the op's tensor is freed), so the core had to wait for them.
    assert sim.stat(SYNC) == 1 and sim.stat("pending") == 0
    assert sim.stat("faulted_entries") == 0
    np.testing.assert_array_equal(pools.device, job.after(before, 4096))


# --- descriptor lifetime --------------------------------------------------
# The ACL docs do not say that aclrtMemcpyBatchAsync has read its host arrays
# when it returns; the simulation reads them when the copy executes.


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize(
    "free_at_return", [False, True], ids=["kept_until_sync", "freed_at_return"]
)
def test_sim_descriptor_arrays_live_until_the_copies_have_run(
    sim: SimAcl, direction: str, free_at_return: bool
) -> None:
    """10,000 fragments take three batch calls on the caller's stream,
    queued (a pinned job waits for it: nothing is copied before it is
    synchronized). Kept until the stream has run (what StreamTransferQueue
    does with the op's workspace: until the job's end event), every byte
    arrives. Freed when the op returns (what the op did while its arrays
    were locals), the runtime finds garbage when the copies execute: wrong
    bytes, and the synchronize reports the fault."""
    n, size = 10_000, 37  # odd size: nothing relies on alignment
    _, job = pools_job(sim, n, size, direction, seed=3)
    before = job.dst_buf.copy()
    report = job.run(sim, sync=False, free_workspace_at_return=free_at_return)
    assert report == {
        "direction": direction,
        "fallback_started": False,
        "batch_calls": 3,
        "single_calls": 0,
        "workspace_bytes": batch_workspace_bytes(n),
    }
    assert sim.stat(BATCH) == 3 and sim.stat(SINGLE) == 0 and sim.stat("pending") == 3
    assert sim.stat("max_entries") == 4096  # 4096 + 4096 + 1808
    assert sim.stat("last_stream") == STREAM  # the caller's stream is used
    assert sim.stat(ATTRS) == 2  # direction read once, from fragment 0
    np.testing.assert_array_equal(job.dst_buf, before)  # nothing ran yet
    rc = sim.sync()
    assert sim.stat("pending") == 0 and sim.stat("sync_copies") == 0
    dst_buf, want = job.dst_buf, job.want
    wrong = sum(
        not np.array_equal(dst_buf[d : d + size], want[d : d + size])
        for d in job.dst_off.tolist()
    )
    if free_at_return:
        assert rc == ACL_ERROR_RT_COPY_DATA
        assert sim.stat("faulted_entries") == n
        assert wrong == n
    else:
        assert rc == 0 and sim.stat("faulted_entries") == 0
        assert wrong == 0
        np.testing.assert_array_equal(dst_buf, want)


def test_sim_failed_wait_for_enqueued_calls_is_reported(sim: SimAcl) -> None:
    pools, job = pools_job(sim, 5000, 8)
    job.src[4500] = Pools.addr(pools.pageable, 0)  # call 2 fails, call 1 is queued
    sim.inject(SYNC, 1, ACL_ERROR_RT_INTERNAL_ERROR)
    with pytest.raises(RuntimeError) as info:
        job.run(sim)
    msg = str(info.value)
    assert (
        f"failed with ACL error {ACL_ERROR_RT_INVALID_MEMORY_TYPE} at fragment 4500"
        in msg
    )
    assert msg.endswith(
        "; waiting for the 1 batch call(s) already enqueued "
        "(aclrtSynchronizeStream) failed as well, with ACL error 507000; ACL "
        "reports: SIMULATED ACL: injected failure of aclrtSynchronizeStream call 1"
    )


@pytest.mark.parametrize("workspace_bytes", [0, 8, batch_workspace_bytes(100) - 1])
def test_sim_too_small_workspace_is_refused_before_anything_is_enqueued(
    sim: SimAcl, workspace_bytes: int
) -> None:
    _, job = pools_job(sim, 100, 8)
    with pytest.raises(
        RuntimeError,
        match=rf"the workspace \({workspace_bytes} bytes at 0x[0-9a-f]+\) must be "
        rf"at least {batch_workspace_bytes(100)} bytes aligned to 16; allocate "
        r"AclBatchCopier::workspace_bytes\(\) for this job",
    ):
        job.run(sim, workspace_bytes=workspace_bytes)
    assert sim.stat(BATCH) == 0 and sim.stat("pending") == 0


@pytest.mark.parametrize(
    "runtime", ["batch_unsupported", "no_batch_symbol", "per_copy"]
)
def test_sim_per_copy_loop_without_the_batch_api(sim_libs, runtime: str) -> None:
    """A batch API that answers "not supported", a runtime without its
    symbol (both: the fallback) and the core's per_copy argument (the op's
    choice for one call) copy with one aclrtMemcpyAsync per region."""
    sim = sim_libs["nobatch" if runtime == "no_batch_symbol" else "batch"]
    sim.reset()
    if runtime == "batch_unsupported":
        sim.set(batch_unsupported=1)
    n, size = 5000, 16
    pools = Pools(sim, 2 * n * size)
    probes = int(runtime == "batch_unsupported")  # no symbol, per_copy: none
    fallback = runtime != "per_copy"
    for job, direction in enumerate(("d2h", "h2d")):
        bufs = (pools.device, pools.pinned)
        copy = Job(*(bufs if direction == "d2h" else bufs[::-1]), n, size, seed=job)
        report = copy.run(sim, per_copy=not fallback)
        # Only the first job finds out (and its caller logs it); the second
        # does not ask the batch API again.
        # The first job of a runtime that has the symbol sizes its workspace
        # before the batch API answers "not supported"; later jobs need none.
        workspace = batch_workspace_bytes(n) if job == 0 and probes else 0
        assert report == {
            "direction": direction,
            "fallback_started": fallback and job == 0,
            "batch_calls": 0,
            "single_calls": n,
            "workspace_bytes": workspace,
        }
        assert sim.stat(BATCH) == probes
        assert sim.stat(SINGLE) == n * (job + 1)
        # An explicit kind, not ACL_MEMCPY_DEFAULT (which makes the runtime
        # look the pointers up again on every copy).
        assert sim.stat("last_kind") == (D2H if direction == "d2h" else H2D)
        np.testing.assert_array_equal(copy.dst_buf, copy.want)
    if not fallback:  # a choice of that call only: the next call batches again
        report = copy.run(sim)
        assert report["batch_calls"] == 2 and not report["fallback_started"]


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize(
    ("api", "nth", "fail_index", "expected"),
    [
        (ATTRS, 1, SIZE_MAX, r"aclrtPointerGetAttributes\(src_addrs\[0\]=0x[0-9a-f]+\) "
                             r"failed with ACL error 507000"),
        (ATTRS, 2, SIZE_MAX, r"aclrtPointerGetAttributes\(dst_addrs\[0\]=0x[0-9a-f]+\) "
                             r"failed with ACL error 507000"),
        (BATCH, 1, SIZE_MAX, r"aclrtMemcpyBatchAsync \({dir}\) failed with ACL error "
                             r"507000 in call 1 of 2 \(4096 entries\) starting at "
                             r"fragment 0; the runtime named no single entry "
                             r"\(failIndex=SIZE_MAX\)"),
        (BATCH, 2, SIZE_MAX, r"in call 2 of 2 \(904 entries\) starting at fragment "
                             r"4096; the runtime named no single entry "
                             r"\(failIndex=SIZE_MAX\)"),
        (BATCH, 1, 99, r"at fragment 99 \(entry 99 of call 1 of 2"),
        (BATCH, 1, 123456, r"named no single entry \(failIndex=123456\)"),
        (SINGLE, 3, SIZE_MAX, r"aclrtMemcpyAsync \({dir}, per-copy fallback\) "
                              r"failed with ACL error 507000 at fragment 2 "),
    ],
)  # fmt: skip
def test_sim_every_acl_error_raises(sim, direction, api, nth, fail_index, expected):
    _, job = pools_job(sim, 5000, 8, direction)
    if api == SINGLE:
        sim.set(batch_unsupported=1)
    sim.inject(api, nth, ACL_ERROR_RT_INTERNAL_ERROR, fail_index)
    long_direction = {"h2d": "host-to-device", "d2h": "device-to-host"}[direction]
    with pytest.raises(RuntimeError, match=expected.format(dir=long_direction)) as info:
        job.run(sim)
    assert str(info.value).startswith("swap_blocks_batch(device='npu'): ")
    assert "ACL reports: SIMULATED ACL: injected failure of " + api in str(info.value)
    # Only a failure after an enqueued call waits for it (its workspace goes
    # with the exception); else nothing was queued: nothing to wait for.
    assert sim.stat(SYNC) == (api == BATCH and nth == 2)


@pytest.mark.parametrize(
    ("src_pool", "dst_pool", "expected"),
    [
        ("device", "device", "copies device to device"),
        ("pinned", "pinned", "has no device side"),
        ("pageable", "device", "host side is not page-locked"),
        ("device", "pageable", "host side is not page-locked"),
    ],
)
def test_sim_unsupported_directions_fail_before_copying(
    sim, src_pool, dst_pool, expected
) -> None:
    pools = Pools(sim, 4096)
    src = getattr(pools, src_pool)
    dst = getattr(pools, dst_pool)
    with pytest.raises(RuntimeError, match=expected):
        sim.copy([src.ctypes.data], [dst.ctypes.data + 1024], [512])
    assert sim.stat(BATCH) == 0 and sim.stat(SINGLE) == 0


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


# --- host registration (the shared /dev/shm region of the tiering spec) ----
# csrc/kv_offload/npu/acl_host_register.cpp: aclrtHostRegisterV2(ptr, size,
# ACL_HOST_REG_PINNED) page-locks pageable host memory (CANN docs); the
# simulation then reports it as ACL_MEM_LOCATION_TYPE_HOST (SIM CHOICE).


class Region:
    """Page-aligned pageable host memory, as vLLM's mmap region is."""

    def __init__(self, nbytes: int, seed: int = 7) -> None:
        self.map = mmap.mmap(-1, nbytes)
        self.buf = np.frombuffer(self.map, dtype=np.uint8)
        self.buf[:] = np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8)
        self.addr = self.buf.ctypes.data
        self.nbytes = nbytes


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_sim_a_registered_region_is_copied_on_the_batch_path(
    sim: SimAcl, direction: str
) -> None:
    """Pageable: refused by the copy backend. Registered through the core:
    page-locked host memory known to ACL, copied by a queued batch call.
    Unregistered: copies still queued fault (the simulation itself: why the
    worker unregisters only after its copies have completed, at shutdown),
    and it is pageable (refused) again."""
    n, size = 64, 256
    region = Region(2 * n * size)
    device = np.random.default_rng(1).integers(0, 256, 2 * n * size, np.uint8)
    sim.register(device, LOC_DEVICE, device_id=3)
    bufs = (device, region.buf)
    job = Job(*(bufs if direction == "d2h" else bufs[::-1]), n, size)
    assert sim.location_of(region.addr) == LOC_UNREGISTERED
    with pytest.raises(RuntimeError, match="host side is not page-locked"):
        job.run(sim)
    sim.host_register(region.addr, region.nbytes)
    assert sim.stat("last_register_flag") == MAPPED_PINNED
    assert sim.stat(HOST_REGISTER) == 1
    for byte in (0, region.nbytes - 1):
        assert sim.location_of(region.addr + byte) == LOC_HOST
    report = job.run(sim, sync=False)
    assert (report["batch_calls"], report["single_calls"]) == (1, 0)
    assert sim.stat("pending") == 1  # queued, not a synchronous pageable copy
    assert sim.sync() == 0
    assert sim.stat("sync_copies") == 0
    np.testing.assert_array_equal(job.dst_buf, job.want)

    job.run(sim, sync=False)
    sim.host_unregister(region.addr)
    assert sim.sync() == ACL_ERROR_RT_COPY_DATA
    assert sim.stat("faulted_entries") == n
    assert sim.stat(HOST_UNREGISTER) == 1
    assert sim.location_of(region.addr) == LOC_UNREGISTERED
    with pytest.raises(RuntimeError, match="host side is not page-locked"):
        job.run(sim)


def test_sim_host_register_errors_name_the_range_and_the_code(sim: SimAcl) -> None:
    region = Region(16 * 4096)
    rng = rf"\[{hex(region.addr)}, {hex(region.addr + region.nbytes)}\) \(65536 bytes\)"
    sim.host_register(region.addr, region.nbytes)
    with pytest.raises(RuntimeError) as info:
        sim.host_register(region.addr + 4096, 4096)  # inside: already registered
    msg = str(info.value)
    assert msg.startswith(
        "kv_offload_host_register(device='npu'): aclrtHostRegisterV2("
    )
    assert f"range [{hex(region.addr + 4096)}, {hex(region.addr + 8192)})" in msg
    assert f"failed with ACL error {ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED}" in msg
    assert "ACL reports: SIMULATED ACL: range overlaps memory already registered" in msg
    sim.host_unregister(region.addr)

    sim.inject(HOST_REGISTER, 3, ACL_ERROR_RT_INTERNAL_ERROR)
    with pytest.raises(
        RuntimeError,
        match=rf"aclrtHostRegisterV2\(range {rng}, ACL_HOST_REG_MAPPED\|"
        r"ACL_HOST_REG_PINNED\) failed "
        r"with ACL error 507000; ACL reports: SIMULATED ACL: injected failure",
    ):
        sim.host_register(region.addr, region.nbytes)
    assert sim.location_of(region.addr) == LOC_UNREGISTERED

    with pytest.raises(
        RuntimeError,
        match=rf"kv_offload_host_unregister\(device='npu'\): aclrtHostUnregister\("
        rf"{hex(region.addr)}\) failed with ACL error "
        rf"{ACL_ERROR_HOST_MEMORY_NOT_REGISTERED}; ACL reports: SIMULATED ACL: not "
        "the start of a host registration",
    ):
        sim.host_unregister(region.addr)

    calls = sim.stat(HOST_REGISTER)
    for addr, size, why in [
        (region.addr + 8, 4096, "does not start on a 4 KiB boundary"),
        (region.addr, 0, "is empty or at address 0"),
        (0, 4096, "is empty or at address 0"),
    ]:
        with pytest.raises(RuntimeError, match=why):
            sim.host_register(addr, size)
    assert sim.stat(HOST_REGISTER) == calls  # refused before any ACL call


def test_sim_a_registration_acl_does_not_report_as_host_memory_is_undone(
    sim: SimAcl,
) -> None:
    """If the runtime reported registered memory as something the copy
    backend refuses (assumption 1 of docs/npu_backend.md failing), the
    registration fails at start-up and leaves nothing registered."""
    region = Region(4 * 4096)
    sim.set(host_register_location=LOC_UNREGISTERED)
    with pytest.raises(RuntimeError) as info:
        sim.host_register(region.addr, region.nbytes)
    msg = str(info.value)
    assert (
        "was registered (aclrtHostRegisterV2, ACL_HOST_REG_MAPPED|"
        "ACL_HOST_REG_PINNED)" in msg
    )
    assert (
        f"reports location type {LOC_UNREGISTERED} for byte {hex(region.addr)}" in msg
    )
    assert msg.endswith("; it was unregistered again")
    assert sim.stat(HOST_UNREGISTER) == 1
    sim.set(host_register_location=LOC_HOST)
    sim.host_register(region.addr, region.nbytes)  # nothing was left behind


def test_sim_a_runtime_without_host_register_v2_is_named(sim_libs) -> None:
    sim = sim_libs["nobatch"]  # models an older CANN: no batch API, no V2
    sim.reset()
    region = Region(4096)
    with pytest.raises(
        RuntimeError, match="this CANN runtime has no aclrtHostRegisterV2"
    ):
        sim.host_register(region.addr, region.nbytes)


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
    # This module's names of the header's constants are the header's names.
    for name in (
        "ACL_ERROR_INVALID_PARAM ACL_ERROR_RT_PARAM_INVALID "
        "ACL_ERROR_RT_INVALID_MEMORY_TYPE ACL_ERROR_RT_FEATURE_NOT_SUPPORT "
        "ACL_ERROR_RT_INTERNAL_ERROR ACL_ERROR_RT_ADDR_UNALIGNED "
        "ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED ACL_ERROR_HOST_MEMORY_NOT_REGISTERED"
    ).split():
        assert re.search(rf"\b{name}\b\s*=?\s*{globals()[name]}\b", text), name
    for name in ("ACL_HOST_REG_MAPPED", "ACL_HOST_REG_PINNED"):
        found = re.search(rf"#define\s+{name}\s+(0x[0-9A-Fa-f]+)UL", text)
        assert found and int(found.group(1), 16) == globals()[name], name
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


# --- the CPU block pool's memory on npu (host_memory.py) --------------------

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
