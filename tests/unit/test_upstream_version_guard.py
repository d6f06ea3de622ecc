"""Next to an upstream vllm-ascend that owns ``vllm_ascend/kv_offload``
itself, our general plugin (which vLLM runs in every process before the
engine starts) fails at once, naming both versions and the fix. Upstream's
installed metadata is faked with a dist-info directory put first on
``sys.path`` of a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fake_upstream(site: Path, version: str, files: list[str]) -> None:
    info = site / f"vllm_ascend-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm-ascend\nVersion: {version}\n"
    )
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))


def _register(site: Path) -> subprocess.CompletedProcess:
    code = (
        f"import sys; sys.path.insert(0, {str(site)!r}); "
        "from vllm_ascend.kv_offload import plugin; plugin.register(); "
        "print('registered')"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT
    )


@pytest.mark.parametrize("version", ["0.23.0.post1", "0.11.0"])
def test_upstream_before_0_30_is_refused_with_both_versions_and_the_fix(
    tmp_path, version
):
    _fake_upstream(tmp_path, version, ["vllm_ascend/kv_offload/npu.py"])
    proc = _register(tmp_path)
    assert proc.returncode != 0
    assert f"vllm-ascend {version}" in proc.stderr
    assert "vllm-ascend-kv-offload 0." in proc.stderr
    assert "Upgrade to vllm-ascend >= 0.30" in proc.stderr


def test_upstream_0_30_without_kv_offload_lives_next_to_us(tmp_path):
    _fake_upstream(tmp_path, "0.30.0rc2", ["vllm_ascend/__init__.py"])
    proc = _register(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "registered" in proc.stdout


def test_upstream_with_this_subtree_built_in_is_refused_while_we_are_installed(
    tmp_path,
):
    # A future upstream that merged the graft, plus this distribution (the
    # editable install of this checkout) over the same files.
    _fake_upstream(tmp_path, "0.40.0", ["vllm_ascend/kv_offload/npu.py"])
    proc = _register(tmp_path)
    assert proc.returncode != 0
    assert "ships vllm_ascend/kv_offload itself" in proc.stderr
    assert "Uninstall vllm-ascend-kv-offload" in proc.stderr
