"""vLLM 0.33's synchronous loads, run with vLLM 0.33's offloading code.

With ``sync_load_budget_bytes`` > 0, vLLM 0.33 loads a small enough CPU hit
within the step that computes the request: the load is submitted
``expedited``, the step waits for it before its forward pass, and the request
never waits for remote KV. Ours runs such loads on a queue of their own
(``expedited_load`` faults hit only them), and a failed one is reported as
failed blocks of a running request: vLLM drops that step's output for the
request and recomputes. Outputs must equal offloading off in every case.

vLLM 0.33 has no CPU build: these run its offloading packages over the
installed 0.32 core (``tests/vllm033/overlay.py``), in-process engines.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import (
    ALL_PROMPTS,
    ENGINE,
    FAULTY_OFFLOAD,
    GUIDE_OFFLOAD,
    cached,
    run_scenario,
    token_ids,
)

pytestmark = pytest.mark.e2e

FULL_DOC_TOKENS = 512
FIRST_QUESTIONS = [0, 3, 6]
# A 512-token prefix of the tiny model is 512 KiB of KV; 16 MiB takes all.
SYNC = {"sync_load_budget_bytes": 16 * 2**20}
TWICE = [
    {"prompts": ALL_PROMPTS},
    {"prompts": ALL_PROMPTS, "reset_prefix_cache": True},
]


def run_sync(scenario_dir, name: str, faults: str | None = None, **scenario):
    from tests.vllm033.overlay import overlay_dir, skip_unless_core_supported

    skip_unless_core_supported()
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    fault_log = scenario_dir / f"{name}.faults"
    if faults:
        env["VLLM_ASCEND_KV_OFFLOAD_FAULTS"] = faults
        env["VLLM_ASCEND_KV_OFFLOAD_FAULTS_LOG"] = str(fault_log)
    result = run_scenario(
        scenario_dir,
        name,
        {
            "pythonpath": [str(overlay_dir())],
            "engine": dict(ENGINE, distributed_executor_backend="uni"),
            "offload": dict(FAULTY_OFFLOAD if faults else GUIDE_OFFLOAD, **SYNC),
            "phases": TWICE,
            "env": env,
            **scenario,
        },
    )
    assert result["offloading_overlay"] == "0.33.0"
    injected = fault_log.read_text().split("\n")[:-1] if fault_log.exists() else []
    return result, injected


def test_sync_loads_serve_cpu_hits_with_identical_outputs(scenario_dir, reference):
    result, _ = run_sync(scenario_dir, "sync_loads")
    first, second = result["phases"]
    assert token_ids(first) == reference
    assert token_ids(second) == reference
    assert all(cached(second)[i] >= FULL_DOC_TOKENS for i in FIRST_QUESTIONS)
    assert result["counters"]["vllm:kv_offload_load_bytes"] > 0


def test_failed_sync_loads_are_recomputed_and_the_engine_serves_on(
    scenario_dir, reference
):
    result, injected = run_sync(
        scenario_dir,
        "sync_load_faults",
        faults="expedited_load:1,expedited_load_submit:0.5,seed:3",
        kv_load_failure_policy="recompute",
    )
    # Loads really went the synchronous (expedited) way, and all failed.
    assert injected
    assert {line.split()[0] for line in injected} <= {
        "expedited_load",
        "expedited_load_submit",
    }
    first, second = result["phases"]
    assert token_ids(first) == reference
    assert token_ids(second) == reference
    # Nothing wrong was loaded: no load bytes counted, all recomputed.
    assert result["counters"].get("vllm:kv_offload_load_bytes", 0) == 0


def test_negative_control_unreported_sync_load_failures_change_the_output(
    scenario_dir, reference
):
    """The comparison above can fail: a connector that does not report the
    failed sync loads' blocks lets vLLM use what they left behind."""
    result, injected = run_sync(
        scenario_dir,
        "sync_load_faults_unreported",
        faults="expedited_load:1",
        kv_load_failure_policy="recompute",
        connector="IgnoresFailedLoads",
        connector_module_path="tests.e2e.test_failures",
    )
    assert injected
    assert token_ids(result["phases"][1]) != reference
