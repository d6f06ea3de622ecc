"""KV-cache events of the CPU pool, received by a real ZeroMQ subscriber.

An offline ``LLM`` runs in its own process with the guide's ``KVEventsConfig``
(``publisher="zmq"``, ``endpoint="tcp://*:<port>"``, ``topic="kv_events"``)
and the guide's offloading config with a 6-block CPU pool; the test process
subscribes on ``tcp://127.0.0.1:<port>`` with the decoding code of
``examples/kv_events_subscriber.py``. Three prompts of 4 full 128-token blocks
each are sent one at a time, so the pool stores 12 blocks and must evict 6.
Then ``reset_prefix_cache(reset_connector=True)`` (the server's
``POST /reset_prefix_cache?reset_external=true``) empties the pool: a CPU
``BlockRemoved`` must announce exactly the blocks it held.

The events are published by the scheduler, in the engine-core process.

    python -m tests.e2e.test_kv_events PORT   # the engine side, run by the test
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from tests.e2e.conftest import (
    ENGINE,
    GUIDE_OFFLOAD,
    PROMPTS_BY_DOC,
    REPO,
    load_subscriber,
    zmq_events_config,
)
from vllm_ascend.kv_offload.testing.server import free_port

pytestmark = pytest.mark.e2e

TOPIC = "kv_events"
NUM_CPU_BLOCKS = 6
BLOCKS_PER_PROMPT = 4  # 512-token document + 40-token question, 128-token blocks
PROMPTS = [questions[0] for questions in PROMPTS_BY_DOC]
ENGINE_TIMEOUT_S = 600
# The device KV cache, given: vLLM's CPU backend would otherwise reserve 92 %
# of the host's memory and refuse to start on a machine that has less free.
KV_CACHE_BYTES = 2**30


def run_engine(port: int) -> None:
    """The engine side: the guide's events and offloading configs, 3 prompts."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model

    kv_events_config = zmq_events_config(port, TOPIC)
    kv_transfer_config = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config=dict(GUIDE_OFFLOAD, num_cpu_blocks=NUM_CPU_BLOCKS),
    )
    llm = LLM(
        model=ensure_tiny_model(),
        kv_transfer_config=kv_transfer_config,
        kv_events_config=kv_events_config,
        disable_log_stats=False,  # get_metrics(): the pool's gauge
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        **ENGINE,
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS:
        llm.generate([prompt], params, use_tqdm=False)
        # Stores complete asynchronously and their events are published on a
        # later engine step: a short request provides those steps, so each
        # prompt's blocks are in the pool before the next prompt evicts.
        llm.generate(["flush"], SamplingParams(max_tokens=4), use_tqdm=False)
    in_use = [
        m.value
        for m in llm.get_metrics()
        if m.name == "vllm:kv_offload_cpu_pool_blocks_in_use"
    ]
    # What the test reads: when the reset began and the pool's gauge then.
    print(json.dumps({"reset_at": time.time(), "blocks_in_use": in_use}), flush=True)
    assert llm.reset_prefix_cache(reset_connector=True)
    llm.generate(["flush"], SamplingParams(max_tokens=4), use_tqdm=False)
    # The publisher sends from a background thread; give it time to drain.
    time.sleep(3)


@pytest.fixture(scope="module")
def engine_run() -> dict:
    """Every message the subscriber received while the engine ran, and
    what the engine printed before its reset."""
    subscriber = load_subscriber()
    port = free_port()
    received: list = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def collect() -> None:
        try:
            endpoint = f"tcp://127.0.0.1:{port}"
            received.extend(subscriber.subscribe(endpoint, TOPIC, stop=stop))
        except BaseException as exc:  # reported by the fixture
            errors.append(exc)

    # Subscribe first: ZeroMQ connects once the engine binds the port.
    thread = threading.Thread(target=collect, name="kv-events-sub", daemon=True)
    thread.start()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    # As the serving doc runs the engine side: nothing sizes it but itself.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.e2e.test_kv_events", str(port)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=ENGINE_TIMEOUT_S,
        )
    finally:
        time.sleep(1)
        stop.set()
        thread.join(timeout=30)
    if proc.returncode != 0:
        raise AssertionError(
            f"engine process failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    assert not thread.is_alive(), "subscriber thread did not stop"
    assert not errors, f"subscriber failed: {errors!r}"
    lines = [line for line in proc.stdout.splitlines() if '"reset_at"' in line]
    return {"messages": received, **json.loads(lines[-1])}


@pytest.fixture(scope="module")
def messages(engine_run) -> list:
    """The messages published before the reset."""
    return [m for m in engine_run["messages"] if m.batch.ts < engine_run["reset_at"]]


@pytest.fixture(scope="module")
def reset_messages(engine_run) -> list:
    """The messages published from the reset on."""
    return [m for m in engine_run["messages"] if m.batch.ts >= engine_run["reset_at"]]


def events_of(messages: list, kind: str, medium: str) -> list[tuple[int, list]]:
    """``(seq, block_hashes)`` of every ``kind`` event on ``medium``."""
    return [
        (msg.seq, list(event.block_hashes))
        for msg in messages
        for event in msg.batch.events
        if type(event).__name__ == kind and event.medium == medium
    ]


def test_messages_are_decoded_in_order_without_gaps(engine_run):
    messages = engine_run["messages"]
    assert messages, "no KV events received"
    assert {msg.topic for msg in messages} == {TOPIC}
    seqs = [msg.seq for msg in messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    kinds = Counter(type(e).__name__ for msg in messages for e in msg.batch.events)
    assert set(kinds) <= {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, kinds


def test_cpu_pool_stores_every_full_block(messages):
    stored = events_of(messages, "BlockStored", "CPU")
    hashes = [h for _, block_hashes in stored for h in block_hashes]
    # Each prompt's 4 full blocks, each stored once.
    assert len(hashes) == len(set(hashes)) == BLOCKS_PER_PROMPT * len(PROMPTS)
    # Every block offloaded to the CPU was computed on the device first.
    device = {h for _, bh in events_of(messages, "BlockStored", "GPU") for h in bh}
    assert set(hashes) <= device


def test_cpu_pool_evicts_only_blocks_it_stored(messages):
    stored_at: dict = {}
    for seq, block_hashes in events_of(messages, "BlockStored", "CPU"):
        for h in block_hashes:
            stored_at.setdefault(h, seq)
    removed = events_of(messages, "BlockRemoved", "CPU")
    removed_hashes = [h for _, block_hashes in removed for h in block_hashes]
    # 12 blocks through a 6-block pool: 6 evictions, each of a stored block,
    # each once, and never before it was stored.
    total = BLOCKS_PER_PROMPT * len(PROMPTS)
    assert len(removed_hashes) == total - NUM_CPU_BLOCKS
    assert len(set(removed_hashes)) == len(removed_hashes)
    assert set(removed_hashes) <= set(stored_at)
    for seq, block_hashes in removed:
        assert all(stored_at[h] <= seq for h in block_hashes)


def cpu_index(messages: list) -> list[set]:
    """The CPU blocks an index built from the events holds, after each
    CPU event."""
    resident: set = set()
    states = []
    for msg in messages:
        for event in msg.batch.events:
            if getattr(event, "medium", None) != "CPU":
                continue
            if type(event).__name__ == "BlockStored":
                resident.update(event.block_hashes)
            elif type(event).__name__ == "BlockRemoved":
                resident.difference_update(event.block_hashes)
            states.append(set(resident))
    return states


def test_cpu_pool_never_holds_more_than_its_blocks(messages):
    sizes = [len(resident) for resident in cpu_index(messages)]
    assert max(sizes) == NUM_CPU_BLOCKS
    assert sizes[-1] == NUM_CPU_BLOCKS


def test_a_reset_of_the_cpu_pool_removes_exactly_the_blocks_it_held(
    engine_run, messages, reset_messages
):
    resident = cpu_index(messages)[-1]
    # The pool's own gauge agrees with the index the events built.
    assert engine_run["blocks_in_use"] == [len(resident)] == [NUM_CPU_BLOCKS]
    removed = events_of(reset_messages, "BlockRemoved", "CPU")
    removed_hashes = [h for _, block_hashes in removed for h in block_hashes]
    assert sorted(removed_hashes) == sorted(resident)
    # Nothing stored since (the flush request has no full block).
    assert events_of(reset_messages, "BlockStored", "CPU") == []


def test_subscriber_example_formats_cpu_events(messages):
    subscriber = load_subscriber()
    lines = [
        subscriber.describe(event) for msg in messages for event in msg.batch.events
    ]
    cpu_lines = [line for line in lines if line is not None]
    assert any(line.startswith("BlockStored  medium=CPU") for line in cpu_lines)
    assert any(line.startswith("BlockRemoved medium=CPU") for line in cpu_lines)
    # Device events are filtered out unless asked for.
    assert len(cpu_lines) < len(lines)


if __name__ == "__main__":
    run_engine(int(sys.argv[1]))
