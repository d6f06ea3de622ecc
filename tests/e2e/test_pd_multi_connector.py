"""P/D disaggregation beside offloading, through vLLM's MultiConnector (CPU).

Ascend production serving pairs a P/D connector (Mooncake) with a KV store in
one ``MultiConnector``. Here the P/D connector is vLLM's ``ExampleConnector``
(KV files in a shared directory), which runs on vLLM's CPU backend; Mooncake
itself needs NPUs and RDMA. Each engine's MultiConnector holds the P/D
connector first and the guide's offloading connector second (spec
``NPUOffloadingSpec``). Three engines run in-process, one after the other in
one process (``run_scenario`` with ``pd_driver.py``): a producer; a consumer
whose first CPU loads fail (injected); a consumer whose P/D loads fail. What
ran: vLLM 0.32's CPU backend; nothing on an NPU.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import (
    FIRST_PROMPTS,
    FULL_DOC_TOKENS,
    GUIDE_OFFLOAD,
    cached,
    in_process,
    injected_faults,
    run_sequence,
    scenario_log,
    token_ids,
    with_faults,
)

pytestmark = pytest.mark.e2e

LOAD_BYTES = "vllm:kv_offload_load_bytes"
STORE_BYTES = "vllm:kv_offload_store_bytes"
# A P/D load that fails in the stand-in (its KV file gone): logged per request.
PD_LOAD_FAILED = "P/D stand-in: load failed"


def after(pd_storage: str, reset: bool = True) -> dict:
    """FIRST_PROMPTS once ``pd_storage`` was done (pd_driver.change_storage),
    the device prefix cache reset first unless ``reset`` is false."""
    return {
        "prompts": FIRST_PROMPTS,
        "pd_storage": pd_storage,
        "reset_prefix_cache": reset,
    }


@pytest.fixture(scope="module")
def pd_run(scenario_dir) -> dict:
    """Per engine, per phase: the requests' ``results`` and the ``counters``
    after the phase; the faults injected; the whole log."""
    pd = {
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {
            "shared_storage_path": str(scenario_dir / "pd_storage")
        },
    }
    engines = {
        "producer": {
            "role": "producer",
            "offload": GUIDE_OFFLOAD,
            "phases": [{"prompts": FIRST_PROMPTS}],
        },
        # The guide's config with test-only fault injection: the first three
        # CPU->device loads fail.
        "consumer": with_faults(
            scenario_dir,
            "pd_offload",
            "load:1:3",
            role="consumer",
            kv_load_failure_policy="recompute",
            phases=[
                {"prompts": FIRST_PROMPTS},  # the producer's KV, through P/D
                after("hide"),  # P/D has nothing now; every CPU load fails
                after("clear"),  # the CPU copies serve
            ],
        ),
        "failing_pd": {
            "role": "consumer",
            # Reports its failed loads as Mooncake does (pd_connectors.py).
            "pd": dict(
                pd,
                kv_connector="ReportingExampleConnector",
                kv_connector_module_path="tests.e2e.pd_connectors",
            ),
            "offload": GUIDE_OFFLOAD,
            "kv_load_failure_policy": "recompute",
            "phases": [
                # Every P/D load fails: a KV file is gone.
                after("restore_without_a_layer", reset=False),
                # P/D has nothing: what the CPU holds now may serve.
                after("hide"),
                after("clear"),
            ],
        },
    }
    engines = {name: in_process({"pd": pd, **e}) for name, e in engines.items()}
    runs: dict = {}
    for name, run in run_sequence(scenario_dir, "pd_multi_connector", engines).items():
        phases = zip(run["phases"], run["phase_counters"], strict=True)
        runs[name] = [{"results": r, "counters": c} for r, c in phases]
    runs["injected"] = injected_faults(scenario_dir, "pd_offload")
    runs["log"] = scenario_log(scenario_dir, "pd_multi_connector")
    return runs


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
