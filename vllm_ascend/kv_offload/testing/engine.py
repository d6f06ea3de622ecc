"""The one engine driver of the e2e tests, the benchmarks and the offline
example: an ``LLM`` with the guide's offloading configuration, one request
at a time with its time to first token from vLLM's request metrics, the
offloading counters, stores waited for, the device prefix cache dropped, and
a shutdown that gives the engine's processes the time they need.

Nothing here imports vLLM at module level: the example's ``--help`` and the
benchmarks' orchestrators stay fast.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

# How long the engine's processes get to exit before vLLM kills them.
# vLLM gives the engine core 5 s (vllm/v1/utils.py shutdown), which itself
# first waits VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 s) for its workers
# (vllm/v1/executor/multiproc_executor.py _ensure_worker_termination), then
# SIGTERM, 4 s, SIGKILL. A CPU TP worker needs about 2.5 s of CPU to exit,
# offloading on or off: 0.5 s in vLLM's worker shutdown (offloading's part:
# about 15 ms), then 2 s in CPython's interpreter finalization (Py_FinalizeEx:
# GC and teardown of the ~670k objects vLLM's imports create; a process that
# only imports vllm.v1.executor.multiproc_executor takes 1.9 s to finalize).
# On a loaded 2-core machine that is 14-23 s, so the defaults end in
# "force killing" lines, a leaked shared_memory warning and the /dev/shm
# files of vLLM's CPU TP communicator (``vllm_dist_*-cpushm_*``, unlinked
# only by a worker that exits on its own). Waiting costs nothing when they
# are quicker: shutdown returns as soon as they have exited.
SHUTDOWN_TIMEOUT_S = 120.0
WORKER_SHUTDOWN_TIMEOUT_S = "60"  # the engine core's wait, within the above
# Tests that check nothing of a TP engine's shutdown: its workers are
# terminated after 1 s instead of exiting on their own (above), 10-20 s
# saved per engine on a loaded machine; the test removes the communicator's
# /dev/shm files they leave (tests/e2e/conftest.py remove_vllm_tp_shm).
TERMINATE_WORKERS_ENV = {"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1"}

# The user guide's kv_connector_extra_config, key for key.
GUIDE_EXTRA_CONFIG = {
    "num_cpu_blocks": 1000,
    "block_size": 128,
    "spec_name": "NPUOffloadingSpec",
    "spec_module_path": "vllm_ascend.kv_offload.npu",
}

OFFLOAD_PREFIX = "vllm:kv_offload"
STORE_BYTES = "vllm:kv_offload_store_bytes"


def transfer_config(extra_config: dict, **fields):
    """The guide's ``KVTransferConfig`` around ``extra_config``
    (``kv_connector_extra_config``); ``fields`` override or add its other
    fields (``kv_load_failure_policy``, ``engine_id``, ...)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        **{
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra_config,
            **fields,
        }
    )


def start(model: str, transfer=None, **engine_args):
    """An ``LLM`` for ``model`` with ``transfer`` (a ``KVTransferConfig`` or
    None: offloading off), keeping the statistics that the request metrics
    and the offloading counters below come from."""
    from vllm import LLM

    if transfer is not None:
        engine_args["kv_transfer_config"] = transfer
    return LLM(model=model, disable_log_stats=False, **engine_args)


def generate(llm, prompt: str, max_tokens: int = 1, **sampling):
    """``prompt`` alone (greedy): the cache state it sees does not depend on
    batching. Returns vLLM's ``RequestOutput``."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return out


def ttft_s(output) -> float:
    """Time to first token of a finished request, from vLLM's request
    metrics: arrival in the engine to the first token (what vLLM's own
    ``vllm:time_to_first_token_seconds`` histogram records)."""
    if output.metrics is None:
        raise ValueError("no request metrics: start the engine with start()")
    return output.metrics.first_token_latency


def counters(
    prefixes: Iterable[str] = (OFFLOAD_PREFIX,), registry=None
) -> dict[str, float]:
    """This process's engine metrics whose names start with one of
    ``prefixes`` (counters and gauges), summed over labels, as floats.

    Read from the Prometheus registry (``registry``: the default one):
    ``LLM.get_metrics()`` turns counters into ``int``, which truncates the
    load/store seconds to 0."""
    from prometheus_client import REGISTRY

    prefixes = tuple(prefixes)
    totals: dict[str, float] = {}
    for family in (registry or REGISTRY).collect():
        if family.type in ("counter", "gauge") and family.name.startswith(prefixes):
            names = (family.name, family.name + "_total")
            value = sum(s.value for s in family.samples if s.name in names)
            totals[family.name] = totals.get(family.name, 0.0) + value
    return totals


def settle(
    llm,
    metric: str = STORE_BYTES,
    steady_rounds: int = 2,
    max_rounds: int = 50,
    pause_s: float = 0.05,
) -> float:
    """Steps the engine with short requests until ``metric`` has stayed the
    same for ``steady_rounds`` rounds; returns its value. Stores are
    submitted at the start of the next engine step and finish
    asynchronously (tier cascades at the end of one), so a phase's blocks
    are only found by the next one once they have landed (on a loaded
    machine one round of steps was not always enough)."""
    last, steady = -1.0, 0
    for _ in range(max_rounds):
        generate(llm, "flush", max_tokens=2)
        time.sleep(pause_s)
        value = counters((metric,)).get(metric, 0.0)
        steady = steady + 1 if value == last else 0
        if steady >= steady_rounds:
            break
        last = value
    return last


def reset_prefix_cache(llm, timeout_s: float = 60.0) -> None:
    """Drops the device prefix cache (refused while transfers are in
    flight: retried, with steps in between, until ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise TimeoutError(f"reset_prefix_cache kept failing for {timeout_s} s")
        generate(llm, "flush", max_tokens=2)


def shutdown(llm, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Shuts ``llm``'s engine core down and waits for its processes to exit
    on their own (above), so that their shared memory is released in order."""
    llm.llm_engine.engine_core.shutdown(timeout=timeout_s)
