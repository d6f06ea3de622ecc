"""Scenario driver for tests/e2e/test_tiering.py: one engine, tiering on.

Runs ``scenario["prompts"]`` one at a time (greedy), lets the device ->
CPU stores and the CPU -> fs cascades land, and returns per request the
token ids and cached tokens, vLLM's offloading counters, the files under
the fs root and whether the shared-memory region existed while the engine
ran and after it shut down. Optional: ``before`` (an action run before the
engine starts: ``{"stale_region": engine_id}`` plants a region file and
our mark, as a run killed while starting leaves them),
``remove_root_after_start`` (the fs directory disappears once the engine
is up), ``rounds`` (lists of prompts served in turn instead of
``prompts``, the device prefix cache reset in between), ``barrier``
(``{"mine": path, "others": [paths]}``: engines started together begin
serving together, and each later round begins once every engine's
previous round has reached the tier).
"""

from __future__ import annotations

import gc
import os
import shutil
import time

from tests.e2e.run_scenario import request_record
from vllm_ascend.kv_offload.testing import engine

TIER_WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"


def block_files(root: str) -> list[str]:
    """The fs tier's block files under ``root``, sorted."""
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.join(d, n) for n in names if n.endswith(".bin")]
    return sorted(out)


def temp_files(root: str) -> list[str]:
    """Names of the temporary files a write left under ``root``."""
    return [n for _, _, names in os.walk(root) for n in names if ".tmp" in n]


def _meet(mine: str, others: list[str], timeout: float = 600.0) -> None:
    with open(mine, "w"):
        pass
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in others):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other engines never started: {others}")
        time.sleep(0.2)


def run(scenario: dict) -> dict:
    from vllm_ascend.kv_offload.region import mark_path, region_path
    from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model

    engine_id = scenario.get("engine_id")
    stale = (scenario.get("before") or {}).get("stale_region")
    if stale:  # as a run killed while starting leaves them: region, mark
        with open(region_path(stale), "wb") as f:
            f.write(b"\0" * 4096)  # smaller than any region: vLLM would wait 30 s
        open(mark_path(stale), "wb").close()
    transfer = engine.transfer_config(
        scenario["offload"], kv_load_failure_policy="recompute", engine_id=engine_id
    )
    llm = engine.start(ensure_tiny_model(), transfer, **scenario["engine"])
    engine_id = transfer.engine_id
    region_while_running = os.path.exists(region_path(engine_id))
    root = scenario.get("root_dir")
    if scenario.get("remove_root_after_start") and root:
        shutil.rmtree(root)

    barrier = scenario.get("barrier")
    if barrier:
        _meet(barrier["mine"], barrier["others"])
    results = []
    for round_, prompts in enumerate(scenario.get("rounds") or [scenario["prompts"]]):
        if round_:
            engine.settle(llm)
            if barrier:  # every engine's round written to the tier first
                engine.settle(llm, TIER_WRITE_BYTES, steady_rounds=3, pause_s=0.1)
                _meet(
                    f"{barrier['mine']}.{round_}",
                    [f"{o}.{round_}" for o in barrier["others"]],
                )
            engine.reset_prefix_cache(llm)
        for prompt in prompts:
            out = engine.generate(llm, prompt, 16, ignore_eos=True)
            results.append(request_record(out))
    engine.settle(llm)
    # Cascades to the fs tier are submitted at the end of a scheduler step.
    engine.settle(llm, TIER_WRITE_BYTES, steady_rounds=3, max_rounds=60, pause_s=0.1)
    totals = engine.counters()
    files = block_files(root) if root and os.path.isdir(root) else []

    # Time for the engine core's own teardown: what it logs is checked.
    engine.shutdown(llm)
    del llm
    gc.collect()
    return {
        "results": results,
        "counters": totals,
        "files": files,
        "engine_id": engine_id,
        "region_while_running": region_while_running,
        "region_after_shutdown": os.path.exists(region_path(engine_id)),
    }
