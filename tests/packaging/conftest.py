"""The scratch venv the coexistence tests install the two distributions in.

Module-scoped fixtures: ``venv`` (a :class:`ScratchVenv` cleaned of what an
interrupted run left) and ``upstream_alone`` (the state with upstream
installed on its own: the reference the tests compare against).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.packaging import upstream

UPSTREAM = upstream.UPSTREAM_DIST
OURS = upstream.OUR_DIST
PROBE = Path(__file__).with_name("venv_probe.py")


class ScratchVenv:
    """The scratch venv (tests/packaging/upstream.py) and the two
    distributions under test, installed and uninstalled in it."""

    def __init__(self, path: Path, sdist: Path) -> None:
        self.path = path
        self.python = path / "bin" / "python"
        self.sdist = sdist

    def env(self, **extra: str) -> dict[str, str]:
        """As if activated; nothing from the main venv or the checkout."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
        env["VIRTUAL_ENV"] = str(self.path)
        env["PATH"] = f"{self.path / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env.update(extra)
        return env

    def run(self, *cmd, timeout: float = 900, env=None, cwd=None):
        """``cmd`` in the venv's environment (``env``: default ``self.env()``)."""
        return subprocess.run(
            [str(c) for c in cmd],
            env=env or self.env(),
            cwd=cwd or self.path,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def probe(self, *args: str, env=None) -> dict:
        """venv_probe.py with ``args`` (by path, ``-P``: nothing of the
        checkout importable); asserts it succeeded; its JSON line."""
        proc = self.run(self.python, "-P", PROBE, *args, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def pip(self, *args: str, env=None) -> str:
        proc = self.run(self.python, "-m", "pip", *args, env=env)
        assert proc.returncode == 0, (
            f"pip {' '.join(args)}:\n{proc.stdout}{proc.stderr}"
        )
        return proc.stdout + proc.stderr

    def state(self, metadata_only: bool = False) -> dict:
        """Distributions, plugin groups, imports (venv_probe.py ``state``)."""
        args = ["state", UPSTREAM, OURS] + ["--metadata-only"] * metadata_only
        # VLLM_PLUGINS="" (parsed as [""]): no vLLM plugin of any group runs
        # should anything resolve vLLM's platform (upstream's "ascend"
        # platform plugin would claim this CPU machine).
        return self.probe(*args, env=self.env(VLLM_PLUGINS=""))

    # --- state changes -----------------------------------------------------

    def install_upstream(self) -> str:
        """From the pinned sdist, built into a wheel once per scratch venv
        (what ``pip install SDIST`` does each time)."""
        wheels = self.path / f"upstream-wheel-{upstream.UPSTREAM_SDIST_SHA256[:12]}"
        if not wheels.is_dir():
            staged = wheels.with_suffix(".tmp")
            shutil.rmtree(staged, ignore_errors=True)
            self.pip(
                *("wheel", "--no-deps", "--no-build-isolation", "-w", str(staged)),
                str(self.sdist),
                env=self.env(**upstream.UPSTREAM_BUILD_ENV),
            )
            staged.rename(wheels)
        (wheel,) = wheels.glob("*.whl")
        return self.pip("install", "--no-deps", str(wheel))

    def install_script(self, **env: str) -> subprocess.CompletedProcess:
        """scripts/install_next_to_vllm_ascend.sh with PYTHON= this venv's,
        run in the checkout as a user runs it (no PYTHONPATH: the checkout on
        it would shadow what the script installs)."""
        return self.run(
            "bash",
            upstream.REPO_ROOT / "scripts" / "install_next_to_vllm_ascend.sh",
            env=self.env(PYTHON=str(self.python), **env),
            cwd=upstream.REPO_ROOT,
            timeout=1200,
        )

    def uninstall(self, dist: str) -> str:
        return self.pip("uninstall", "-y", dist)

    def ensure(self, ours: bool) -> dict:
        """Installs/uninstalls until upstream is there and ours is (not),
        installed by the install script (an editable install is replaced);
        returns the metadata."""
        state = self.state(metadata_only=True)["dists"]
        if state[OURS] and (not ours or state[OURS]["editable"]):
            self.uninstall(OURS)
            state[OURS] = None
        if not state[UPSTREAM]:
            self.install_upstream()
        if ours and not state[OURS]:
            proc = self.install_script()
            assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
        return self.state(metadata_only=True)


@pytest.fixture(scope="module")
def venv() -> ScratchVenv:
    scratch = ScratchVenv(upstream.coexistence_venv(), upstream.upstream_sdist())
    # Whatever an earlier (interrupted) run left: ours never stays (a build
    # of older sources, or an editable install of a deleted tree); upstream
    # stays only if intact, as installed from the pinned sdist.
    left = scratch.state(metadata_only=True)["dists"]
    if left[UPSTREAM] and (
        left[UPSTREAM]["bad"] or left[UPSTREAM]["version"] != upstream.UPSTREAM_VERSION
    ):
        scratch.uninstall(UPSTREAM)
    if left[OURS]:
        scratch.uninstall(OURS)
    return scratch


@pytest.fixture(scope="module")
def upstream_alone(venv) -> dict:
    """The state with upstream installed on its own: the reference."""
    venv.ensure(ours=False)
    return venv.state()
