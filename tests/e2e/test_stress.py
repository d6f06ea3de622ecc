"""Randomised differential stress test on a real engine (CPU backend).

About 200 greedy requests with overlapping prefixes arrive a few per engine
step into a tiny device cache (constant preemption and prefix-cache eviction)
backed by a tiny CPU pool (constant CPU eviction); some are aborted at random
moments (waiting, loading from the CPU, or running). Every request that is
not aborted must produce exactly the tokens it produces with offloading off.
A third run adds random transfer faults with ``kv_load_failure_policy=
"recompute"``: still no difference.

The engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni``
executor), one after the other in one process, so that the run can also
check, after each shutdown, that the offloading worker left no thread and
freed its CPU pool.

The driver (``drive``) runs inside ``tests.e2e.run_scenario``'s subprocess.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from tests.e2e.conftest import (
    FAULTY_OFFLOAD,
    GUIDE_OFFLOAD,
    IN_PROCESS_ENV,
    PREEMPTING_ENGINE,
    run_sequence,
)

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 200
TOKENS_PER_BLOCK = 128  # the CPU backend's device block size; block_size too
# 12 CPU blocks for 6 documents of 3 blocks plus every request's own tail:
# stores evict constantly.
OFFLOAD = dict(GUIDE_OFFLOAD, num_cpu_blocks=12)
FAULTS = "load:0.15,store:0.15,load_submit:0.05,store_submit:0.05,seed:11"


def make_requests(seed: int = 0) -> list[dict]:
    """Prompts that share prefixes: 1-3 blocks of one of 6 documents, then
    sometimes the first block of another, then a unique tail (5 blocks at
    most: 1024 tokens of model length)."""
    from vllm_ascend.kv_offload.testing.tiny_model import make_prompt

    rng = random.Random(seed)
    docs = [make_prompt(3 * TOKENS_PER_BLOCK, seed=500 + d).split() for d in range(6)]
    requests = []
    for i in range(NUM_REQUESTS):
        words = docs[rng.randrange(6)][: TOKENS_PER_BLOCK * rng.randint(1, 3)]
        if rng.random() < 0.3:
            words = words + docs[rng.randrange(6)][:TOKENS_PER_BLOCK]
        # Half the prompts end just before a block boundary, so decoding
        # needs a new block soon: with the device cache full, a preemption.
        tail_words = 124 if rng.random() < 0.5 else rng.randint(1, 120)
        tail = make_prompt(tail_words, seed=10_000 + i).split()
        requests.append(
            {
                "prompt": " ".join(words + tail),
                "max_tokens": rng.randint(2, 12),
                # 10% are aborted this many engine steps after arriving.
                "abort_after": rng.randint(0, 8) if rng.random() < 0.1 else None,
            }
        )
    return requests


def drive(scenario: dict) -> dict:
    """Feeds the requests a few per step, aborts some, returns the outputs."""
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    from tests.e2e.run_scenario import kv_transfer_config, metric_totals
    from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model

    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=ensure_tiny_model(),
            disable_log_stats=False,
            kv_transfer_config=kv_transfer_config(scenario),
            **scenario["engine"],
        )
    )
    requests = make_requests()
    rng = random.Random(scenario.get("seed", 1))
    waiting = list(range(len(requests)))
    # External request id -> (index, step added); outputs and aborts use it.
    added: dict[str, tuple[int, int]] = {}
    outputs: dict[int, dict] = {}
    aborted: list[int] = []
    step = 0
    start = time.perf_counter()
    while waiting or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if waiting:
                i = waiting.pop(0)
                params = SamplingParams(
                    max_tokens=requests[i]["max_tokens"],
                    temperature=0.0,
                    ignore_eos=True,
                )
                engine.add_request(f"r{i}", requests[i]["prompt"], params)
                added[f"r{i}"] = (i, step)
        for out in engine.step():
            if out.finished:
                i, _ = added.pop(out.request_id)
                outputs[i] = {
                    "token_ids": list(out.outputs[0].token_ids),
                    "finish_reason": out.outputs[0].finish_reason,
                }
        for rid, (i, since) in list(added.items()):
            after = requests[i]["abort_after"]
            if after is not None and step - since >= after:
                engine.abort_request([rid])
                del added[rid]
                aborted.append(i)
        step += 1
    seconds = time.perf_counter() - start

    counters = metric_totals(engine)
    if scenario.get("offload"):
        shutdown = _shut_down(engine)
    else:  # the next engine of the sequence starts after this one is gone
        engine.engine_core.shutdown()
        shutdown = {}
    return {
        "outputs": {str(i): o for i, o in outputs.items()},
        "aborted": sorted(aborted),
        "steps": step,
        "seconds": seconds,
        "counters": counters,
        "shutdown": shutdown,
    }


def _shut_down(engine) -> dict:
    """Shuts the engine down; reports what the offloading worker left."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().connector_worker.worker
    faults = getattr(worker, "faults", None)  # tests/fault_injection.py
    start = time.perf_counter()
    engine.engine_core.shutdown()
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "threads": [t.name for t in threading.enumerate() if "kv-offload" in t.name],
        "pool_released": worker.pool.tensor is None,
        "faults_injected": len(faults.injected) if faults else 0,
    }


