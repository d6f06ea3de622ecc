"""P/D disaggregation beside offloading, through vLLM's MultiConnector (CPU).

Ascend production serving pairs a P/D connector (Mooncake) with a KV store in
one ``MultiConnector``. Here the P/D connector is vLLM's ``ExampleConnector``
(KV files in a shared directory), which runs on vLLM's CPU backend; Mooncake
itself needs NPUs and RDMA. Each engine's MultiConnector holds the P/D
connector first and the guide's offloading connector second (spec
``NPUOffloadingSpec``). Three engines run in-process, one after the other in
one process (``pd_driver.py``): a producer; a consumer whose first CPU loads fail
(injected); a consumer whose P/D loads fail. What ran: vLLM 0.32's CPU
backend; nothing on an NPU.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import (
    ENGINE,
    FAULTY_OFFLOAD,
    FIRST_PROMPTS,
    FULL_DOC_TOKENS,
    GUIDE_OFFLOAD,
    cached,
    in_process,
    run_scenario,
    scenario_log,
    token_ids,
)

pytestmark = pytest.mark.e2e

LOAD_BYTES = "vllm:kv_offload_load_bytes"
STORE_BYTES = "vllm:kv_offload_store_bytes"
# A P/D load that fails in the stand-in (its KV file gone): logged per request.
PD_LOAD_FAILED = "P/D stand-in: load failed"


@pytest.fixture(scope="module")
def pd_run(scenario_dir) -> dict:
    storage = scenario_dir / "pd_storage"
    faults_log = scenario_dir / "pd_offload.faults"
    scenario = {
        "driver": "tests.e2e.pd_driver:run",
        "engine": ENGINE,
        "pd": {
            "kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        },
        "engines": [
            {
                "name": "producer",
                "role": "producer",
                "offload": GUIDE_OFFLOAD,
                "phases": [{"prompts": FIRST_PROMPTS}],
            },
            {
                "name": "consumer",
                "role": "consumer",
                # The guide's config with test-only fault injection: the
                # first three CPU->device loads fail.
                "offload": FAULTY_OFFLOAD,
                "env": {
                    "VLLM_ASCEND_KV_OFFLOAD_FAULTS": "load:1:3",
                    "VLLM_ASCEND_KV_OFFLOAD_FAULTS_LOG": str(faults_log),
                },
                "kv_load_failure_policy": "recompute",
                "phases": [
                    {"prompts": FIRST_PROMPTS},  # the producer's KV, through P/D
                    {  # P/D has nothing now; every CPU load fails (injected)
                        "prompts": FIRST_PROMPTS,
                        "pd_storage": "hide",
                        "reset_prefix_cache": True,
                    },
                    {  # the CPU copies serve
                        "prompts": FIRST_PROMPTS,
                        "pd_storage": "clear",
                        "reset_prefix_cache": True,
                    },
                ],
            },
            {
                "name": "failing_pd",
                "role": "consumer",
                # Reports its failed loads as Mooncake does (pd_connectors.py).
                "pd": {
                    "kv_connector": "ReportingExampleConnector",
                    "kv_connector_module_path": "tests.e2e.pd_connectors",
                },
                "offload": GUIDE_OFFLOAD,
                "kv_load_failure_policy": "recompute",
                "phases": [
                    # Every P/D load fails: a KV file is gone.
                    {"prompts": FIRST_PROMPTS, "pd_storage": "restore_without_a_layer"},
                    # P/D has nothing: what the CPU holds now may serve.
                    {
                        "prompts": FIRST_PROMPTS,
                        "pd_storage": "hide",
                        "reset_prefix_cache": True,
                    },
                    {
                        "prompts": FIRST_PROMPTS,
                        "pd_storage": "clear",
                        "reset_prefix_cache": True,
                    },
                ],
            },
        ],
    }
    result = run_scenario(scenario_dir, "pd_multi_connector", in_process(scenario))
    injected = faults_log.read_text().split("\n")[:-1] if faults_log.exists() else []
    result["injected"] = injected
    result["log"] = scenario_log(scenario_dir, "pd_multi_connector")
    return result


def grew(before: dict, after: dict, counter: str) -> float:
    return after["counters"].get(counter, 0.0) - before["counters"].get(counter, 0.0)


def test_producer_outputs_equal_a_plain_run_and_it_offloads(pd_run, first_answers):
    (phase,) = pd_run["producer"]
    assert token_ids(phase) == first_answers
    assert phase["counters"].get(STORE_BYTES, 0) > 0


def test_consumer_takes_the_prefill_through_the_pd_connector(pd_run, first_answers):
    pd_phase = pd_run["consumer"][0]
    assert token_ids(pd_phase) == first_answers
    # Each prompt's full blocks came from the producer, not the CPU pool ...
    assert all(n >= FULL_DOC_TOKENS for n in cached(pd_phase))
    assert pd_phase["counters"].get(LOAD_BYTES, 0) == 0
    # ... and the offloading connector beside it stored them to the CPU.
    assert pd_phase["counters"].get(STORE_BYTES, 0) > 0


def test_failed_offloading_loads_are_recomputed(pd_run, first_answers):
    pd_phase, failed_cpu, _ = pd_run["consumer"]
    assert [line.split()[0] for line in pd_run["injected"]] == ["load"] * 3
    assert token_ids(failed_cpu) == first_answers
    # Recomputed, not served from a cache.
    assert cached(failed_cpu) == [0] * len(FIRST_PROMPTS)
    assert grew(pd_phase, failed_cpu, LOAD_BYTES) == 0


def test_consumer_serves_cpu_hits_when_the_pd_connector_has_nothing(
    pd_run, first_answers
):
    pd_phase, failed_cpu, cpu_phase = pd_run["consumer"]
    assert token_ids(cpu_phase) == first_answers
    assert all(n >= FULL_DOC_TOKENS for n in cached(cpu_phase))
    # Every block stored in the P/D phase came back from the CPU.
    stored = pd_phase["counters"][STORE_BYTES]
    assert grew(failed_cpu, cpu_phase, LOAD_BYTES) == stored


def test_failed_pd_loads_are_recomputed_and_never_offloaded(pd_run, first_answers):
    """The store issued with a failed P/D load copies what the load left in
    the device blocks; before the fix, that came back as CPU hits here with
    wrong outputs (FailureRouter.invalidate_blocks)."""
    failed_pd, after, cpu_hits = pd_run["failing_pd"]
    assert pd_run["log"].count(PD_LOAD_FAILED) == len(FIRST_PROMPTS)
    assert token_ids(failed_pd) == first_answers
    # Nothing of the failed loads is in the CPU pool ...
    assert token_ids(after) == first_answers
    assert cached(after) == [0] * len(FIRST_PROMPTS)
    assert grew(failed_pd, after, LOAD_BYTES) == 0
    # ... and the recomputed KV, stored then, serves.
    assert all(n >= FULL_DOC_TOKENS for n in cached(cpu_hits))
    assert grew(after, cpu_hits, LOAD_BYTES) > 0
    assert token_ids(cpu_hits) == first_answers
