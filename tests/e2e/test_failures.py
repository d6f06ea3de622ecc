"""Failed transfers on a real engine (CPU backend): never wrong, never a crash.

Faults are injected by the test-only spec of ``tests/fault_injection.py``
(``VLLM_ASCEND_KV_OFFLOAD_FAULTS``): a failing copy first overwrites
its destination with garbage, so KV from a failed transfer that got used
would change the greedy output. Every scenario compares against the same
prompts with offloading off (the ``reference`` fixture); two negative
controls show that these comparisons do catch failures that are not handled.

The engines run one after the other in one process (``runs``), most of them
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``uni`` executor: three
times faster to start); the first runs vLLM's default process layout, so the
failure metadata also crosses the worker -> scheduler process boundary.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import (
    ALL_PROMPTS,
    ENGINE,
    FAULTY_OFFLOAD,
    FIRST_QUESTIONS,
    FULL_DOC_TOKENS,
    GUIDE_OFFLOAD,
    TWICE,
    cached,
    in_process,
    injected_faults,
    run_sequence,
    scenario_log,
    token_ids,
    with_faults,
)
from vllm_ascend.kv_offload.connector import AscendOffloadingConnector

pytestmark = pytest.mark.e2e

# Negative controls: connectors that do not handle one kind of failure
# (defined below).
NEGATIVE = [("IgnoresFailedStores", "store:1"), ("IgnoresFailedLoads", "load:1")]


def in_process_scenarios(scenario_dir) -> dict[str, dict]:
    """The in-process scenarios of this module, by name."""
    scenarios = {
        # Submit-time failures ("load_submit", "store_submit") take the same
        # reporting path; tests/unit/test_worker_state_machine.py covers them
        # without an engine.
        "failed_load": with_faults(
            scenario_dir, "failed_load", "load:1", kv_load_failure_policy="recompute"
        ),
        "failed_load_policy_fail": with_faults(
            scenario_dir,
            "failed_load_policy_fail",
            "load:1:1",  # only the first load fails
            phases=[*TWICE, {"prompts": ALL_PROMPTS}],
            kv_load_failure_policy="fail",  # vLLM's default
        ),
        "failed_store": with_faults(scenario_dir, "failed_store", "store:1"),
    }
    for connector, faults in NEGATIVE:
        scenarios[f"negative_{connector}"] = with_faults(
            scenario_dir,
            f"negative_{connector}",
            faults,
            connector=connector,
            connector_module_path="tests.e2e.test_failures",
            kv_load_failure_policy="recompute",
        )
    return {name: in_process(s) for name, s in scenarios.items()}


MULTIPROCESS = "random_faults_multiprocess"
# An oversized pool (the start-up test below): last in the sequence, its
# engine is refused.
REFUSED_BLOCKS = 10**9
REFUSED = f"start_up_{REFUSED_BLOCKS}_blocks"


def multiprocess_scenario(scenario_dir) -> dict:
    """test_random_faults_with_eviction_in_a_multiprocess_engine's engine."""
    return with_faults(
        scenario_dir,
        MULTIPROCESS,
        "load:0.3,store:0.3,load_submit:0.1,store_submit:0.1,seed:5",
        phases=[*TWICE, {"prompts": ALL_PROMPTS[::-1]}],
        engine=dict(ENGINE, max_model_len=1024, num_gpu_blocks_override=10),
        offload=dict(FAULTY_OFFLOAD, num_cpu_blocks=9),
        kv_load_failure_policy="recompute",
    )


@pytest.fixture(scope="module")
def runs(scenario_dir) -> dict[str, tuple[dict, list[str]]]:
    """Each scenario's result and the faults it injected: the default-layout
    one first (an in-process engine core caches vLLM's environment
    variables in this process, VLLM_ENABLE_V1_MULTIPROCESSING included),
    then the in-process ones, all in one process; the refused engine last
    (nothing has to start after it)."""
    refused = {
        "offload": dict(GUIDE_OFFLOAD, num_cpu_blocks=REFUSED_BLOCKS),
        "phases": [{"prompts": ALL_PROMPTS[:1]}],
        "expect_error": True,
    }
    scenarios = {
        MULTIPROCESS: multiprocess_scenario(scenario_dir),
        **in_process_scenarios(scenario_dir),
        REFUSED: in_process(refused),
    }
    # Seven engine starts: the time two processes had (600 s each).
    runs = run_sequence(scenario_dir, "failures", scenarios, timeout_s=1200)
    return {
        name: (run, injected_faults(scenario_dir, name)) for name, run in runs.items()
    }


def kinds(injected: list[str]) -> set[str]:
    return {line.split()[0] for line in injected}


