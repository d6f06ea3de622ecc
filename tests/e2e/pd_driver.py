"""P/D pieces of run_scenario for tests/e2e/test_pd_multi_connector.py:
engines whose ``MultiConnector`` holds a P/D connector and our offloading
connector.

The P/D connector is vLLM's ``ExampleConnector`` (KV files in a shared
directory), the stand-in on the CPU backend for Mooncake; it comes first, as
Mooncake does in upstream vllm-ascend's documented MultiConnector configs.
A scenario with ``pd`` (the P/D connector's ``KVTransferConfig`` entry) and
``role`` (``"producer"`` or ``"consumer"``) gets this connector config; a
phase's ``pd_storage`` is done before the phase: ``"hide"`` (the P/D
directory moves away: the P/D connector finds nothing and the offloading
connector may serve) or ``"restore_without_a_layer"`` (it comes back with
each request's first layer file gone: the P/D connector matches, then its
load fails) or ``"clear"`` (what the P/D connector wrote meanwhile is
deleted: on a miss it saves each prompt's KV, so the next phase would hit it
there).
"""

from __future__ import annotations

import os
import shutil

ROLES = {"producer": "kv_producer", "consumer": "kv_consumer"}


def multi_connector_config(scenario: dict) -> dict:
    """The engine's KVTransferConfig arguments: P/D first, offloading second
    (the guide's OffloadingConnector entry; offloading needs kv_both)."""
    role = ROLES[scenario["role"]]
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_load_failure_policy": scenario.get("kv_load_failure_policy", "fail"),
        "kv_connector_extra_config": {
            "connectors": [
                dict(scenario["pd"], kv_role=role),
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": scenario["offload"],
                },
            ]
        },
    }


def change_storage(action: str, scenario: dict) -> None:
    storage = scenario["pd"]["kv_connector_extra_config"]["shared_storage_path"]
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
