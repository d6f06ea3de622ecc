"""The examples' ``--help``, run as the docs show it (``python
examples/<example>.py --help`` from the checkout): it prints every flag and
exits 0, before any engine or model is touched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SIZING_FLAGS = ("--num-cpu-blocks", "--cpu-bytes", "--kv-cache-bytes")


@pytest.mark.parametrize(
    "example", ["offline_inference_kv_offload.py", "kv_offload_sizing.py"]
)
def test_help_lists_the_sizing_flags_and_exits_0(example):
    proc = subprocess.run(
        [sys.executable, f"examples/{example}", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:")
    for flag in SIZING_FLAGS:
        assert flag in proc.stdout
    # The auto pool's share, as the help text states it.
    assert "auto: 50% of the host memory" in " ".join(proc.stdout.split())
