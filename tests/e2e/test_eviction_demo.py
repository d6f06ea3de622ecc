"""The serving doc's KV-events eviction demo, run as
docs/serving_events_metrics.md shows it ("Evictions").

Its bash blocks are read from the doc and run by bash: the server
(``VLLM_SERVER_DEV_MODE=1 bash examples/serve_kv_offload.sh --num-cpu-blocks
6 --kv-events-config ...``), the subscriber ``python
examples/kv_events_subscriber.py`` started before it, and, with ``MODEL`` and
``req`` from the doc's client flow, three prompts of 4 full blocks one at a
time, the reset with ``reset_external=true`` and the flush request. Test-only
changes: the ports (free ones for the doc's 8000 and 5556), the server's
``--enforce-eager --max-model-len 1024`` (no compiling, a small device
cache), and ``VLLM_CPU_KVCACHE_SPACE`` unset, as in a new user's shell.

What the subscriber prints must be what the doc's sample output shows:
4 CPU ``BlockStored`` per prompt, a ``BlockRemoved`` whenever the 6-block
pool must make room (2, then 4 blocks), and the reset's ``BlockRemoved`` of
the 6 blocks left, so an index built from the events ends empty; the same
hashes as the sample.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, doc_block, doc_env
from vllm_ascend.kv_offload.testing import server as driver

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 300
TEST_FLAGS = " --enforce-eager --max-model-len 1024"
POOL_BLOCKS = 6
PROMPT_BLOCKS = 4
# "17:46:41 seq=2 BlockRemoved medium=CPU blocks=2 [f0c1..., 66c6...]"
EVENT = re.compile(r"^\S+ seq=\d+ (BlockStored|BlockRemoved) +medium=CPU .*\[(.*)\]$")


def cpu_runs(output: str) -> list[tuple[str, set[str]]]:
    """The subscriber's CPU events as runs of one kind: ``(kind, hashes)``."""
    runs: list[tuple[str, set[str]]] = []
    for line in output.splitlines():
        m = EVENT.match(line)
        if m is None:
            continue
        kind, hashes = m.group(1), set(m.group(2).split(", "))
        if runs and runs[-1][0] == kind:
            runs[-1][1].update(hashes)
        else:
            runs.append((kind, hashes))
    return runs


def summary(output: str) -> dict[str, int]:
    """The subscriber's last line: events received by kind and medium."""
    (line,) = [x for x in output.splitlines() if x.startswith("events received:")]
    return ast.literal_eval(line.split(":", 1)[1].strip())


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("eviction_demo")
    env = doc_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    events_port = str(driver.free_port())
    start_block = doc_block("--num-cpu-blocks 6").replace("5556", events_port)
    serve, subscribe = start_block.split("\npython examples/kv_events_subscriber.py")
    subscriber = subprocess.Popen(
        [sys.executable, "examples/kv_events_subscriber.py", *subscribe.split()],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server = driver.Server(
        ["env", "-u", "VLLM_CPU_KVCACHE_SPACE", "bash", "-c", serve + TEST_FLAGS],
        tmp / "server.log",
        {"PATH": env["PATH"], "PYTHONPATH": env["PYTHONPATH"]},
        REPO,
    )
    record: dict = {}
    try:
        record["start_s"] = server.wait_ready(START_TIMEOUT_S)
        # The client flow's MODEL and req, then the demo's requests.
        flow = doc_block("req() {")
        requests = flow[: flow.index("\n}\n") + 3] + doc_block("for seed in")
        requests = requests.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
        out = subprocess.check_output(["bash", "-c", requests], cwd=REPO, env=env)
        record["replies"] = [json.loads(x) for x in out.splitlines()]
        # The reset's event goes out on the flush request's step.
        time.sleep(3)
    finally:
        subscriber.send_signal(signal.SIGTERM)
        record["subscriber"] = subscriber.communicate(timeout=60)[0]
        record["stop"] = server.stop()
        record["log"] = server.log_path.read_text(errors="replace")
    print(f"\n[eviction demo] start {record['start_s']:.1f} s\n{record['subscriber']}")
    return record


def test_the_server_runs_the_guides_spec_with_a_six_block_pool(demo):
    assert "NPUOffloadingSpec: 6 CPU blocks of 128 tokens" in demo["log"]
    assert demo["stop"]["orphans"] == []


def test_the_requests_are_answered(demo):
    replies = demo["replies"]
    completions = [r for r in replies if "success" not in r]
    assert [r["usage"]["prompt_tokens"] for r in completions[:3]] == [600] * 3
    assert all("text" in r for r in completions), replies  # no error reply
    assert [r for r in replies if "success" in r] == [{"success": True}]


def test_each_prompt_stores_4_blocks_and_the_pool_evicts_to_make_room(demo):
    runs = cpu_runs(demo["subscriber"])
    # 4 stored; 2 evicted for the second prompt (2 free of 6), 4 for the
    # third; the reset removes the 6 left.
    assert [(kind, len(hashes)) for kind, hashes in runs] == [
        ("BlockStored", PROMPT_BLOCKS),
        ("BlockRemoved", 2),
        ("BlockStored", PROMPT_BLOCKS),
        ("BlockRemoved", PROMPT_BLOCKS),
        ("BlockStored", PROMPT_BLOCKS),
        ("BlockRemoved", POOL_BLOCKS),
    ], demo["subscriber"]
    assert "! missed messages" not in demo["subscriber"]
    counts = summary(demo["subscriber"])
    assert counts["BlockStored CPU"] == 3 * PROMPT_BLOCKS
    assert counts["AllBlocksCleared"] == 1
    # The device's events are received but not printed without --all-media.
    assert counts["BlockStored GPU"] > 0
    assert "medium=GPU" not in demo["subscriber"]


def test_an_index_built_from_the_events_ends_empty(demo):
    index: set[str] = set()
    stored: set[str] = set()
    for kind, hashes in cpu_runs(demo["subscriber"]):
        if kind == "BlockStored":
            assert not hashes & stored  # 12 distinct blocks
            stored |= hashes
            index |= hashes
        else:
            assert hashes <= index  # only blocks the pool holds
            index -= hashes
        assert len(index) <= POOL_BLOCKS
    assert index == set()  # the reset's BlockRemoved: every block left


def test_the_doc_shows_what_the_subscriber_printed(demo):
    sample = doc_block(":5556 topic", "text")  # the doc's sample output
    assert cpu_runs(demo["subscriber"]) == cpu_runs(sample)
    assert summary(demo["subscriber"]) == summary(sample)
