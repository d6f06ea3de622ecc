"""KV-cache events of the CPU pool, received by a real ZeroMQ subscriber.

The session's ``tiering_server`` (tests/e2e/serving.py: ``vllm serve`` with
the guide's ``KVEventsConfig``, ``publisher="zmq"``,
``endpoint="tcp://*:<port>"``, ``topic="kv_events"``, and the tiering spec,
whose CPU tier is an 8-block pool) publishes; the test process subscribes on
``tcp://127.0.0.1:<port>`` with the decoding code of
``examples/kv_events_subscriber.py``. After ``POST
/reset_prefix_cache?reset_external=true`` has emptied the pool, three prompts
of 4 full 128-token blocks each, documents no other test sends, are sent one
at a time, so the pool stores 12 blocks and must evict 4. Then the same reset
empties the pool again: a CPU ``BlockRemoved`` must announce exactly the
blocks it held.

The events are published by the scheduler, in the engine-core process.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.e2e.conftest import DOC_WORDS
from tests.e2e.serving import EVENTS_TOPIC
from vllm_ascend.kv_offload.testing.tiny_model import make_prompt

pytestmark = pytest.mark.e2e

TOPIC = EVENTS_TOPIC
NUM_CPU_BLOCKS = 8  # the shared server's CPU tier (serving.tiering_config)
BLOCKS_PER_PROMPT = 4  # 512-token document + 40-token question, 128-token blocks
# Documents of their own: blocks no other test stored in the fs tier, so
# each one reaches the CPU pool by a store, never by a promotion.
PROMPTS = [
    f"{make_prompt(DOC_WORDS, seed=300 + d)} {make_prompt(40, seed=3000 + d)}"
    for d in range(3)
]


@pytest.fixture(scope="module")
def engine_run(tiering_server) -> dict:
    """The messages the subscriber received from the emptied pool on: all,
    those published before the second reset and from it on; the pool's
    gauge then."""
    server, events = tiering_server, tiering_server.events
    # Nothing in flight (earlier tests' cascades), then the pool emptied.
    server.quiesce()
    server.reset_caches()
    first = events.settled(server)
    for prompt in PROMPTS:
        server.ask(prompt)
        # Stores complete asynchronously and their events are published on a
        # later engine step: short requests provide those steps, so each
        # prompt's blocks are in the pool before the next prompt evicts.
        server.quiesce()
    metrics = server.metrics()
    reset_at = events.settled(server)
    server.reset_caches()
    last = events.settled(server)
    return {
        "messages": events.messages[first:last],
        "before_reset": events.messages[first:reset_at],
        "reset": events.messages[reset_at:last],
        "blocks_in_use": [metrics["vllm:kv_offload_cpu_pool_blocks_in_use"]],
    }


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


def test_cpu_pool_stores_every_full_block(engine_run):
    messages = engine_run["before_reset"]
    stored = events_of(messages, "BlockStored", "CPU")
    hashes = [h for _, block_hashes in stored for h in block_hashes]
    # Each prompt's 4 full blocks, each stored once.
    assert len(hashes) == len(set(hashes)) == BLOCKS_PER_PROMPT * len(PROMPTS)
    # Every block offloaded to the CPU was computed on the device first.
    device = {h for _, bh in events_of(messages, "BlockStored", "GPU") for h in bh}
    assert set(hashes) <= device


def test_cpu_pool_evicts_only_blocks_it_stored(engine_run):
    messages = engine_run["before_reset"]
    stored_at: dict = {}
    for seq, block_hashes in events_of(messages, "BlockStored", "CPU"):
        for h in block_hashes:
            stored_at.setdefault(h, seq)
    removed = events_of(messages, "BlockRemoved", "CPU")
    removed_hashes = [h for _, block_hashes in removed for h in block_hashes]
    # 12 blocks through an 8-block pool: 4 evictions, each of a stored block,
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


def test_cpu_pool_never_holds_more_than_its_blocks(engine_run):
    sizes = [len(resident) for resident in cpu_index(engine_run["before_reset"])]
    assert max(sizes) == NUM_CPU_BLOCKS
    assert sizes[-1] == NUM_CPU_BLOCKS


def test_a_reset_of_the_cpu_pool_removes_exactly_the_blocks_it_held(engine_run):
    resident = cpu_index(engine_run["before_reset"])[-1]
    reset_messages = engine_run["reset"]
    # The pool's own gauge agrees with the index the events built.
    assert engine_run["blocks_in_use"] == [len(resident)] == [NUM_CPU_BLOCKS]
    removed = events_of(reset_messages, "BlockRemoved", "CPU")
    removed_hashes = [h for _, block_hashes in removed for h in block_hashes]
    assert sorted(removed_hashes) == sorted(resident)
    # Nothing stored since (the flush request has no full block).
    assert events_of(reset_messages, "BlockStored", "CPU") == []
