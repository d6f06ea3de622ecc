"""Build script for vllm-ascend-kv-offload: KV-cache CPU offloading for vLLM.

Installs ``vllm_ascend/kv_offload/`` and nothing else under ``vllm_ascend``:
upstream vllm-ascend owns that package (its ``__init__.py``, ``logger.py``,
...), and this distribution installs next to it (docs/user_guide.md).

Install (development):

    pip install --no-build-isolation -e .

``--no-build-isolation`` is required for the native extension: it must be
compiled against the torch already installed in the environment, which an
isolated build environment would replace with a fresh (and different) one.

Environment switches:

* ``VLLM_ASCEND_BUILD_NATIVE=0`` -- install without native code; the worker
  copies on the torch path (``copy_paths.TorchCopier``). A
  stale in-tree ``vllm_ascend/kv_offload/_C_kv_offload*.so`` from an earlier
  editable build is removed so that the switch takes effect.
* ``VLLM_ASCEND_WITH_NPU=0|1`` -- override the auto-detection of the npu
  backend (``csrc/kv_offload/npu/*.cpp`` exists and ``torch_npu`` is
  importable). CUDA has no backend of ours: copies there are vLLM's
  ``swap_blocks_batch`` (``vllm_ascend/kv_offload/copy_paths.py``).
* ``MAX_JOBS`` -- parallel compile jobs (default 2).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_namespace_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
BUILD_NATIVE = os.environ.get("VLLM_ASCEND_BUILD_NATIVE", "1") != "0"


def _flag(name: str) -> bool | None:
    """Value of an explicit 0/1 override env var, or None when unset."""
    value = os.environ.get(name)
    return None if value is None else value != "0"


def _cuda_home() -> Path | None:
    """The CUDA toolkit to build with: the first of $CUDA_HOME, $CUDA_PATH,
    /usr/local/cuda and nvcc's parent on PATH that has bin/nvcc and the
    runtime headers (a wrapper script on PATH does not count as a toolkit)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    candidates.append("/usr/local/cuda")
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for home in filter(None, candidates):
        if (
            Path(home, "bin", "nvcc").exists()
            and Path(home, "include", "cuda_runtime.h").exists()
        ):
            return Path(home)
    return None


def _cuda_cmake_args() -> list[str]:
    """Points torch's CUDA config (a CUDA torch looks for the toolkit even
    though this extension has no CUDA code) at the toolkit of _cuda_home();
    left to CMake's own search when none is found."""
    home = _cuda_home()
    if home is None:
        return []
    return [
        f"-DCMAKE_CUDA_COMPILER={home / 'bin' / 'nvcc'}",
        f"-DCUDAToolkit_ROOT={home}",
        f"-DCUDA_TOOLKIT_ROOT_DIR={home}",
    ]


def _want_npu() -> bool:
    forced = _flag("VLLM_ASCEND_WITH_NPU")
    if forced is not None:
        return forced
    if not any(ROOT.glob("csrc/kv_offload/npu/*.cpp")):
        return False  # checked first: importing torch_npu is slow
    try:
        import torch_npu  # noqa: F401
    except Exception:  # ImportError, or a broken CANN install
        return False
    return True


class CMakeExtension(Extension):
    """An extension whose sources are built by CMakeLists.txt in source_dir."""

    def __init__(self, name: str, source_dir: Path = ROOT) -> None:
        super().__init__(name, sources=[])
        self.source_dir = str(source_dir)


class CMakeBuild(build_ext):
    """Configures and builds CMakeExtensions; the module lands where
    setuptools expects it, so `pip install -e .` copies it into the tree."""

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            super().build_extension(ext)
            return
        try:
            import torch
        except ImportError as e:
            raise RuntimeError(
                "Building the native op needs torch importable: "
                "use `pip install --no-build-isolation -e .`, or set "
                "VLLM_ASCEND_BUILD_NATIVE=0 to install without native code."
            ) from e

        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_temp = Path(self.build_temp, "cmake").resolve()
        build_temp.mkdir(parents=True, exist_ok=True)
        prefix_path = torch.utils.cmake_prefix_path
        configure = [
            "cmake",
            "-S",
            ext.source_dir,
            "-B",
            str(build_temp),
            f"-DCMAKE_PREFIX_PATH={prefix_path}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_BUILD_TYPE={'Debug' if self.debug else 'Release'}",
            f"-DVLLM_ASCEND_OUTPUT_DIR={target.parent}",
            f"-DVLLM_ASCEND_WITH_NPU={'ON' if _want_npu() else 'OFF'}",
        ]
        if torch.version.cuda is not None:
            configure += _cuda_cmake_args()
        jobs = os.environ.get("MAX_JOBS", "2")
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build_temp), "-j", jobs], check=True)
        if not target.exists():
            raise RuntimeError(f"CMake build did not produce {target}")


class BuildPy(build_py):
    """Without native code, drop a stale in-tree module from an earlier
    editable build; otherwise it would still be imported."""

    def run(self) -> None:
        if not BUILD_NATIVE:
            for stale in ROOT.glob("vllm_ascend/kv_offload/_C_kv_offload*.so"):
                print(f"VLLM_ASCEND_BUILD_NATIVE=0: removing stale {stale}")
                stale.unlink()
        super().run()


setup(
    # Only the kv_offload subtree: "vllm_ascend" itself stays a namespace
    # (no __init__.py) that upstream's regular package may fill.
    packages=find_namespace_packages(
        include=["vllm_ascend.kv_offload", "vllm_ascend.kv_offload.*"],
        exclude=["*.__pycache__"],
    ),
    ext_modules=(
        [CMakeExtension("vllm_ascend.kv_offload._C_kv_offload")] if BUILD_NATIVE else []
    ),
    cmdclass={"build_ext": CMakeBuild, "build_py": BuildPy},
)
