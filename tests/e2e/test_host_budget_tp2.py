"""One host-memory budget for all workers of a host, end to end: an engine
with tensor parallelism 2 on vLLM's CPU backend, whose two workers each
allocate a CPU pool of 62.5 MiB (the guide's 1000 blocks of 64 KiB: the
tiny model's KV per worker at fp32) on one host.

With the host budget at 100 MiB each pool fits alone, the two do not: one
worker is refused at start-up naming the total and the fix, the other's
pool is the only one allocated, and the engine does not start (instead of
the host running out of memory). At 128 MiB both start and serve.

Both engines run one after the other in one process (a ``run_scenario``
sequence: one interpreter and vLLM import for the two).

On 2 cores the two workers' OpenMP threads are bound one core each
(``VLLM_CPU_OMP_THREADS_BIND=0|1``: our plugin's core reservation,
``cpu_threads.apply``, covers one worker per NUMA node only, and vLLM wants
one list per worker).
"""

from __future__ import annotations

import os
import re

import pytest

from tests.e2e.conftest import (
    ENGINE,
    GUIDE_OFFLOAD,
    remove_vllm_tp_shm,
    run_scenario,
    scenario_log,
)
from vllm_ascend.kv_offload import host_ledger
from vllm_ascend.kv_offload.host_guard import HOST_BUDGET_ENV
from vllm_ascend.kv_offload.testing.engine import TERMINATE_WORKERS_ENV

pytestmark = pytest.mark.e2e

TP2 = {**ENGINE, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
POOL_MIB = 62.5  # per worker: 1000 blocks x 64 KiB


BUDGETS = {"tp2-over-budget": "100MiB", "tp2-within-budget": "128MiB"}


def tp2_scenario(budget: str, ledger: str) -> dict:
    """An engine with the host budget ``budget`` and the host's pool records
    in ``ledger`` (this test's: no engine outside it counts); its start error
    recorded, its processes gone before the next engine starts (a late line
    of the refused engine's other worker, or its pool's record, must not
    reach the next)."""
    env = {
        HOST_BUDGET_ENV: budget,
        host_ledger.LEDGER_DIR_ENV: ledger,
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        # Its TP workers terminated 1 s into its shutdown: exiting on their
        # own takes them longer than vLLM's 5 s grace on a loaded machine,
        # offloading on or off (CPython's finalization; testing/engine.py).
        **TERMINATE_WORKERS_ENV,
    }
    return {
        "engine": TP2,
        "offload": GUIDE_OFFLOAD,
        "env": env,
        "phases": [{"prompts": ["Hello, my name is"], "max_tokens": 4}],
        "expect_error": True,
        "await_exit": True,
    }


@pytest.fixture(scope="module")
def runs(scenario_dir) -> dict[str, tuple[dict, str, str]]:
    """Each engine's result and log, by name (``BUDGETS``), and the
    ledger's directory."""
    ledger = scenario_dir / "tp2-ledger"
    ledger.mkdir()
    sequence = [tp2_scenario(b, str(ledger)) for b in BUDGETS.values()]
    result = run_scenario(scenario_dir, "tp2-budget", {"sequence": sequence})
    remove_vllm_tp_shm(scenario_log(scenario_dir, "tp2-budget"))  # see conftest
    return {
        name: (run, scenario_log(scenario_dir, "tp2-budget", step=i), str(ledger))
        for i, (name, run) in enumerate(zip(BUDGETS, result["runs"], strict=True))
    }


def pools_of_dead_engines_are_gone(ledger: str) -> None:
    """The next check on the host removes the records of the engine's
    workers (they are gone: nothing holds them)."""
    host_ledger.live_pools(ledger)
    left = [name for name in os.listdir(ledger) if name.startswith(host_ledger.PREFIX)]
    assert left == []


def test_two_pools_that_fit_alone_but_not_together_are_refused_by_name(runs):
    result, log, ledger = runs["tp2-over-budget"]
    assert "error" in result, "the engine started"
    assert log.count("KV offload: host memory check passed") == 1
    # The refused worker allocates no pool. The other one's pool line may
    # come after the refusal, or not at all if the engine stops first.
    refused = re.search(r"\((Worker_TP\d) pid=\d+\).*OffloadConfigError", log)
    assert refused, "no worker was refused"
    pools = re.findall(r"\((Worker_TP\d) pid=\d+\).*CPU block pool of 1000 blocks", log)
    assert refused.group(1) not in pools and len(pools) <= 1
    assert f"['num_cpu_blocks']=1000 asks for a CPU pool of {POOL_MIB:.2f} MiB" in log
    # The other worker's pool is allocated, or being allocated, by then.
    assert "with the 1 other CPU pool of this host (62.50 MiB, " in log
    assert (
        "the pools would take 125.00 MiB, more than the host budget "
        f"{HOST_BUDGET_ENV}=100.00 MiB" in log
    )
    # 800 blocks x 64 KiB x 2 workers = 100 MiB.
    assert "lower num_cpu_blocks to 800 (this engine's 2 workers" in log
    assert "MemoryError" not in log
    pools_of_dead_engines_are_gone(ledger)


def test_two_pools_within_the_budget_both_start(runs):
    result, log, ledger = runs["tp2-within-budget"]
    assert len(result["phases"][0][0]["token_ids"]) == 4
    assert log.count("CPU block pool of 1000 blocks x 65536 bytes") == 2
    assert "next to 1 other pool(s) of this host (62.50 MiB)" in log
    pools_of_dead_engines_are_gone(ledger)
