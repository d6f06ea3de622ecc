"""The examples as a new user meets them: ``--help``, run as the docs show
it (``python examples/<example>.py --help`` from the checkout), prints every
flag and exits 0 before any engine or model is touched; the offline
example's completion of the generated model says that its text means
nothing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
SIZING_FLAGS = ("--num-cpu-blocks", "--cpu-bytes", "--kv-cache-bytes")


def offline_example():
    """``examples/offline_inference_kv_offload.py``, imported by path (its
    module level imports no vLLM)."""
    path = REPO / "examples" / "offline_inference_kv_offload.py"
    spec = importlib.util.spec_from_file_location("offline_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def completion(text: str) -> SimpleNamespace:
    """What ``LLM.generate`` returns for one prompt, as far as it is printed."""
    return SimpleNamespace(
        prompt="Hello, my name is", outputs=[SimpleNamespace(text=text)]
    )


@pytest.mark.parametrize("generated", [True, False], ids=["generated", "--model"])
def test_completion_of_the_generated_model_is_explained_where_printed(
    generated, capsys
):
    offline_example().print_completions([completion(" kuke data nuva")], generated)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["Prompt: 'Hello, my name is'", "Generated: ' kuke data nuva'"]
    if generated:
        (note,) = lines[2:]
        assert "random weights" in note and "meaningless" in note
        assert "time to first token" in note
    else:
        # A real model's text speaks for itself.
        assert lines[2:] == []
