"""vLLM 0.33's synchronous loads, run with vLLM 0.33's offloading code.

With ``sync_load_budget_bytes`` > 0, vLLM 0.33 loads a small enough CPU hit
within the step that computes the request: the load is submitted
``expedited``, the step waits for it before its forward pass, and the request
never waits for remote KV. Ours runs such loads on a queue of their own
(``expedited_load`` faults hit only them), and a failed one is reported as
failed blocks of a running request: vLLM drops that step's output for the
request and recomputes. Outputs must equal offloading off in every case.

vLLM 0.33 has no CPU build: these run its offloading packages over the
installed 0.32 core (``tests/vllm033/overlay.py``), in-process engines, one
after the other in one process per offloading code (``runs_033``,
``runs_installed``).
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import (
    FIRST_QUESTIONS,
    FULL_DOC_TOKENS,
    GUIDE_OFFLOAD,
    IN_PROCESS_ENV,
    PREEMPTING_ENGINE,
    TWICE,
    cached,
    in_process,
    injected_faults,
    run_sequence,
    tiering,
    token_ids,
    with_faults,
)

pytestmark = pytest.mark.e2e

# A 512-token prefix of the tiny model is 512 KiB of KV; 16 MiB takes all.
SYNC = {"sync_load_budget_bytes": 16 * 2**20}


def sync_scenario(scenario_dir, name: str, faults: str | None = None, **scenario):
    """All prompts twice through the guide's config with synchronous loads
    (the fault-injecting spec with ``faults``, logged to ``<name>.faults``)."""
    if faults:
        scenario = with_faults(scenario_dir, name, faults, **scenario)
    scenario = {"phases": TWICE, "offload": GUIDE_OFFLOAD, **scenario}
    return in_process(dict(scenario, offload=dict(scenario["offload"], **SYNC)))


def sync_scenarios(scenario_dir) -> dict[str, dict]:
    return {
        "sync_loads": sync_scenario(scenario_dir, "sync_loads"),
        "sync_load_faults": sync_scenario(
            scenario_dir,
            "sync_load_faults",
            faults="expedited_load:1,expedited_load_submit:0.5,seed:3",
            kv_load_failure_policy="recompute",
        ),
        # A connector that does not report the failed sync loads' blocks.
        "sync_load_faults_unreported": sync_scenario(
            scenario_dir,
            "sync_load_faults_unreported",
            faults="expedited_load:1",
            kv_load_failure_policy="recompute",
            connector="IgnoresFailedLoads",
            connector_module_path="tests.e2e.test_failures",
        ),
    }


def run_sync(runs_033, scenario_dir, name: str) -> tuple[dict, list[str]]:
    result = runs_033[name]
    assert result["offloading_overlay"] == "0.33.0"
    return result, injected_faults(scenario_dir, name)


def test_sync_loads_serve_cpu_hits_with_identical_outputs(
    runs_033, scenario_dir, reference
):
    result, _ = run_sync(runs_033, scenario_dir, "sync_loads")
    first, second = result["phases"]
    assert token_ids(first) == reference
    assert token_ids(second) == reference
    assert all(cached(second)[i] >= FULL_DOC_TOKENS for i in FIRST_QUESTIONS)
    assert result["counters"]["vllm:kv_offload_load_bytes"] > 0


def test_failed_sync_loads_are_recomputed_and_the_engine_serves_on(
    runs_033, scenario_dir, reference
):
    result, injected = run_sync(runs_033, scenario_dir, "sync_load_faults")
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
    runs_033, scenario_dir, reference
):
    """The comparison above can fail: a connector that does not report the
    failed sync loads' blocks lets vLLM use what they left behind."""
    result, injected = run_sync(runs_033, scenario_dir, "sync_load_faults_unreported")
    assert injected
    assert token_ids(result["phases"][1]) != reference


# -- some sync loads failing, under preemption: a differential test ---------
#
# 24 batched requests of 4-block documents (6 documents, 4 questions each; a
# quarter of the questions fill a fifth block) into 16 device blocks for 8
# running requests: vLLM preempts all the time, and a document's first
# question loads it from the CPU synchronously while the others hit the
# blocks it loads through the device prefix cache. One engine per
# configuration runs every seed: two rounds each (all requests, then again
# after a device prefix-cache reset), faults drawn anew per seed.

BATCH_TOKENS = 40
# Each prompt ends a little before a block boundary (plus a BOS token), so
# decoding needs one more block soon: with the device cache full, vLLM
# preempts. The third question fills a block after its document's four.
QUESTION_WORDS = [110, 110, 240, 110]
SEEDS = [1, 2, 3]


def batch_prompts() -> list[str]:
    from vllm_ascend.kv_offload.testing.tiny_model import make_prompt

    docs = [make_prompt(512, seed=700 + d) for d in range(6)]
    return [
        f"{docs[d]} {make_prompt(QUESTION_WORDS[q], seed=7000 + 10 * d + q)}"
        for q in range(4)
        for d in range(6)
    ]


