"""The "cuda" backend compiles with nvcc against torch's headers (no GPU).

Runs tools/check_cuda_compile.py: CMake's compile-only mode builds
csrc/kv_offload/cuda/*.cu (sm_80, sm_90, compute_90 PTX) and dispatch.cpp with the cuda
backend on, warnings as errors, against the installed torch -- a CPU-only
torch is enough. Nothing is linked or run: that needs a CUDA torch and a GPU
(docs/cuda_backend.md). No nvcc skips the test; with nvcc a failed compile
always fails it, and says so explicitly under CI=true.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "check_cuda_compile", ROOT / "tools" / "check_cuda_compile.py"
)
check_cuda_compile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_cuda_compile)

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.mark.skipif(
    check_cuda_compile.find_nvcc() is None,
    reason="no nvcc ($CUDACXX, $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, PATH): "
    "the cuda backend's compile check needs the CUDA toolkit",
)
def test_cuda_backend_compiles_with_nvcc_against_torch_headers() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_cuda_compile.py")],
        capture_output=True,
        text=True,
        timeout=1200,  # cold: ~2 min on 2 cores; warm (nothing changed): ~10 s
    )
    output = (proc.stdout + proc.stderr)[-8000:]
    if proc.returncode != check_cuda_compile.EXIT_OK and IN_CI:
        pytest.fail(f"CI=true: nvcc is present but the cuda backend failed:\n{output}")
    assert proc.returncode == check_cuda_compile.EXIT_OK, output
