"""One host-memory budget for all workers of a host, end to end: an engine
with tensor parallelism 2 on vLLM's CPU backend, whose two workers each
allocate a CPU pool of 62.5 MiB (the guide's 1000 blocks of 64 KiB: the
tiny model's KV per worker at fp32) on one host.

With the host budget at 100 MiB each pool fits alone, the two do not: one
worker is refused at start-up naming the total and the fix, the other's
pool is the only one allocated, and the engine does not start (instead of
the host running out of memory). At 128 MiB both start and serve.

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

pytestmark = pytest.mark.e2e

TP2 = {**ENGINE, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
POOL_MIB = 62.5  # per worker: 1000 blocks x 64 KiB


def tp2_scenario(budget: str) -> dict:
    return {
        "engine": TP2,
        "offload": GUIDE_OFFLOAD,
        "env": {HOST_BUDGET_ENV: budget, "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        "phases": [{"prompts": ["Hello, my name is"], "max_tokens": 4}],
    }


def pools_of_dead_engines_are_gone() -> None:
    """The next check on the host removes the records of the engine's
    workers (they are gone: nothing holds them)."""
    host_ledger.live_pools()
    left = [
        name
        for name in os.listdir(host_ledger.ledger_dir())
        if name.startswith(host_ledger.PREFIX)
    ]
    assert left == []


def test_two_pools_that_fit_alone_but_not_together_are_refused_by_name(
    scenario_dir,
):
    with pytest.raises(AssertionError, match="scenario tp2-over-budget failed"):
        run_scenario(scenario_dir, "tp2-over-budget", tp2_scenario("100MiB"))
    log = scenario_log(scenario_dir, "tp2-over-budget")
    remove_vllm_tp_shm(log)  # vLLM's, not ours: see conftest
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
    pools_of_dead_engines_are_gone()


def test_two_pools_within_the_budget_both_start(scenario_dir):
    result = run_scenario(scenario_dir, "tp2-within-budget", tp2_scenario("128MiB"))
    assert len(result["phases"][0][0]["token_ids"]) == 4
    log = scenario_log(scenario_dir, "tp2-within-budget")
    remove_vllm_tp_shm(log)  # vLLM's, not ours: see conftest
    assert log.count("CPU block pool of 1000 blocks x 65536 bytes") == 2
    assert "next to 1 other pool(s) of this host (62.50 MiB)" in log
    pools_of_dead_engines_are_gone()
