#!/usr/bin/env python3
"""Compile-only check of the "npu" backend (csrc/kv_offload/npu/), no NPU needed.

1. Fetches the C++ headers of the torch-npu 2.13.0 wheel WITHOUT installing
   torch_npu (an importable torch_npu would change vLLM's platform detection):
   ``pip download --no-deps`` of the pinned wheel into a temporary directory,
   sha256 check, then only ``torch_npu/include/**`` is unpacked into
   ``.cache/torch_npu_headers/`` (git-ignored) and reused on later runs.
2. Configures CMakeLists.txt with ``VLLM_ASCEND_NPU_COMPILE_ONLY=ON`` against
   those headers and the installed torch, and builds the OBJECT library
   ``vllm_ascend_npu_objs`` (warnings are errors). Nothing is linked: there is
   no libascendcl.so / libtorch_npu.so here. Build dir: ``.cache/npu_compile``.

Exit status: 0 compiled, 1 compile (or configure) failed, 2 headers could not
be fetched (no network, no pip, ...). ``tests/unit/npu_sim/``
imports fetch_headers() and compile_check().
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
TORCH_NPU_VERSION = "2.13.0"
# Pinned so that every runner gets the same file whatever its own Python is;
# the headers do not depend on the Python version or the CPU architecture.
WHEEL_PLATFORM = ["--platform", "manylinux_2_28_x86_64", "--python-version", "3.11"]
WHEEL_NAME = f"torch_npu-{TORCH_NPU_VERSION}-cp311-cp311-manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "0deb809cf447d3fce636ccfdc9c9f874950f1fe76f18f4aaab31e2d345f7dac0"
INCLUDE_PREFIX = "torch_npu/include/"
EXIT_OK, EXIT_COMPILE_FAILED, EXIT_NO_HEADERS = 0, 1, 2


class HeadersUnavailable(RuntimeError):
    """The torch-npu headers are neither cached nor downloadable."""


def _log(msg: str) -> None:
    print(f"[check_npu_compile] {msg}", flush=True)


def fetch_headers(cache_dir: Path = CACHE / "torch_npu_headers") -> Path:
    """Returns the torch_npu package dir holding ``include/`` (cached)."""
    target = cache_dir / f"torch_npu-{TORCH_NPU_VERSION}"
    cache_dir.mkdir(parents=True, exist_ok=True)
    # One fetch at a time (parallel test workers): a fetch replaces a
    # partial target, which could be another's finished one.
    with FileLock(cache_dir / f".{target.name}.lock"):
        if not (target / ".complete").exists():
            _download(cache_dir, target)
    return target / "torch_npu"


def _download(cache_dir: Path, target: Path) -> None:
    """The pinned wheel's headers, staged in ``cache_dir``, renamed to
    ``target``."""
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        _log(f"downloading torch-npu=={TORCH_NPU_VERSION} (~43 MB, headers only kept)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps"]
        cmd += ["--only-binary=:all:", *WHEEL_PLATFORM]
        cmd += [f"torch-npu=={TORCH_NPU_VERSION}", "-d", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise HeadersUnavailable(f"`pip download` did not run: {e}") from e
        wheel = Path(tmp, WHEEL_NAME)
        if proc.returncode != 0 or not wheel.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            raise HeadersUnavailable(
                f"`pip download torch-npu=={TORCH_NPU_VERSION}` failed "
                f"(rc={proc.returncode}): " + " | ".join(tail)
            )
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != WHEEL_SHA256:
            raise HeadersUnavailable(
                f"{WHEEL_NAME} has sha256 {digest}, expected {WHEEL_SHA256}"
            )
        staged = Path(tmp, "staged")
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.startswith(INCLUDE_PREFIX)]
            zf.extractall(staged, members=members)
        (staged / ".complete").write_text(f"{WHEEL_NAME} {WHEEL_SHA256}\n")
        shutil.rmtree(target, ignore_errors=True)  # a partial earlier attempt
        staged.rename(target)  # atomic: readers see all headers or none
    _log(f"headers cached in {target}")


def compile_check(torch_npu_dir: Path, build_dir: Path = CACHE / "npu_compile") -> int:
    """Configures CMakeLists.txt against the installed torch and pybind11 and
    the headers, builds vllm_ascend_npu_objs; returns the exit status."""
    import pybind11
    import torch

    prefix = f"{torch.utils.cmake_prefix_path};{pybind11.get_cmake_dir()}"
    configure = ["cmake", "-S", str(ROOT), "-B", str(build_dir)]
    configure += [f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_BUILD_TYPE=Release"]
    configure += [f"-DPython_EXECUTABLE={sys.executable}"]
    configure += ["-DVLLM_ASCEND_NPU_COMPILE_ONLY=ON"]
    configure += [f"-DVLLM_ASCEND_TORCH_NPU_DIR={torch_npu_dir}"]
    jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
    build = ["cmake", "--build", str(build_dir), "--target", "vllm_ascend_npu_objs"]
    for step in (configure, build + ["-j", jobs]):
        _log("$ " + " ".join(step))
        if subprocess.run(step).returncode != 0:
            _log(
                "FAILED: the npu backend does not compile against torch-npu "
                f"{TORCH_NPU_VERSION} headers"
            )
            return EXIT_COMPILE_FAILED
    _log(
        f"OK: csrc/kv_offload/npu/*.cpp and dispatch.cpp (npu on) compile against "
        f"torch-npu {TORCH_NPU_VERSION} headers (compile only, nothing linked or run)"
    )
    return EXIT_OK


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--headers-only", action="store_true", help="fetch the headers, print their dir"
    )
    args = parser.parse_args()
    try:
        torch_npu_dir = fetch_headers()
    except HeadersUnavailable as e:
        _log(f"torch-npu headers unavailable: {e}")
        return EXIT_NO_HEADERS
    if args.headers_only:
        print(torch_npu_dir)
        return EXIT_OK
    return compile_check(torch_npu_dir)


if __name__ == "__main__":
    sys.exit(main())
