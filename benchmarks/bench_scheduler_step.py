"""Scheduler-side cost of the offloading connector per engine step.

vLLM's own ``Scheduler`` (no engine, no model runner, no worker) schedules
synthetic requests with an ``OffloadingConnector`` built by vLLM's connector
factory, as the engine core builds it; the workers' side is played by
reporting every transfer job of a step as finished in the next step. Two
configurations, each measured in the same process, in alternating rounds:

* ``ours``: the guide's config (``NPUOffloadingSpec``): our connector variant
  (``AscendOffloadingConnector``) over vLLM's ``CPUOffloadingManager``
  wrapped in ``FailureAwareManager``;
* ``vllm``: vLLM's ``CPUOffloadingSpec``: vLLM's ``OffloadingConnector`` and
  ``CPUOffloadingManager`` as vLLM ships them.

Measured: the CPU time of the scheduler thread (``time.thread_time_ns``:
what other processes take of the cores does not count) spent inside the
connector's scheduler-side hooks, timed by the serving profile's probe
(``serving_probe``)
(``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``update_connector_output``, ``request_finished``)
per step, over the steps where ``--requests`` requests run: the prefill step
(every prompt block stored) and the decode steps, where each request stores
a block every ``block_size`` tokens (``offload_prompt_only=False``; prompt
lengths are staggered, so a sixteenth of them do in each step). Nothing
fails: this is the path every step takes.

    python -m benchmarks.bench_scheduler_step --requests 256 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from benchmarks.common import add_int_args
from benchmarks.serving_probe import sitecustomize as probe
from benchmarks.serving_probe.sitecustomize import SCHEDULER_HOOKS
from vllm_ascend.kv_offload.testing.engine import GUIDE_EXTRA_CONFIG

BLOCK_SIZE = 16
HOOKS = SCHEDULER_HOOKS[:5]  # those a step without failures calls
CONFIGS = {
    "ours": {k: GUIDE_EXTRA_CONFIG[k] for k in ("spec_name", "spec_module_path")},
    "vllm": {"spec_name": "CPUOffloadingSpec"},
}


def _scheduler(impl: str, args: argparse.Namespace):
    import torch
    from vllm import config as vc
    from vllm.v1 import kv_cache_interface as kv
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model

    max_len = args.prompt_tokens + args.output_tokens + BLOCK_SIZE
    # Every request's blocks fit on the device: nothing is preempted.
    num_blocks = args.requests * (max_len // BLOCK_SIZE + 1) + 16
    spec = kv.FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.float32
    )
    page, layers = spec.page_size_bytes, ["layers.0.attn"]
    size = page * num_blocks
    kv_cache_config = kv.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            kv.KVCacheTensor(
                size=size, layers=layers, layer_stride=size, block_stride=page
            )
        ],
        kv_cache_groups=[kv.KVCacheGroupSpec(layers, spec)],
    )
    extra = {
        **CONFIGS[impl],
        "cpu_bytes_to_use": args.cpu_blocks * page,
        "block_size": BLOCK_SIZE,
        "offload_prompt_only": False,  # output blocks too: every step stores some
    }
    vllm_config = vc.VllmConfig(
        model_config=vc.ModelConfig(
            model=str(ensure_tiny_model()), dtype="float32", max_model_len=max_len
        ),
        cache_config=vc.CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=vc.SchedulerConfig(
            max_num_seqs=args.requests,
            max_num_batched_tokens=args.requests * args.prompt_tokens,
            max_model_len=max_len,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=vc.KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=False,
    )


def _hook_cpu_ns() -> int:
    """CPU time the probe's wrappers of ``HOOKS`` have counted so far."""
    stats = probe.snapshot()["stats"]
    return sum(stats.get(name, [0, 0, 0])[2] for name in HOOKS)


