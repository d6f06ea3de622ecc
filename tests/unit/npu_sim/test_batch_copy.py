"""The batch copy of the npu backend's core (``acl_batch_copy.cpp``) under the
SIMULATED ACL runtime (this package's conftest.py): it compiles against the
torch-npu wheel's headers, batches, fills the batch attributes, detects the
direction, translates failIndex, falls back, reports errors and keeps its
descriptor arrays in the caller's workspace as intended under the documented
ACL semantics."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.npu_sim.sim_acl import (
    ACL_ERROR_RT_COPY_DATA,
    ACL_ERROR_RT_INTERNAL_ERROR,
    ACL_ERROR_RT_INVALID_MEMORY_TYPE,
    ATTRS,
    BATCH,
    D2H,
    FETCHER,
    H2D,
    SINGLE,
    SIZE_MAX,
    STREAM,
    SYNC,
    Job,
    Pools,
    SimAcl,
    batch_workspace_bytes,
    pools_job,
)


def test_npu_backend_compiles_against_torch_npu_headers(torch_npu_dir) -> None:
    """csrc/kv_offload/npu/*.cpp plus dispatch.cpp with the npu backend on
    compile, warnings as errors, in CMake's compile-only mode. Nothing is
    linked or run -- that needs CANN and an NPU (docs/npu_backend.md)."""
    assert FETCHER.compile_check(torch_npu_dir) == FETCHER.EXIT_OK


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
