"""The npu backend without an NPU: its ACL-facing core
(``csrc/kv_offload/npu/acl_batch_copy.cpp``, ``acl_host_register.cpp``) linked
against ``tests/sim_acl/sim_acl.cpp``, a SIMULATED ACL runtime: "device"
memory is host memory registered as such, and copies are memcpy tasks queued
on the stream that run when it is synchronized, reading the batch API's host
arrays THEN (the docs do not say the runtime copies them at enqueue). It is
NOT CANN and no NPU is involved: these tests say nothing about real Ascend
hardware (docs/npu_backend.md). They run everywhere, CI included: only the
headers of the torch-npu wheel are needed (fetched once, without installing
torch_npu, by tools/check_npu_compile.py). The fixtures here build the
simulation once for the package."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from filelock import FileLock

from tests.unit.npu_sim.sim_acl import FETCHER, IN_CI, SIM_BUILD, SIM_SRC, SimAcl


@pytest.fixture(scope="package")
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


@pytest.fixture(scope="package")
def sim_libs(torch_npu_dir) -> dict[str, SimAcl]:
    cmake = shutil.which("cmake") or "cmake"
    configure = [cmake, "-S", str(SIM_SRC), "-B", str(SIM_BUILD)]
    configure.append(f"-DSIM_ACL_TORCH_NPU_DIR={torch_npu_dir}")
    jobs = str(os.cpu_count() or 2)
    # One build directory for all parallel workers: they build in turn.
    with FileLock(SIM_BUILD.with_name(f".{SIM_BUILD.name}.lock")):
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
