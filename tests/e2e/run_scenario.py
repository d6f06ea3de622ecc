"""Run one engine scenario in a fresh process and write its results as JSON.

Each scenario starts its own ``LLM`` (vLLM's CPU backend here), runs phases of
greedy requests and records, per request, the generated token ids and how many
prompt tokens were served from a cache; at the end it records vLLM's
offloading counters. A process per scenario keeps engines from leaking state
into each other.

Optional keys: ``model`` (a model directory; default: the tiny Qwen3),
``env`` (variables set before the engine starts, e.g. the
test-only fault injection of ``vllm_ascend.kv_offload.worker``),
``kv_role`` and ``kv_load_failure_policy`` (for ``KVTransferConfig``),
``pd`` and ``role`` (a P/D connector beside ours: pd_driver.py),
``root_dir`` (the fs tier's directory: once the phases are done, the
cascades to it waited for and its block files listed; with it,
``engine_id``, ``stale_region`` (an engine id: its region file and our mark
planted before the engine starts, as a run killed while starting leaves
them), ``remove_root_after_start`` and ``barrier`` (``{"mine": path,
"others": [paths]}``: engines started together begin serving together, and
each later phase begins once every engine's previous one has reached the
tier)), and
``driver`` (``"module:function"``, called with the scenario instead of the
phases above, for scenarios that drive the engine step by step), and
``sequence`` (scenarios run one after another in this process, each engine
shut down before the next starts, each with its own ``env``: one
interpreter start instead of several; each one's output follows a marker
line, ``STEP_MARK``, on stdout and stderr; a step with ``expect_error``
whose engine fails records the error, ``{"error": ...}``, its traceback in
the output, and the sequence goes on; one with ``await_exit``: its engine's
processes are gone before the next starts).
Per phase, optionally: ``reset_prefix_cache``, ``sleep_s`` (before it, e.g.
for slowed copies to land), ``settle: false`` (the next phase starts while
the stores of this one may still be in flight) and ``pd_storage``
(pd_driver.change_storage).

    python -m tests.e2e.run_scenario SCENARIO.json RESULT.json
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import psutil

from vllm_ascend.kv_offload.testing import engine, server


def kv_transfer_config(scenario: dict):
    if scenario.get("offload") is None:
        return None
    if "pd" in scenario:
        from vllm.config import KVTransferConfig

        from tests.e2e.pd_driver import multi_connector_config

        return KVTransferConfig(**multi_connector_config(scenario))
    return engine.transfer_config(
        scenario["offload"],
        kv_connector=scenario.get("connector", "OffloadingConnector"),
        kv_connector_module_path=scenario.get("connector_module_path"),
        kv_role=scenario.get("kv_role", "kv_both"),
        kv_load_failure_policy=scenario.get("kv_load_failure_policy", "fail"),
        engine_id=scenario.get("engine_id"),
    )


def request_record(out) -> dict:
    """One finished request (vLLM's ``RequestOutput``): its generated token
    ids, prompt tokens served from a cache, and finish reason."""
    return {
        "token_ids": list(out.outputs[0].token_ids),
        "num_cached_tokens": out.num_cached_tokens or 0,
        "finish_reason": out.outputs[0].finish_reason,
    }


def metric_totals(llm) -> dict[str, float]:
    """``llm.get_metrics()``'s counters and gauges (an ``LLM`` or an
    ``LLMEngine``), summed over labels, by name."""
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        if hasattr(metric, "value"):
            totals[metric.name] = totals.get(metric.name, 0.0) + metric.value
    return totals


TIER_WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"


def block_files(root: str) -> list[str]:
    """The fs tier's block files under ``root``, sorted: listed by os.walk,
    not by the tier's own walk, so that the tests check that walk. (Here, not
    in a conftest: this file also runs as a script outside the checkout.)"""
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.join(d, n) for n in names if n.endswith(".bin")]
    return sorted(out)


def temp_files(root: str) -> list[str]:
    """Names of the temporary files a write left under ``root``."""
    return [n for _, _, names in os.walk(root) for n in names if ".tmp" in n]


def _meet(llm, barrier: dict, phase: int, timeout: float = 600.0) -> None:
    """``barrier`` before ``phase``: after the first, once this engine's
    writes of the previous phase have reached the tier."""
    suffix = f".{phase}" if phase else ""
    if phase:
        engine.settle(llm, TIER_WRITE_BYTES, steady_rounds=3, pause_s=0.1)
    with open(barrier["mine"] + suffix, "w"):
        pass
    others = [o + suffix for o in barrier["others"]]
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in others):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other engines never started: {others}")
        time.sleep(0.2)


STEP_MARK = "### step {} ###"


def run(scenario: dict) -> dict:
    os.environ.update(scenario.get("env", {}))
    if "sequence" in scenario:
        runs = []
        for i, step in enumerate(scenario["sequence"]):
            for stream in (sys.stdout, sys.stderr):
                print(STEP_MARK.format(i), file=stream, flush=True)
            before = _children()
            with _env(step.get("env", {})):
                runs.append(_run_step(step))
            gc.collect()  # the engine's KV cache goes before the next one's
            if step.get("await_exit"):  # e.g. a late line of a refused engine
                left = server.wait_gone(_children() - before, timeout_s=120)
                assert not left, f"step {i}: engine processes still running: {left}"
        return {"runs": runs}
    return _run_one(scenario)


def _children() -> set[psutil.Process]:
    """This process's descendants but multiprocessing's resource tracker
    (it lives as long as this process)."""
    procs = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "resource_tracker" not in " ".join(p.cmdline()):
                procs.add(p)
    return procs


def _run_step(step: dict) -> dict:
    if not step.get("expect_error"):
        return _run_one(step, shutdown=True)
    try:
        return _run_one(step, shutdown=True)
    except Exception as exc:
        traceback.print_exc()
        return {"error": repr(exc)}


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
    from vllm_ascend.kv_offload.region import mark_path, region_path
    from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model

    if stale := scenario.get("stale_region"):
        with open(region_path(stale), "wb") as f:
            f.write(b"\0" * 4096)  # smaller than any region: vLLM would wait 30 s
        open(mark_path(stale), "wb").close()
    transfer = kv_transfer_config(scenario)
    llm = engine.start(
        scenario.get("model") or ensure_tiny_model(),
        transfer,
        **scenario.get("engine", {}),
    )
    result: dict = {}
    if root := scenario.get("root_dir"):
        result["engine_id"] = transfer.engine_id
        result["region_while_running"] = os.path.exists(region_path(transfer.engine_id))
        if scenario.get("remove_root_after_start"):
            shutil.rmtree(root)

    phases, phase_counters = [], []
    for i, phase in enumerate(scenario["phases"]):
        time.sleep(phase.get("sleep_s", 0))
        if "barrier" in scenario:
            _meet(llm, scenario["barrier"], i)
        if "pd_storage" in phase:
            from tests.e2e.pd_driver import change_storage

            change_storage(phase["pd_storage"], scenario)
        if phase.get("reset_prefix_cache"):
            engine.reset_prefix_cache(llm)
        # One request at a time keeps the cache state each request sees
        # independent of batching.
        outputs = [
            engine.generate(llm, p, phase.get("max_tokens", 16), ignore_eos=True)
            for p in phase["prompts"]
        ]
        phases.append(
            [
                {
                    **request_record(out),
                    "ttft_s": out.metrics.first_token_latency if out.metrics else None,
                }
                for out in outputs
            ]
        )
        if phase.get("settle", True):
            engine.settle(llm)
        # After each phase: what it stored and loaded is the difference.
        phase_counters.append(engine.counters())
    if root:  # cascades to the fs tier are submitted at the end of a step
        engine.settle(
            llm, TIER_WRITE_BYTES, steady_rounds=3, max_rounds=60, pause_s=0.1
        )
        result["files"] = block_files(root) if os.path.isdir(root) else []
        result["counters"] = engine.counters()

    # Which vLLM offloading code ran: "0.33.0" under tests/vllm033's overlay.
    overlay = os.environ.get("VLLM_KV_OFFLOAD_OVERLAY")
    # What vLLM's platform made of the compilation settings (the CPU backend
    # rewrites them), for the compiled-mode tests.
    compilation = llm.llm_engine.vllm_config.compilation_config
    result = {
        "phases": phases,
        "counters": phase_counters[-1] if phase_counters else engine.counters(),
        "phase_counters": phase_counters,
        "offloading_overlay": overlay,
        "compilation": {"mode": compilation.mode.name, "backend": compilation.backend},
    } | result  # a tier's counters: once its writes landed
    if shutdown or root:  # a tier's teardown is checked in the log
        engine.shutdown(llm)
        del llm
        gc.collect()
    if root:
        result["region_after_shutdown"] = os.path.exists(
            region_path(result["engine_id"])
        )
    return result


def main() -> None:
    scenario = json.loads(Path(sys.argv[1]).read_text())
    result = run(scenario)
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
