"""Run one engine scenario in a fresh process and write its results as JSON.

Each scenario starts its own ``LLM`` (vLLM's CPU backend here), runs phases of
greedy requests and records, per request, the generated token ids and how many
prompt tokens were served from a cache; at the end it records vLLM's
offloading counters. A process per scenario keeps engines from leaking state
into each other.

    python -m tests.e2e.run_scenario SCENARIO.json RESULT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run(scenario: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from vllm_ascend.testing.tiny_model import ensure_tiny_model

    kwargs = dict(scenario.get("engine", {}))
    if scenario.get("offload") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=scenario.get("connector", "OffloadingConnector"),
            kv_connector_module_path=scenario.get("connector_module_path"),
            kv_role="kv_both",
            kv_connector_extra_config=scenario["offload"],
        )
    llm = LLM(model=ensure_tiny_model(), disable_log_stats=False, **kwargs)

    phases = []
    for phase in scenario["phases"]:
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
                }
                for out in outputs
            ]
        )
        # Stores are submitted at the start of the next engine step and land
        # asynchronously; a few short steps let them finish before the next
        # phase looks the blocks up.
        llm.generate(["flush"], SamplingParams(max_tokens=4), use_tqdm=False)

    counters: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:kv_offload") and hasattr(metric, "value"):
            counters[metric.name] = counters.get(metric.name, 0.0) + metric.value
    return {"phases": phases, "counters": counters}


def main() -> None:
    scenario = json.loads(Path(sys.argv[1]).read_text())
    result = run(scenario)
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