def _requests(args: argparse.Namespace, round_idx: int) -> list[Any]:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    return [
        Request(
            request_id=f"r{round_idx}-{i}",
            # Distinct prompts: every block is new to the CPU pool. Lengths
            # staggered over a block: each step, 1/16 of them fill a block.
            prompt_token_ids=[
                (i * 7 + t + round_idx) % 500
                for t in range(args.prompt_tokens + i % BLOCK_SIZE)
            ],
            sampling_params=params,
            pooling_params=None,
            block_hasher=hasher,
        )
        for i in range(args.requests)
    ]


def run_once(impl: str, args: argparse.Namespace, round_idx: int) -> dict[str, Any]:
    """One batch of requests from arrival to the end of their output; the
    connector's time per step while all of them run."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    scheduler = _scheduler(impl, args)
    connector = scheduler.connector
    for name in HOOKS:  # (nested hook calls are not counted twice)
        setattr(connector, name, probe.timed(name, getattr(connector, name)))
    for request in _requests(args, round_idx):
        scheduler.add_request(request)
    per_step: list[float] = []
    prev_jobs: list[int] = []
    stores = loads = 0
    while scheduler.has_requests():
        spent = _hook_cpu_ns()
        out = scheduler.schedule()
        meta = out.kv_connector_metadata
        worker_meta = OffloadingWorkerMetadata()
        for job_id in prev_jobs:
            worker_meta.mark_completed(job_id)
        prev_jobs = [*meta.load_jobs, *meta.store_jobs]
        stores, loads = stores + len(meta.store_jobs), loads + len(meta.load_jobs)
        req_ids = list(out.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[1] for _ in req_ids],
            kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=worker_meta),
        )
        scheduler.update_from_output(out, runner_output)
        if len(req_ids) == args.requests:
            per_step.append((_hook_cpu_ns() - spent) / 1e9)
    return {
        "impl": impl,
        "connector": type(connector).__name__,
        "steps": len(per_step),
        "store_jobs": stores,
        "load_jobs": loads,
        "mean_us": statistics.fmean(per_step) * 1e6,
        "median_us": statistics.median(per_step) * 1e6,
        # The prefill step stores every prompt block (prepare_store) and the
        # next one completes those stores (complete_store).
        "prefill_us": sum(per_step[:2]) * 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_int_args(p, {"requests": 256, "prompt-tokens": 256, "output-tokens": 128,
                     "cpu-blocks": 100_000, "rounds": (5, "A/B rounds")})  # fmt: skip
    p.add_argument("--impl", choices=["ours", "vllm", "both"], default="both")
    p.add_argument("--json", action="store_true", help="one JSON line per run")
    args = p.parse_args()

    from vllm_ascend.kv_offload import plugin

    plugin.register()  # what vLLM's general plugins do at start-up
    impls = ["ours", "vllm"] if args.impl == "both" else [args.impl]
    load_start = os.getloadavg()
    rows = []
    for r in range(args.rounds):
        # Alternate which goes first, so drift in the machine's load
        # falls on both alike.
        for impl in impls if r % 2 == 0 else impls[::-1]:
            row = run_once(impl, args, r)
            rows.append(row)
            if args.json:
                print(json.dumps(row))
            else:
                print(
                    f"round {r} {impl:5s} ({row['connector']}): "
                    f"{row['median_us']:8.0f} us/step median, "
                    f"{row['mean_us']:8.0f} mean over {row['steps']} steps "
                    f"({row['store_jobs']} store jobs); prefill + next step "
                    f"{row['prefill_us']:.0f} us"
                )
    print(f"load average: start {load_start}, end {os.getloadavg()}")
    for impl in impls:
        medians = [row["median_us"] for row in rows if row["impl"] == impl]
        prefills = [row["prefill_us"] for row in rows if row["impl"] == impl]
        print(
            f"{impl}: median of round medians {statistics.median(medians):.0f} "
            f"us/step with {args.requests} running requests "
            f"(rounds: {', '.join(f'{m:.0f}' for m in medians)}); prefill + "
            f"next step {statistics.median(prefills):.0f} us"
        )


if __name__ == "__main__":
    main()
