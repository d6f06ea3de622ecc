"""The fs tier's size bound end to end: two engine processes write one
bounded directory at the same time (each engine in-process in its own
scenario process).

Engines A and B (separate processes, small CPU tiers) serve the same eight
documents in opposite orders, both storing and evicting in the shared
directory. Then each serves a document of its own: those are the newest
files once both rounds have reached the tier (a round begins when every
engine's previous one has). Then each serves the other's document: in no CPU
tier of its own, so loaded from the directory whatever the first round's
interleaving evicted (a round of hits writes nothing, so evicts nothing).
Last, the eight documents again, loads and evictions interleaved. The device
prefix cache is reset between rounds. Outputs must equal offloading off; the
directory must stay within ``max_bytes`` (plus the amortization slack),
evictions must show in vLLM's offloading metrics, and every remaining file
must be a whole block file.
"""

from __future__ import annotations

import os
import threading

import pytest

from tests.e2e.conftest import (
    ENGINE,
    cached,
    in_process,
    run_scenario,
    tiering,
    token_ids,
)
from tests.e2e.run_scenario import block_files, temp_files
from vllm_ascend.kv_offload.testing.tiny_model import make_prompt
from vllm_ascend.kv_offload.tiering.block_file import HEADER_BYTES
from vllm_ascend.kv_offload.tiering.fs_budget import EVICTED_BLOCKS, TIER_BYTES

pytestmark = pytest.mark.e2e

# Tiny model: 2 layers x K,V x 2 KV heads x 32 dims x 128 tokens x fp32.
FILE_BYTES = HEADER_BYTES + 2 * 2 * 2 * 32 * 128 * 4
BOUND_FILES = 12
DOCS = [make_prompt(512, seed=300 + d) for d in range(8)]  # 4 blocks each
PROMPTS = [f"{doc} {make_prompt(20, seed=400 + i)}" for i, doc in enumerate(DOCS)]
OWN = {
    w: f"{make_prompt(512, seed=500 + i)} {make_prompt(20, seed=600 + i)}"
    for i, w in enumerate("ab")
}
OTHER = {"a": "b", "b": "a"}


def bounded(root: str) -> dict:
    offload = tiering(root, num_cpu_blocks=16)
    offload["secondary_tiers"][0]["max_bytes"] = BOUND_FILES * FILE_BYTES
    return offload


def test_two_engines_share_one_bounded_directory(scenario_dir):
    root = str(scenario_dir / "tier-bounded")
    ready = {w: str(scenario_dir / f"bound-{w}.ready") for w in "ab"}
    docs = {"a": PROMPTS, "b": PROMPTS[::-1]}
    scenarios = {
        w: in_process(
            {
                "engine": ENGINE,
                "offload": bounded(root),
                "kv_load_failure_policy": "recompute",
                "root_dir": root,
                "phases": [
                    {"prompts": prompts, "reset_prefix_cache": i > 0}
                    for i, prompts in enumerate(
                        [docs[w], [OWN[w]], [OWN[OTHER[w]]], docs[w]]
                    )
                ],
                "barrier": {"mine": ready[w], "others": [ready[OTHER[w]]]},
            }
        )
        for w in "ab"
    }
    reference = [*PROMPTS, OWN["a"], OWN["b"]]
    scenarios["ref"] = in_process({"offload": None, "phases": [{"prompts": reference}]})
    results: dict[str, dict | BaseException] = {}

    def run(name: str) -> None:
        try:
            results[name] = run_scenario(scenario_dir, f"bound_{name}", scenarios[name])
        except BaseException as e:  # reported below, with the engine's log
            results[name] = e

    threads = [threading.Thread(target=run, args=(n,)) for n in scenarios]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in results.values():
        if isinstance(result, BaseException):
            raise result

    ref = dict(zip(reference, token_ids(results["ref"]["phases"][0]), strict=True))
    a, b = results["a"], results["b"]
    for w, engine in (("a", a), ("b", b)):
        served = [*docs[w], OWN[w], OWN[OTHER[w]], *docs[w]]
        assert token_ids(engine) == [ref[p] for p in served]
        # The other engine's document came from the directory.
        assert cached(engine)[len(docs[w]) + 1] >= 512
        assert engine["counters"]["vllm:kv_offload_tiering_read_bytes"] > 0
    evicted = sum(e["counters"].get(EVICTED_BLOCKS, 0) for e in (a, b))
    assert evicted > 0
    # 40 distinct blocks were stored, at most the bound and the slack stay.
    files = block_files(root)
    total = sum(os.path.getsize(p) for p in files)
    slack = 2 * max(1, BOUND_FILES // 8) * FILE_BYTES
    assert total <= BOUND_FILES * FILE_BYTES + slack
    assert all(os.path.getsize(p) == FILE_BYTES for p in files)
    assert 0 < a["counters"].get(TIER_BYTES, 0) <= BOUND_FILES * FILE_BYTES + slack
    assert not temp_files(root)