def test_failed_loads_are_recomputed(runs, reference):
    result, injected = runs["failed_load"]
    # Every load failed (one per document; the other questions then hit the
    # recomputed blocks on the device), yet every output is right.
    assert kinds(injected) == {"load"} and len(injected) >= 3
    assert token_ids(result["phases"][0]) == reference
    assert token_ids(result["phases"][1]) == reference
    assert result["counters"].get("vllm:kv_offload_load_bytes", 0) == 0
    # /metrics counts each failed load job (one worker: one per fault).
    assert result["counters"]["vllm:kv_offload_failed_loads"] == len(injected)


def test_failed_load_fails_only_its_request_and_the_engine_serves_on(runs, reference):
    result, injected = runs["failed_load_policy_fail"]
    assert injected == [injected[0]] and injected[0].startswith("load ")
    first, second, third = result["phases"]
    assert token_ids(first) == reference
    # The request whose load failed ended with an error and no tokens ...
    assert second[0]["finish_reason"] == "error"
    assert second[0]["token_ids"] == []
    # ... every other request, then and after, was served correctly.
    assert token_ids(second)[1:] == reference[1:]
    assert all(r["finish_reason"] == "length" for r in second[1:])
    assert token_ids(third) == reference


def test_failed_stores_are_never_loaded(runs, reference):
    result, injected = runs["failed_store"]
    assert kinds(injected) == {"store"} and len(injected) >= 3
    first, second = result["phases"]
    assert token_ids(first) == reference
    assert token_ids(second) == reference
    # Nothing was recorded in the CPU cache, so nothing came back from it.
    assert [cached(second)[i] for i in FIRST_QUESTIONS] == [0, 0, 0]
    assert result["counters"].get("vllm:kv_offload_load_bytes", 0) == 0
    # /metrics counts the failed store jobs (the last may not have been
    # reported yet when the counters were read).
    assert 3 <= result["counters"]["vllm:kv_offload_failed_stores"] <= len(injected)


def test_random_faults_with_eviction_in_a_multiprocess_engine(runs, reference):
    """vLLM's default process layout, a small device cache and a small CPU
    pool (constant eviction), and faults of every kind."""
    result, injected = runs[MULTIPROCESS]
    assert len(injected) >= 3
    first, second, third = result["phases"]
    assert token_ids(first) == reference
    assert token_ids(second) == reference
    assert token_ids(third) == reference[::-1]


# -- negative controls: connectors that do not handle one kind of failure --


class IgnoresFailedStores(AscendOffloadingConnector):
    """Records failed stores as stored, as vLLM's connector would: the
    scheduler side never hears which jobs failed."""

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if meta is not None and hasattr(meta, "failed_jobs"):
            meta.failed_jobs = set()
        super().update_connector_output(connector_output)


class IgnoresFailedLoads(AscendOffloadingConnector):
    """Reports no failed load blocks: vLLM uses what the failed load left."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        super().get_block_ids_with_load_errors()
        return set()


@pytest.mark.parametrize("connector", [connector for connector, _ in NEGATIVE])
def test_negative_control_unhandled_failures_change_the_output(
    runs, reference, connector
):
    result, injected = runs[f"negative_{connector}"]
    assert injected
    second = result["phases"][1]
    # The same CPU hits as a healthy run, but the KV is garbage.
    assert all(cached(second)[i] >= FULL_DOC_TOKENS for i in FIRST_QUESTIONS)
    assert token_ids(second) != reference


# -- start-up: an oversized pool fails with one error, before it exists -----


@pytest.mark.parametrize(
    "num_cpu_blocks, allocated",
    [
        # Every engine of ``runs`` but the last: the fault-injecting guide config.
        (FAULTY_OFFLOAD["num_cpu_blocks"], True),
        # One engine start per bad value is costly; the other bad values are
        # covered by tests/unit/test_config_validation.py and
        # tests/unit/test_host_memory_guard.py.
        (REFUSED_BLOCKS, False),
    ],
)
def test_start_up_logs_the_pool_exactly_when_it_allocates_one(
    runs, scenario_dir, num_cpu_blocks, allocated
):
    """In-process engines log through vLLM's logger like the others, so the
    pool's start-up line is in the log when the pool was allocated; its
    absence after a refused start then means that nothing was allocated."""
    if allocated:
        log = scenario_log(scenario_dir, "failures")
        assert f"KV offload: CPU block pool of {num_cpu_blocks} blocks" in log
        return
    result, _ = runs[REFUSED]
    assert "error" in result  # the engine did not start
    log = scenario_log(scenario_dir, "failures", step=list(runs).index(REFUSED))
    assert "OffloadConfigError" in log and "lower num_cpu_blocks to" in log
    assert "CPU block pool of" not in log
