#!/usr/bin/env python3
"""Compile-only check of the "cuda" backend (csrc/kv_offload/cuda/), no GPU needed.

Configures CMakeLists.txt with ``VLLM_ASCEND_CUDA_COMPILE_ONLY=ON`` against the
installed torch (a CPU-only torch is enough: its wheel ships the c10/cuda
headers) and builds the OBJECT library ``vllm_ascend_cuda_objs`` with nvcc:
``csrc/kv_offload/cuda/*.cu`` for sm_80, sm_90 and compute_90 PTX, plus ``dispatch.cpp``
with the cuda entry, warnings as errors. Nothing is linked or run. Build dir:
``.cache/cuda_compile`` (git-ignored).

nvcc is the first of ``$CUDACXX``, ``$CUDA_HOME/bin/nvcc``,
``$CUDA_PATH/bin/nvcc``, ``/usr/local/cuda/bin/nvcc`` and ``nvcc`` on ``PATH``.

Exit status: 0 compiled, 1 compile (or configure) failed, 2 no nvcc found.
``tests/unit/test_cuda_backend_compiles.py`` runs this script.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

# The scripts run as files (not as a package); their shared step sits beside them.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cmake_objects import ROOT, build_objects  # noqa: E402

BUILD_DIR = ROOT / ".cache" / "cuda_compile"
EXIT_OK, EXIT_COMPILE_FAILED, EXIT_NO_NVCC = 0, 1, 2


def _log(msg: str) -> None:
    print(f"[check_cuda_compile] {msg}", flush=True)


def find_nvcc() -> str | None:
    """Path of nvcc, or None when there is none."""
    candidates = [os.environ.get("CUDACXX")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home:
            candidates.append(str(Path(home, "bin", "nvcc")))
    candidates += ["/usr/local/cuda/bin/nvcc", shutil.which("nvcc")]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    return None


def compile_check(nvcc: str, build_dir: Path = BUILD_DIR) -> int:
    """Configures and builds vllm_ascend_cuda_objs; returns the exit status."""
    import torch

    options = [f"-DCMAKE_CUDA_COMPILER={nvcc}", "-DVLLM_ASCEND_CUDA_COMPILE_ONLY=ON"]
    if not build_objects("vllm_ascend_cuda_objs", build_dir, options, _log):
        _log(f"FAILED: the cuda backend does not compile (nvcc {nvcc})")
        return EXIT_COMPILE_FAILED
    _log(
        f"OK: csrc/kv_offload/cuda/*.cu and dispatch.cpp (cuda on) compile with {nvcc} "
        f"against torch {torch.__version__} headers (compile only, nothing "
        "linked or run)"
    )
    return EXIT_OK


def main() -> int:
    nvcc = find_nvcc()
    if nvcc is None:
        _log("no nvcc ($CUDACXX, $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, PATH)")
        return EXIT_NO_NVCC
    return compile_check(nvcc)


if __name__ == "__main__":
    sys.exit(main())