def drive_batches(scenario: dict) -> dict:
    """Per seed: the batched requests twice, with the faults of
    ``scenario["faults"]`` (test-only injection) drawn from that seed."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from tests.e2e.run_scenario import (
        kv_transfer_config,
        metric_totals,
        request_record,
    )
    from tests.fault_injection import FaultInjector, inject_faults
    from vllm_ascend.kv_offload.testing import engine
    from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model

    llm = engine.start(
        ensure_tiny_model(), kv_transfer_config(scenario), **scenario["engine"]
    )
    worker = None
    if scenario.get("offload") is not None:
        worker = get_kv_transfer_group().connector_worker.worker
    prompts = batch_prompts()
    params = SamplingParams(max_tokens=BATCH_TOKENS, temperature=0.0, ignore_eos=True)
    rounds, injected = [], 0
    for seed in scenario.get("seeds", [0]):
        faults = None
        if scenario.get("faults"):
            faults = FaultInjector.parse(f"{scenario['faults']},seed:{seed}")
        if worker is not None:
            inject_faults(worker, faults)
        for _ in range(scenario.get("rounds", 2)):
            outputs = llm.generate(prompts, params, use_tqdm=False)
            rounds.append([request_record(o) for o in outputs])
            if worker is not None:
                engine.settle(llm)
            assert llm.reset_prefix_cache()
        injected += len(faults.injected) if faults else 0
    result = {
        "rounds": rounds,
        "counters": metric_totals(llm),
        "injected": injected,
        "async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,  # noqa: E501
    }
    engine.shutdown(llm)  # the next engine of the sequence starts after it
    return result


def batch_scenario(offload, **scenario) -> dict:
    return {
        "driver": "tests.e2e.test_sync_loads:drive_batches",
        "engine": PREEMPTING_ENGINE,
        "offload": offload,
        "env": IN_PROCESS_ENV,
        "kv_load_failure_policy": "recompute",
        **scenario,
    }


def differing(result: dict, reference: list[list[int]]) -> list[tuple[int, int]]:
    """(round, request) of every output that differs from offloading off."""
    return [
        (r, i)
        for r, outputs in enumerate(result["rounds"])
        for i, out in enumerate(outputs)
        if out["token_ids"] != reference[i]
    ]


EVERY_KIND = (
    "expedited_load:0.1,expedited_load_submit:0.05,load:0.1,load_submit:0.05,"
    "store:0.1,store_submit:0.05"
)
# id: (tiered, faults, on vLLM 0.33's offloading code)
BATCH_CASES = {
    "cpu-only": (False, "expedited_load:0.2", True),
    "tiering": (True, "expedited_load:0.2", True),
    "every-kind": (False, EVERY_KIND, True),
    # vLLM 0.32's own offloading code: async loads only.
    "vllm-0.32-async-every-kind": (False, EVERY_KIND, False),
}


def batch_cases(scenario_dir, overlay: bool) -> dict[str, dict]:
    """The batched scenarios on one offloading code, by case id."""
    out = {}
    for case, (tiered, faults, on_033) in BATCH_CASES.items():
        if on_033 != overlay:
            continue
        offload = dict(GUIDE_OFFLOAD, num_cpu_blocks=64)
        if tiered:
            root = scenario_dir / "sync_tier"
            root.mkdir(exist_ok=True)
            # vLLM's default of 16 writer threads.
            offload = tiering(str(root), write_threads=16, num_cpu_blocks=12)
        if on_033:
            offload.update(SYNC)
        out[case] = batch_scenario(offload, faults=faults, seeds=SEEDS)
    return out


# Six rounds of 24 batched requests per engine: minutes on a loaded machine.
BATCH_TIMEOUT_S = 1800


@pytest.fixture(scope="module")
def runs_033(scenario_dir) -> dict[str, dict]:
    """Every engine on vLLM 0.33's offloading code, by name: the sync-load
    scenarios, then the batched ones."""
    from tests.vllm033.overlay import overlay_dir, skip_unless_core_supported

    skip_unless_core_supported()
    scenarios = {**sync_scenarios(scenario_dir), **batch_cases(scenario_dir, True)}
    return run_sequence(
        scenario_dir,
        "sync_loads_0.33",
        scenarios,
        pythonpath=[str(overlay_dir())],
        timeout_s=3 * BATCH_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def runs_installed(scenario_dir) -> dict[str, dict]:
    """The batched requests with offloading off (``reference``), then the
    batched scenarios on the installed vLLM's offloading code."""
    scenarios = {
        "reference": batch_scenario(None, rounds=1),
        **batch_cases(scenario_dir, False),
    }
    name = "sync_loads_installed"
    return run_sequence(scenario_dir, name, scenarios, timeout_s=2 * BATCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def batch_reference(runs_installed) -> list[list[int]]:
    return [r["token_ids"] for r in runs_installed["reference"]["rounds"][0]]


@pytest.mark.parametrize("case", list(BATCH_CASES))
def test_some_failed_loads_under_preemption_change_no_output(
    request, batch_reference, case
):
    """1 in 48 outputs differed before the fix (docs/robustness.md, "Failed
    synchronous loads"); 3 seeds x 2 rounds x 24 requests per engine."""
    on_033 = BATCH_CASES[case][2]
    runs = request.getfixturevalue("runs_033" if on_033 else "runs_installed")
    result = runs[case]
    assert result["injected"] >= len(SEEDS)
    assert result["counters"]["vllm:num_preemptions"] > 0
    assert result["counters"]["vllm:kv_offload_load_bytes"] > 0
    assert differing(result, batch_reference) == []
