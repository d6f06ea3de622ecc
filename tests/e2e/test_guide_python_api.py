"""The user guide's Python API (docs/user_guide.md, "Python API") run as the
doc says, as a script: its code block read from the doc, with one test-only
change, the model (no hub here: the example's generated Qwen3), and
``VLLM_CPU_KVCACHE_SPACE=1`` in the environment (on vLLM's CPU backend the
guide's ``gpu_memory_utilization=0.5`` would take half of the host's memory,
next to the other test worker's engines). vLLM starts its engine by spawn
there, which imports the script again: the doc's main guard is what lets it
run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import doc_block, doc_env
from vllm_ascend.kv_offload.testing.tiny_model import (
    DEMO_DIR,
    DEMO_SPEC,
    ensure_tiny_model,
)

pytestmark = pytest.mark.e2e

GUARD = 'if __name__ == "__main__":'


def test_the_guides_python_api_runs_as_a_script(tmp_path):
    code = doc_block(GUARD, "python", "user_guide.md")
    assert 'model="Qwen/Qwen3-0.6B"' in code
    model = ensure_tiny_model(DEMO_DIR, DEMO_SPEC)
    script = tmp_path / "offload.py"
    script.write_text(code.replace('"Qwen/Qwen3-0.6B"', repr(model)))
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**doc_env(), "VLLM_CPU_KVCACHE_SPACE": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    # What the snippet prints, among vLLM's log lines.
    printed = [
        line
        for line in proc.stdout.splitlines()
        if line.startswith(("Prompt: ", "Generated: "))
    ]
    assert len(printed) == 2, proc.stdout[-4000:]
    assert printed[0] == "Prompt: 'Hello, my name is'"
    assert printed[1].startswith("Generated: '") and len(printed[1]) > 20
    # The guide's configuration, loaded by vLLM's connector.
    assert "NPUOffloadingSpec: 1000 CPU blocks of 128 tokens" in proc.stdout
