"""vLLM's CPU backend keeps a core free for its scheduler, with our connector.

vLLM reserves one more core whenever a KV connector is configured; on two
cores that left none, so vLLM reserved nothing and ran its OpenMP threads on
both cores, beside the scheduler (issue 18). Our plugin entry point sets
vLLM's documented ``VLLM_CPU_NUM_OF_RESERVED_CPU`` in exactly that case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_ascend.kv_offload import cpu_threads
from vllm_ascend.kv_offload.cpu_threads import CpuTopology

RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"


@pytest.mark.parametrize(
    "environ, cores_per_node, expected",
    [
        ({}, {0: 2}, "1"),  # two cores, one node: one reserved, as without one
        # Explicit settings are left alone.
        ({RESERVED: "0"}, {0: 2}, None),  # the user's
        ({"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, {0: 2}, None),  # reserve nothing
        ({"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, {0: 2}, None),
        ({"VLLM_CPU_SIM_MULTI_NUMA": "1"}, {0: 2}, None),
        # Topologies where vLLM leaves a core are left alone.
        ({}, {0: 1}, None),
        ({}, {0: 3}, None),
        ({}, {0: 64}, None),
        ({}, {0: 2, 1: 2}, None),
    ],
)
def test_the_reservation_is_lowered_only_where_a_connectors_leaves_no_core(
    environ, cores_per_node, expected
):
    """``apply`` sets the variable where it is lowered, and never overrides it."""
    env = dict(environ)
    assert cpu_threads.apply(env, lambda: CpuTopology(cores_per_node)) == expected
    assert env == environ | ({} if expected is None else {RESERVED: expected})


# Runs in a child pinned to two CPUs: the plugin entry point, then vLLM's own
# OpenMP binding for a config with a KV connector.
_BINDING_WITH_A_CONNECTOR = r"""
import json, os, sys
from types import SimpleNamespace
os.sched_setaffinity(0, set(json.loads(sys.argv[1])))
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.utils.ompmultiprocessing import OMPProcessManager
parallel = SimpleNamespace(local_world_size=1, data_parallel_rank_local=None,
                           _api_process_count=1)
manager = OMPProcessManager(
    SimpleNamespace(parallel_config=parallel, kv_transfer_config=object()))
print(json.dumps({"omp_cpus": manager.cpu_lists,
                  "reserved": manager.reserved_cpu_list}))
"""


def test_vllm_binds_one_core_and_keeps_one_for_the_scheduler_with_a_connector():
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    names = ("NUM_OF_RESERVED_CPU", "OMP_THREADS_BIND", "SIM_MULTI_NUMA")
    explicit = {f"VLLM_CPU_{name}" for name in names}
    env = {k: v for k, v in os.environ.items() if k not in explicit}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", _BINDING_WITH_A_CONNECTOR, json.dumps(cpus)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    binding = json.loads(out.stdout.strip().splitlines()[-1])
    if len({len(c) for c in binding["omp_cpus"]}) != 1:
        pytest.skip(f"unexpected topology: {binding}")
    # One OpenMP core for the worker, one kept for the scheduler (before the
    # fix: both cores to OpenMP, none reserved).
    assert binding == {"omp_cpus": [[cpus[0]]], "reserved": [cpus[1]]}, out.stderr


# --- Copy threads off vLLM's OpenMP cores -----------------------------------
# vLLM pins its worker's main thread to the first OpenMP core before our code
# runs; threads inherit that, so without a rule all our copy threads would
# share the core the OpenMP master thread spins on.


@pytest.mark.parametrize(
    ("allowed", "omp", "expected"),
    [
        ({0, 1}, {0}, {1}),  # VLLM_CPU_NUM_OF_RESERVED_CPU=1: the reserved core
        ({0, 1, 2, 3}, {0, 1}, {2, 3}),
        ({0, 1}, {0, 1}, {0, 1}),  # no core left free: anywhere, not OMP's first
        ({0, 1}, None, None),  # no binding (nobind, other backends): inherited
    ],
)
def test_copy_threads_go_to_the_cores_outside_the_openmp_binding(
    allowed, omp, expected
):
    assert cpu_threads.copy_thread_cpus(allowed, omp) == expected


@pytest.mark.parametrize(
    "environ, cores",
    [
        ({"GOMP_CPU_AFFINITY": "0 1 2"}, {0, 1, 2}),  # vLLM's formats, per runtime
        ({"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}, {0, 1, 2}),
        ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,1,2]"}, {0, 1, 2}),
        ({"GOMP_CPU_AFFINITY": "0-2"}, {0, 1, 2}),
        ({}, None),  # no binding in vLLM's format means none
        ({"OMP_PLACES": "cores"}, None),
    ],
)
def test_the_openmp_binding_is_read_from_the_variables_vllm_sets(environ, cores):
    assert cpu_threads.omp_cores_from_env(environ) == cores


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs this process may use",
)
def test_a_thread_queue_copy_runs_outside_the_openmp_binding(monkeypatch):
    from vllm_ascend.kv_offload.transfer_queue import ThreadTransferQueue

    first, *rest = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("GOMP_CPU_AFFINITY", str(first))  # OpenMP on `first`
    monkeypatch.delenv("OMP_PLACES", raising=False)
    seen = []
    q = ThreadTransferQueue("affinity-test")
    try:
        q.submit(1, lambda: seen.append(os.sched_getaffinity(0)))
        q.wait({1})
    finally:
        q.shutdown()
    assert seen == [set(rest)]
