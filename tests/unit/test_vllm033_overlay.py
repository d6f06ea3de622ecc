"""The vLLM 0.33 overlay (tests/vllm033/overlay.py) when parallel test
workers ask for it at once: one builds it, every one gets it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO
from tests.packaging.upstream import cache_root
from tests.vllm033.overlay import VERSION, overlay_dir

PROCESSES = 3

ASK = """
import sys, time
from tests.vllm033.overlay import overlay_dir
time.sleep(max(0.0, float(sys.argv[1]) - time.time()))
print(overlay_dir())
"""


def test_concurrent_callers_all_get_the_overlay(tmp_path: Path):
    overlay_dir()  # the wheel downloaded once into the real cache
    (wheel,) = cache_root().glob(f"vllm-{VERSION}-*.whl")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / wheel.name).symlink_to(wheel)
    env = {**os.environ, "VLLM_ASCEND_KV_OFFLOAD_CACHE": str(cache)}
    start = str(time.time() + 3)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ASK, start],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(PROCESSES)
    ]
    results = [(p.communicate(timeout=300), p.returncode) for p in procs]
    built = cache / f"vllm-{VERSION}-offloading-overlay"
    assert [(out.strip(), rc) for (out, _), rc in results] == [
        (str(built), 0)
    ] * PROCESSES, [err[-2000:] for (_, err), _ in results]
    assert (built / "sitecustomize.py").exists()
