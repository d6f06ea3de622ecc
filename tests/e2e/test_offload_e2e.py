"""End to end on a real vLLM engine (CPU backend): offloading changes no output.

Every scenario compares greedy token ids against the same prompts run with
offloading off (the ``reference`` fixture). Each runs twice: with the
installed vLLM's offloading code and with vLLM 0.33's (``offloading_code``).
Per offloading code, the scenarios' engines run one after the other in one
process (``runs``), in-process; vLLM's default process layout runs the
guide's config in tests/e2e/test_serve.py and faults in
tests/e2e/test_failures.py.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import (
    ALL_PROMPTS,
    ENGINE,
    FIRST_PROMPTS,
    FULL_DOC_TOKENS,
    GUIDE_OFFLOAD,
    PROMPTS_BY_DOC,
    TWICE,
    cached,
    in_process,
    run_sequence,
    token_ids,
)
from tests.vllm_version import VLLM_VERSION

pytestmark = pytest.mark.e2e

SCENARIOS = {
    # The guide's exact config: all prompts, then again from the CPU only.
    "guide": {
        "offload": GUIDE_OFFLOAD,
        "phases": TWICE,
    },
    # 10 device blocks hold one document's questions, not all three.
    "small_device": {
        "engine": dict(ENGINE, max_model_len=1024, num_gpu_blocks_override=10),
        "offload": GUIDE_OFFLOAD,
        "phases": [{"prompts": ALL_PROMPTS}, {"prompts": PROMPTS_BY_DOC[0]}],
    },
    # 9 CPU blocks: room for two documents' 4-block prefixes, not three, so
    # storing the third evicts 3 blocks of the least recently used document.
    # A phase per document: the engine settles after each. vLLM's connector
    # tells the policy of a request's end (which ranks its blocks anew) at
    # the end of the next engine step; in-process, without a settle, that
    # step is the one scheduling the next request, after its stores, and
    # document 1's blocks, not 0's, became the least recently used.
    "small_cpu": {
        "offload": dict(GUIDE_OFFLOAD, num_cpu_blocks=9),
        "phases": [
            *({"prompts": [prompt]} for prompt in FIRST_PROMPTS),
            # Most recent first: documents 2 and 1 are whole in the pool,
            # document 0 lost blocks.
            {"prompts": FIRST_PROMPTS[::-1], "reset_prefix_cache": True},
        ],
    },
    "corrupting": {
        "offload": dict(
            GUIDE_OFFLOAD,
            spec_name="CorruptingOffloadingSpec",
            spec_module_path="tests.e2e.corrupting_spec",
        ),
        "phases": TWICE,
    },
    # Layers registered as unequal (part0, part1) tuples, as on Ascend.
    "tuple_layout": {
        "offload": GUIDE_OFFLOAD,
        "connector": "TupleLayoutOffloadingConnector",
        "connector_module_path": "tests.e2e.tuple_layout_connector",
        "phases": [
            {"prompts": PROMPTS_BY_DOC[0]},
            {"prompts": PROMPTS_BY_DOC[0], "reset_prefix_cache": True},
        ],
    },
}


@pytest.fixture(scope="module")
def runs(scenario_dir, offloading_code) -> dict[str, dict]:
    """Every scenario's result, by name: one in-process engine after the
    other in one process."""
    suffix = "_0.33" if offloading_code else ""
    scenarios = {name: in_process(s) for name, s in SCENARIOS.items()}
    name = f"offload_e2e{suffix}"
    return run_sequence(scenario_dir, name, scenarios, **offloading_code)


def test_outputs_with_offloading_equal_outputs_without(
    runs, reference, offloading_code
):
    guide_run = runs["guide"]
    assert token_ids(guide_run["phases"][0]) == reference
    # The overlay really served vLLM 0.33's offloading modules.
    want = "0.33.0" if offloading_code else None
    assert guide_run["offloading_overlay"] == want


def test_after_prefix_cache_reset_prompts_are_served_from_cpu(runs, reference):
    second = runs["guide"]["phases"][1]
    assert token_ids(second) == reference
    # The device cache was emptied, so every cached token came from the CPU;
    # the first question of each document loads its full 4-block prefix.
    for doc in range(len(PROMPTS_BY_DOC)):
        assert cached(second)[3 * doc] >= FULL_DOC_TOKENS
    counters = runs["guide"]["counters"]
    assert counters["vllm:kv_offload_store_bytes"] > 0
    assert counters["vllm:kv_offload_load_bytes"] > 0


def test_blocks_evicted_from_a_small_device_cache_come_back_from_cpu(runs, reference):
    result = runs["small_device"]
    assert token_ids(result["phases"][0]) == reference
    assert token_ids(result["phases"][1]) == reference[:3]
    # Document 0 was evicted from the device by documents 1 and 2.
    assert cached(result["phases"][1])[0] >= FULL_DOC_TOKENS
    assert result["counters"]["vllm:kv_offload_load_bytes"] > 0


def test_cpu_pool_smaller_than_working_set_evicts_least_recently_used(
    runs, first_answers
):
    *stores, again = runs["small_cpu"]["phases"]
    assert [token_ids(phase)[0] for phase in stores] == first_answers
    assert token_ids(again) == first_answers[::-1]
    assert cached(again)[0] >= FULL_DOC_TOKENS
    assert cached(again)[1] >= FULL_DOC_TOKENS
    # Which of document 0's blocks survive is vLLM's LRU policy. From 0.31 it
    # ranks a request's leading blocks as most recent (a prefix is the
    # likeliest to be reused), so document 0 keeps only its first block; 0.30
    # ranks blocks by when they were stored, so the first block goes first
    # and nothing of the prefix is left to hit.
    assert cached(again)[2] == (128 if VLLM_VERSION >= (0, 31) else 0)


def test_negative_control_corrupted_loads_change_the_output(runs, reference):
    result = runs["corrupting"]
    # Stores are untouched: the first pass still matches.
    assert token_ids(result["phases"][0]) == reference
    second = result["phases"][1]
    assert all(c >= FULL_DOC_TOKENS for c in cached(second)[::3])
    # The same lookups as the guide run, but wrong bytes: outputs diverge.
    assert token_ids(second) != reference


def test_ascend_tuple_layout_runs_end_to_end(runs, reference):
    """Layers registered as unequal (part0, part1) tuples, as on Ascend."""
    result = runs["tuple_layout"]
    assert token_ids(result["phases"][0]) == reference[:3]
    assert token_ids(result["phases"][1]) == reference[:3]
    assert cached(result["phases"][1])[0] >= FULL_DOC_TOKENS
