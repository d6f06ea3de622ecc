"""Run one engine scenario in a fresh process and write its results as JSON.

Each scenario starts its own ``LLM`` (vLLM's CPU backend here), runs phases of
greedy requests and records, per request, the generated token ids and how many
prompt tokens were served from a cache; at the end it records vLLM's
offloading counters. A process per scenario keeps engines from leaking state
into each other.

Optional keys: ``model`` (a model directory; default: the tiny Qwen3),
``env`` (variables set before the engine starts, e.g. the
test-only fault injection of ``vllm_ascend.kv_offload.worker``),
``kv_role`` and ``kv_load_failure_policy`` (for ``KVTransferConfig``), and
``driver`` (``"module:function"``, called with the scenario instead of the
phases above, for scenarios that drive the engine step by step), and
``sequence`` (scenarios run one after another in this process, each engine
shut down before the next starts, each with its own ``env``: one
interpreter start instead of several).
Per phase, optionally: ``reset_prefix_cache``, ``sleep_s`` (before it, e.g.
for slowed copies to land) and ``settle: false`` (the next phase starts while
the stores of this one may still be in flight).

    python -m tests.e2e.run_scenario SCENARIO.json RESULT.json
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path


def kv_transfer_config(scenario: dict):
    from vllm.config import KVTransferConfig

    if scenario.get("offload") is None:
        return None
    return KVTransferConfig(
        kv_connector=scenario.get("connector", "OffloadingConnector"),
        kv_connector_module_path=scenario.get("connector_module_path"),
        kv_role=scenario.get("kv_role", "kv_both"),
        kv_connector_extra_config=scenario["offload"],
        kv_load_failure_policy=scenario.get("kv_load_failure_policy", "fail"),
    )


def _stored_bytes(llm) -> float:
    return sum(
        getattr(m, "value", 0.0)
        for m in llm.get_metrics()
        if m.name == "vllm:kv_offload_store_bytes"
    )


def settle_stores(llm, max_rounds: int = 50) -> None:
    """Lets the stores of the last phase land before the next one looks the
    blocks up. Stores are submitted at the start of the next engine step and
    finish asynchronously, so short requests step the engine until the stored
    byte count has stayed the same over two rounds (on a loaded machine one
    round of steps was not always enough)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4)
    last, steady = -1.0, 0
    for _ in range(max_rounds):
        llm.generate(["flush"], params, use_tqdm=False)
        time.sleep(0.05)
        stored = _stored_bytes(llm)
        steady = steady + 1 if stored == last else 0
        if steady >= 2:
            return
        last = stored


def shutdown_engine(llm, timeout_s: float = 60) -> None:
    """Shuts ``llm``'s engine core down and waits for it: vLLM kills it after
    5 s by default, which a loaded machine can exceed."""
    llm.llm_engine.engine_core.shutdown(timeout=timeout_s)


def counters(llm) -> dict[str, float]:
    """vLLM's offloading metrics (ours included), summed over labels."""
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:kv_offload") and hasattr(metric, "value"):
            totals[metric.name] = totals.get(metric.name, 0.0) + metric.value
    return totals


def run(scenario: dict) -> dict:
    os.environ.update(scenario.get("env", {}))
    if "sequence" in scenario:
        runs = []
        for step in scenario["sequence"]:
            with _env(step.get("env", {})):
                runs.append(_run_one(step, shutdown=True))
            gc.collect()  # the engine's KV cache goes before the next one's
        return {"runs": runs}
    return _run_one(scenario)


def _run_one(scenario: dict, shutdown: bool = False) -> dict:
    if "driver" in scenario:  # a driver shuts its engine down itself
        module, function = scenario["driver"].split(":")
        return getattr(importlib.import_module(module), function)(scenario)
    return _run_engine(scenario, shutdown)


@contextlib.contextmanager
def _env(changes: dict[str, str]) -> Iterator[None]:
    """``changes`` in os.environ while one engine of a sequence runs (a
    worker reads e.g. its faults when it starts)."""
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _run_engine(scenario: dict, shutdown: bool = False) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model

    kwargs = dict(scenario.get("engine", {}))
    transfer_config = kv_transfer_config(scenario)
    if transfer_config is not None:
        kwargs["kv_transfer_config"] = transfer_config
    model = scenario.get("model") or ensure_tiny_model()
    llm = LLM(model=model, disable_log_stats=False, **kwargs)

    phases, phase_counters = [], []
    for phase in scenario["phases"]:
        time.sleep(phase.get("sleep_s", 0))
        if phase.get("reset_prefix_cache"):
            assert llm.reset_prefix_cache()
        params = SamplingParams(
            max_tokens=phase.get("max_tokens", 16), temperature=0.0, ignore_eos=True
        )
        # One request at a time keeps the cache state each request sees
        # independent of batching.
        outputs = [
            llm.generate([p], params, use_tqdm=False)[0] for p in phase["prompts"]
        ]
        phases.append(
            [
                {
                    "token_ids": list(out.outputs[0].token_ids),
                    "num_cached_tokens": out.num_cached_tokens or 0,
                    "finish_reason": out.outputs[0].finish_reason,
                    "ttft_s": out.metrics.first_token_latency if out.metrics else None,
                }
                for out in outputs
            ]
        )
        if phase.get("settle", True):
            settle_stores(llm)
        # After each phase: what it stored and loaded is the difference.
        phase_counters.append(counters(llm))

    # Which vLLM offloading code ran: "0.33.0" under tests/vllm033's overlay.
    overlay = os.environ.get("VLLM_KV_OFFLOAD_OVERLAY")
    # What vLLM's platform made of the compilation settings (the CPU backend
    # rewrites them), for the compiled-mode tests.
    compilation = llm.llm_engine.vllm_config.compilation_config
    result = {
        "phases": phases,
        "counters": phase_counters[-1] if phase_counters else counters(llm),
        "phase_counters": phase_counters,
        "offloading_overlay": overlay,
        "compilation": {"mode": compilation.mode.name, "backend": compilation.backend},
    }
    if shutdown:
        shutdown_engine(llm)
    return result


def main() -> None:
    scenario = json.loads(Path(sys.argv[1]).read_text())
    result = run(scenario)
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
