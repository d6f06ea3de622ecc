"""Compiled mode: the guide scenario without ``enforce_eager``.

Ascend serves in graph mode by default; every other e2e test runs eager. Here
both engines (offloading off, and the guide's offloading config) leave
compilation to vLLM's CPU backend, which compiles the forward with
torch.compile: Dynamo traces it once (``DYNAMO_TRACE_ONCE``) and inductor
compiles the graph, with attention (and inside it the connector's per-layer
hooks) as an opaque custom op. Greedy outputs with offloading on must equal
those with offloading off, both compiled, on a cold pass with device hits and
after a prefix-cache reset (CPU hits). This ran on vLLM's CPU backend only; it
says nothing measured about ACL graph capture on an NPU (docs/ascend_layouts.md,
"Graph mode").
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import (
    ENGINE,
    FULL_DOC_TOKENS,
    GUIDE_OFFLOAD,
    PROMPTS_BY_DOC,
    cached,
    in_process,
    run_sequence,
    scenario_log,
    token_ids,
)

pytestmark = pytest.mark.e2e

COMPILED_ENGINE = {k: v for k, v in ENGINE.items() if k != "enforce_eager"}
# One document of 4 full 128-token blocks and three questions on it: the first
# is a cold prefill, the other two hit the device cache, and after a reset all
# three load the document from the CPU.
PROMPTS = PROMPTS_BY_DOC[0]


# vLLM 0.32's AOT artifacts do not load back on the CPU backend ("Compiling
# model again due to a load failure ... 'function' object has no attribute
# 'finalize_loading'"), so every engine compiled from scratch. Without AOT,
# inductor's FX graph cache (TORCHINDUCTOR_CACHE_DIR, by default under /tmp)
# serves the second engine, and later runs, the kernels compiled before:
# the same Dynamo trace and inductor graph, compiled once. Each engine is
# started anew in the sequence (``runs``), so each compiles (or loads) its
# own graph.
COMPILE_ENV = {"VLLM_USE_AOT_COMPILE": "0"}


@pytest.fixture(scope="module")
def runs(scenario_dir) -> dict[str, dict]:
    """Offloading off, then the guide's config (compiled with the cache
    warm), in-process, one after the other in one process."""
    scenarios = {
        "compiled_reference": {
            "engine": COMPILED_ENGINE,
            "offload": None,
            "phases": [{"prompts": PROMPTS}],
        },
        "compiled_guide": {
            "engine": COMPILED_ENGINE,
            "offload": GUIDE_OFFLOAD,
            "phases": [
                {"prompts": PROMPTS},
                {"prompts": PROMPTS, "reset_prefix_cache": True},
            ],
        },
    }
    scenarios = {name: in_process(s) for name, s in scenarios.items()}
    return run_sequence(scenario_dir, "compiled", scenarios, env=COMPILE_ENV)


@pytest.mark.parametrize("name", ["compiled_reference", "compiled_guide"])
def test_both_engines_run_a_compiled_forward(runs, scenario_dir, name):
    assert runs[name]["compilation"] == {
        "mode": "DYNAMO_TRACE_ONCE",
        "backend": "inductor",
    }
    # The CPU runner warms up (compiles) the model only when it is compiled:
    # once per engine of the sequence.
    log = scenario_log(scenario_dir, "compiled")
    assert log.count("Warming up done.") == len(runs)


def test_compiled_outputs_with_offloading_equal_outputs_without(runs):
    reference = token_ids(runs["compiled_reference"]["phases"][0])
    first = runs["compiled_guide"]["phases"][0]
    assert token_ids(first) == reference
    # Cold, then two device-cache hits on the document's 4 blocks.
    assert cached(first)[0] == 0
    assert all(c >= FULL_DOC_TOKENS for c in cached(first)[1:])


def test_compiled_engine_serves_cpu_hits_after_a_prefix_cache_reset(runs):
    again = runs["compiled_guide"]["phases"][1]
    assert token_ids(again) == token_ids(runs["compiled_reference"]["phases"][0])
    # The device cache was emptied: the document came back from the CPU.
    assert all(c >= FULL_DOC_TOKENS for c in cached(again))
    counters = runs["compiled_guide"]["counters"]
    assert counters["vllm:kv_offload_store_bytes"] > 0
    assert counters["vllm:kv_offload_load_bytes"] > 0