def _scenario(offload, env=None, **extra) -> dict:
    return {
        "driver": "tests.e2e.test_stress:drive",
        "engine": PREEMPTING_ENGINE,
        "offload": offload,
        "env": env or {},
        **extra,
    }


@pytest.fixture(scope="module")
def runs(scenario_dir) -> dict[str, dict]:
    """Offloading off, on, and on with transfer faults: one engine after
    the other in one process."""
    scenarios = {
        "reference": _scenario(None),
        "offload": _scenario(OFFLOAD),
        "faults": _scenario(
            dict(FAULTY_OFFLOAD, num_cpu_blocks=OFFLOAD["num_cpu_blocks"]),
            env={"VLLM_ASCEND_KV_OFFLOAD_FAULTS": FAULTS},
            kv_load_failure_policy="recompute",
        ),
    }
    return run_sequence(scenario_dir, "stress", scenarios, env=IN_PROCESS_ENV)


def _compare(result: dict, reference: dict) -> list[int]:
    """Indices of non-aborted requests whose tokens differ from the reference."""
    skip = set(result["aborted"]) | set(reference["aborted"])
    expected = reference["outputs"]
    mismatches = []
    for i in range(NUM_REQUESTS):
        if i in skip:
            continue
        got = result["outputs"][str(i)]
        assert got["finish_reason"] == "length", (i, got)
        if got["token_ids"] != expected[str(i)]["token_ids"]:
            mismatches.append(i)
    return mismatches


def _check_clean_shutdown(result: dict) -> None:
    shutdown = result["shutdown"]
    assert shutdown["threads"] == []
    assert shutdown["pool_released"]
    assert shutdown["seconds"] < 30


def test_stress_offloading_changes_no_output(runs):
    result = runs["offload"]
    assert result["aborted"] == runs["reference"]["aborted"]
    assert len(result["aborted"]) >= 10
    assert _compare(result, runs["reference"]) == []
    counters = result["counters"]
    # It was a stress: preemptions, CPU hits, and far more stored than fits.
    assert counters["vllm:num_preemptions"] > 0
    assert counters["vllm:kv_offload_load_bytes"] > 0
    block_bytes = counters["vllm:kv_offload_store_bytes"] / OFFLOAD["num_cpu_blocks"]
    assert block_bytes > 4 * 131072  # over 4x the pool went through it
    _check_clean_shutdown(result)


def test_stress_with_transfer_faults_changes_no_output(runs):
    result = runs["faults"]
    assert _compare(result, runs["reference"]) == []
    assert result["shutdown"]["faults_injected"] >= 10
    _check_clean_shutdown(result)
