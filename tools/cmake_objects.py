"""Configure CMakeLists.txt and build one OBJECT target: the compile-only
checks of backends this machine cannot run (tools/check_*_compile.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_objects(
    target: str,
    build_dir: Path,
    cmake_options: list[str],
    log: Callable[[str], None],
) -> bool:
    """Configure against the installed torch and pybind11, build ``target``;
    True when both steps succeed."""
    import pybind11
    import torch

    prefix = f"{torch.utils.cmake_prefix_path};{pybind11.get_cmake_dir()}"
    configure = [
        "cmake",
        "-S",
        str(ROOT),
        "-B",
        str(build_dir),
        f"-DCMAKE_PREFIX_PATH={prefix}",
        f"-DPython_EXECUTABLE={sys.executable}",
        "-DCMAKE_BUILD_TYPE=Release",
        *cmake_options,
    ]
    jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
    build = ["cmake", "--build", str(build_dir), "--target", target, "-j", jobs]
    for step in (configure, build):
        log("$ " + " ".join(step))
        if subprocess.run(step).returncode != 0:
            return False
    return True
