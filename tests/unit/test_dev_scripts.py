"""The developer scripts, as the README runs them: ``.ci/run`` hands its
arguments to pytest (``CI=true bash .ci/run -p no:cacheprovider``), and
``scripts/setup_env.sh`` (run by ``run_example.sh`` and ``run_tests.sh``)
re-installs the checkout when the venv runs another copy of the package,
e.g. after ``scripts/install_next_to_vllm_ascend.sh``; and
``scripts/device_check_cuda.sh`` stops at once, in one line, where it cannot
check anything.

They run on a copy of the scripts in a scratch clone whose venv is a stub:
its ``python`` records every call, answers ``-m pip`` and ``-m pytest`` by
doing nothing, and runs anything else with this interpreter, where the
package is found only where the test puts it. Nothing is installed, and the
real venv and checkout are not touched.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = (".ci/run", "scripts/run_tests.sh", "scripts/setup_env.sh")
# What setup_env.sh hashes to decide whether to install and build.
BUILD_INPUTS = (
    "requirements/dev.txt", "csrc/op.cpp", "CMakeLists.txt", "setup.py",
    "pyproject.toml",
)  # fmt: skip
STUB_PYTHON = """#!/bin/sh
"{python}" -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@" >>"{log}"
case "$1 $2" in "-m pip" | "-m pytest") exit 0 ;; esac
exec "{python}" "$@"
"""


def write_package(root: Path) -> Path:
    """A copy of vllm_ascend.kv_offload under ``root``, enough for the
    setup's last check (``ops.HAS_NATIVE_OP``, ``ops.native_backends()``)."""
    package = root / "vllm_ascend" / "kv_offload"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "ops.py").write_text(
        "HAS_NATIVE_OP = False\n\ndef native_backends():\n    return []\n"
    )
    return root


class Clone:
    """A checkout with the real scripts and a stub venv."""

    def __init__(self, root: Path):
        self.root = root
        for script in SCRIPTS:
            (root / script).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / script, root / script)
        for path in BUILD_INPUTS:
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text("")
        write_package(root)
        self.venv = root / ".venv"
        self.log = root / "python-calls.jsonl"
        python = self.venv / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(STUB_PYTHON.format(python=sys.executable, log=self.log))
        python.chmod(python.stat().st_mode | stat.S_IXUSR)
        (self.venv / "bin" / "activate").write_text(
            f'export VIRTUAL_ENV="{self.venv}" PATH="{self.venv}/bin:$PATH"\n'
        )

    def run(self, script: str, *args: str, package_on: Path) -> str:
        """``bash script args`` from the clone's root, as the README does,
        with the package found under ``package_on``; returns its output."""
        env = dict(os.environ)
        env.update(
            PYTHONPATH=str(package_on),
            VLLM_ASCEND_BUILD_NATIVE="0",  # no native op is built here
            CI="true",
        )
        env.pop("VLLM_ASCEND_VENV", None)
        proc = subprocess.run(
            ["bash", script, *args],
            cwd=self.root,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout + proc.stderr

    def calls(self) -> list[list[str]]:
        """The stub python's arguments, one list per call, oldest first."""
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def forget_calls(self) -> None:
        self.log.unlink(missing_ok=True)


@pytest.fixture
def clone(tmp_path) -> Clone:
    return Clone(tmp_path / "clone")


def editable_installs(calls: list[list[str]]) -> list[list[str]]:
    return [c for c in calls if c[:3] == ["-m", "pip", "install"] and "-e" in c]


def test_ci_run_hands_its_arguments_to_pytest(clone):
    args = ["-p", "no:cacheprovider", "-m", "not e2e and not packaging"]
    clone.run(".ci/run", *args, package_on=clone.root)
    pytest_calls = [c for c in clone.calls() if c[:2] == ["-m", "pytest"]]
    # Two workers (each whole modules, pyproject.toml), then the caller's.
    assert pytest_calls == [["-m", "pytest", "-ra", "-n", "2", *args]]


def test_setup_keeps_the_editable_install_of_this_checkout(clone):
    clone.run("scripts/setup_env.sh", package_on=clone.root)  # stamps written
    clone.forget_calls()
    out = clone.run("scripts/setup_env.sh", package_on=clone.root)
    assert "[setup] vllm-ascend is up to date" in out
    assert editable_installs(clone.calls()) == []


def test_setup_reinstalls_this_checkout_when_the_venv_runs_another_copy(
    clone, tmp_path
):
    clone.run("scripts/setup_env.sh", package_on=clone.root)  # stamps written
    clone.forget_calls()
    # What install_next_to_vllm_ascend.sh leaves: a regular install, found
    # by a script run from the checkout (sys.path[0] is examples/).
    installed = write_package(tmp_path / "site-packages")
    out = clone.run("scripts/setup_env.sh", package_on=installed)
    assert f"vllm_ascend.kv_offload from {installed.resolve()}" in out
    assert "not this checkout" in out
    assert editable_installs(clone.calls()) == [
        ["-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", "."]
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU: the check can run")
def test_device_check_stops_at_once_without_a_gpu_or_vllm(tmp_path):
    # Here vLLM is installed but there is no GPU; on this workplace's H200 it
    # is the other way round. Either way no step may spend device time.
    proc = subprocess.run(
        ["bash", "scripts/device_check_cuda.sh"],
        cwd=REPO,
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [
        "FAILED: needs a CUDA GPU and a CUDA build of vLLM importable by "
        f"{sys.executable}; nothing was checked"
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["summary.txt"]
