"""``scripts/install_next_to_vllm_ascend.sh`` on a machine without torch_npu.

The script runs against a venv layered on this interpreter's (vLLM, torch:
no download), the way a user runs it in an environment that has vLLM but no
NPU. It must refuse an upstream vllm-ascend < 0.30 with one line before
building anything; without one it must install, verify and exit 0 saying
what was not built, never print a traceback, and leave no build output in
the checkout.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.packaging import upstream

pytestmark = pytest.mark.packaging

REPO = upstream.REPO_ROOT
SCRIPT = REPO / "scripts" / "install_next_to_vllm_ascend.sh"


def _layered_venv(root: Path) -> tuple[Path, str]:
    """A venv whose site-packages adds this interpreter's (no pip of its own:
    ``python -m pip`` comes from the base, installs go to the venv); returns
    its python and its site-packages."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(root)], check=True
    )
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # Every site directory of this interpreter, including those added by a
    # .pth of its own (whose .pth files the layered venv would not process).
    base = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    base += [p for p in sys.path if p.endswith("site-packages")]
    Path(purelib, "_base_env.pth").write_text("\n".join(dict.fromkeys(base)) + "\n")
    return python, purelib


def _build_outputs() -> set[str]:
    """What a build in place would leave in the checkout."""
    found = {p.name for p in REPO.glob("*.egg-info")}
    if (REPO / "build").exists():
        found.add("build")
    return found


def _run(python: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=str(python), TMPDIR=str(tmp_path))
    # A checkout on PYTHONPATH would shadow what the script installs.
    for var in ("VLLM_PLUGINS", "PYTHONPATH"):
        env.pop(var, None)
    return subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )


def test_install_script_without_torch_npu(tmp_path):
    if importlib.util.find_spec("torch_npu") is not None:  # an Ascend machine
        pytest.skip("torch_npu is installed: this checks a machine without it")
    python, purelib = _layered_venv(tmp_path / "venv")
    before = _build_outputs()

    # An upstream vllm-ascend older than 0.30: refused before any build.
    old = Path(purelib, "vllm_ascend-0.23.0.dist-info")
    old.mkdir()
    (old / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-ascend\nVersion: 0.23.0\n"
    )
    refused = _run(python, tmp_path)
    output = refused.stdout + refused.stderr
    assert refused.returncode == 1, output
    assert "vllm-ascend 0.23.0 is installed" in output, output
    assert "building" not in output, output
    assert "Traceback" not in output, output

    # Without it: installed into the venv, verified, exit 0.
    shutil.rmtree(old)
    done = _run(python, tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Traceback" not in output, output
    assert "torch_npu: not installed" in output, output
    assert "done: not an Ascend machine: installed, npu backend not built" in output, (
        output
    )
    assert f"from {purelib}/vllm_ascend/kv_offload/npu.py" in output, output
    assert "native op: True" in output, output
    assert _build_outputs() == before
