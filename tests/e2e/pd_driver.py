"""Scenario driver for tests/e2e/test_pd_multi_connector.py: P/D engines
whose ``MultiConnector`` holds a P/D connector and our offloading connector.

The P/D connector is vLLM's ``ExampleConnector`` (KV files in a shared
directory), the stand-in on the CPU backend for Mooncake; it comes first, as
Mooncake does in upstream vllm-ascend's documented MultiConnector configs.
``scenario["engines"]`` are started one after the other in this process
(a producer, then consumers), each running its ``phases`` of greedy
requests, one request at a time. Per phase: token ids, cached tokens and
finish reason per request, and vLLM's offloading counters after it.

Phase keys: ``prompts``; ``reset_prefix_cache``; ``pd_storage``, done
before the phase: ``"hide"`` (the P/D directory moves away: the P/D
connector finds nothing and the offloading connector may serve) or
``"restore_without_a_layer"`` (it comes back with each request's first
layer file gone: the P/D connector matches, then its load fails) or
``"clear"`` (what the P/D connector wrote meanwhile is deleted: on a miss it
saves each prompt's KV, so the next phase would hit it there).
"""

from __future__ import annotations

import gc
import os
import shutil

from vllm_ascend.kv_offload.testing import engine

ROLES = {"producer": "kv_producer", "consumer": "kv_consumer"}


def multi_connector_config(engine: dict, pd: dict) -> dict:
    """The engine's KVTransferConfig arguments: P/D first, offloading second
    (the guide's OffloadingConnector entry; offloading needs kv_both)."""
    role = ROLES[engine["role"]]
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_load_failure_policy": engine.get("kv_load_failure_policy", "fail"),
        "kv_connector_extra_config": {
            "connectors": [
                dict(pd, **engine.get("pd", {}), kv_role=role),
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": engine["offload"],
                },
            ]
        },
    }


def _change_storage(action: str, storage: str) -> None:
    hidden = storage + ".hidden"
    if action == "hide":
        os.rename(storage, hidden)
    elif action == "clear":
        shutil.rmtree(storage, ignore_errors=True)
    elif action == "restore_without_a_layer":
        # What the P/D connector wrote since it was hidden (the flush
        # requests of engine.settle) gives way to the hidden directory.
        shutil.rmtree(storage, ignore_errors=True)
        os.rename(hidden, storage)
        for folder in os.listdir(storage):
            files = sorted(os.listdir(os.path.join(storage, folder)))
            if files:  # the first layer's file: nothing of the load lands
                os.remove(os.path.join(storage, folder, files[0]))
    else:
        raise ValueError(f"pd_storage: unknown action {action!r}")


def _run_phases(llm, phases: list[dict], storage: str) -> list[dict]:
    from tests.e2e.run_scenario import request_record

    out = []
    for phase in phases:
        if "pd_storage" in phase:
            _change_storage(phase["pd_storage"], storage)
        if phase.get("reset_prefix_cache"):
            assert llm.reset_prefix_cache()
        results = [
            request_record(engine.generate(llm, prompt, 16, ignore_eos=True))
            for prompt in phase["prompts"]
        ]
        engine.settle(llm)
        out.append({"results": results, "counters": engine.counters()})
    return out


def run(scenario: dict) -> dict:
    from vllm.config import KVTransferConfig

    from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model

    pd = scenario["pd"]
    storage = pd["kv_connector_extra_config"]["shared_storage_path"]
    result = {}
    for spec in scenario["engines"]:
        # Read by the engine's processes when they start (fault injection).
        os.environ.update(spec.get("env", {}))
        transfer = KVTransferConfig(**multi_connector_config(spec, pd))
        llm = engine.start(ensure_tiny_model(), transfer, **scenario["engine"])
        result[spec["name"]] = _run_phases(llm, spec["phases"], storage)
        engine.shutdown(llm)
        del llm
        gc.collect()
        for key in spec.get("env", {}):
            os.environ.pop(key)
    return result
