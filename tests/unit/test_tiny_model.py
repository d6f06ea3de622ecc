"""The generated test model (testing/tiny_model.py) when several processes
ask for it at once, as the suite's parallel workers and a user's scripts do:
one of them writes it, and a model handed back is never rewritten under its
reader."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO

PROCESSES = 4

# Waits until ``start`` (all processes at once), asks for the model, and
# prints each file's modification time as it was handed back.
ASK = """
import json, sys, time
from pathlib import Path
from vllm_ascend.kv_offload.testing.tiny_model import TinyModelSpec, ensure_tiny_model
out, start = Path(sys.argv[1]), float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))
ensure_tiny_model(out, TinyModelSpec(num_layers=4))
print(json.dumps({p.name: p.stat().st_mtime_ns for p in out.iterdir()}))
"""


def test_concurrent_callers_get_one_model_written_once(tmp_path: Path):
    out = tmp_path / "model"
    start = time.time() + 5  # after every interpreter has started
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ASK, str(out), str(start)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for _ in range(PROCESSES)
    ]
    seen = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0] * PROCESSES
    final = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    # Had another caller written the model again after one got it, that one's
    # files would have changed under it.
    assert seen == [final] * PROCESSES
