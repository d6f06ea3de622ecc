"""Serving benchmark: ``vllm serve`` with offloading off and on, driven by
vLLM's own benchmark client (docs/serving_benchmark.md).

    python benchmarks/bench_serving.py --preset issue26 --json out.json
    python benchmarks/bench_serving.py --quick            # a smoke run
    python benchmarks/bench_serving.py --from-json out.json --plot-dir DIR

Each round starts ``vllm serve`` twice, offloading off and on (the guide's
``--kv-transfer-config``, every other flag the same; the order alternates
between rounds), runs every workload against it (``serving_workloads``:
prefix reuse quiet and beside one busy core, one shared prefix, no reuse, a
multi-turn replay; both prefix caches emptied before each) and stops it.
Per workload it records the client's figures, ``/metrics`` deltas, the
server's RSS and the 1-minute load average; then fixed prompts are sent
twice (greedy, the device cache emptied between) and their token ids
compared across servers. The report (``serving_report``) gives the ratios
on/off per round and checks a goal set (``--goals``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script

from benchmarks import serving_report as report  # noqa: E402
from benchmarks import serving_workloads as wl  # noqa: E402
from benchmarks.common import (  # noqa: E402
    SMALL_MODEL,
    add_int_args,
    add_model_args,
    add_output_args,
    cpu_hog,
    load_samples,
    model_args,
    write_json,
)
from benchmarks.serving_server import ServingServer, counter_deltas, serve_flags  # noqa: E402
from vllm_ascend.kv_offload.testing.server import serve_command  # noqa: E402

# Flag defaults each preset sets (flags given beside it still win).
PRESETS = {
    # A smoke run: one round of every workload kind, a small cache.
    "quick": dict(
        rounds=1, concurrency=[4], device_blocks=24, repeats=2,
        mt_conversations=2, mt_turns=2, greedy_prompts=2,
    ),
    # Issue 26's shape: a 6-layer fp32 model, 128 device blocks of 128
    # tokens, 32 prefixes of 1,024 tokens (+128-token suffixes: ~2.25x the
    # device cache), 96 prompts at 8 and 16 concurrent, quiet and beside
    # one busy core, and no reuse; the guide's config as is (1,000 CPU
    # blocks); two alternating rounds; issue 26's goals.
    "issue26": dict(
        layers=6, device_blocks=128, prefix_len=1024, suffix_len=128,
        working_set=2.0, repeats=3, concurrency=[8, 16], rounds=2,
        cpu_blocks=1000, only=["prefix_repetition", "hog", "no_reuse"],
        goals="issue26",
    ),
}  # fmt: skip
# Integer flags: default, or (default, help).
INT_FLAGS = {
    "device-blocks": (96, "device KV cache, blocks of 128 tokens"),
    "cpu-blocks": (0, "num_cpu_blocks (default: twice the working set's blocks)"),
    "prefix-len": 512, "suffix-len": 64, "output-len": 16,
    "repeats": (3, "prompts per prefix"), "max-model-len": 2048,
    "mt-conversations": 8, "mt-turns": 3, "mt-clients": 4, "mt-system-len": 256,
    "greedy-prompts": 8, "greedy-tokens": 16, "seed": 0,
}  # fmt: skip
WORKING_SET_HELP = "distinct prefixes' tokens / device cache tokens"


def run_workload(server: ServingServer, model: str, w: wl.Workload, args, seed, log):
    """One workload against ``server``, both prefix caches emptied first."""
    server.reset_caches()
    before = server.metrics()
    t0 = time.perf_counter()
    hog = cpu_hog(args.hog_s) if w.kind == "hog" else contextlib.nullcontext()
    with load_samples() as load, hog:
        if w.kind == "multi_turn":
            outs, dur = asyncio.run(wl.multi_turn(server.base, model, args, seed))
            bench = wl.summarize_requests(outs, dur)
        else:
            bench = wl.run_bench_serve(server.base, model, w, seed, log)
    seconds = time.perf_counter() - t0
    time.sleep(1)  # the last step's stats reach /metrics
    return {
        "bench": bench,
        "counters": counter_deltas(before, server.metrics()),
        "rss_gib": server.rss_bytes() / 2**30,
        "seconds": seconds,
        "loadavg_1m": [s[0] for s in load],
    }


def greedy_outputs(server: ServingServer, model: str, n: int, max_tokens: int):
    """Each prompt twice; the device prefix cache emptied in between, so that
    with offloading the second pass loads its documents from the CPU pool."""
    prompts = wl.fixed_prompts(n)
    first = [server.complete(model, p, max_tokens) for p in prompts]
    server.reset_caches(external=False)
    second = [server.complete(model, p, max_tokens) for p in prompts]
    return [first, second]


def print_record(tag: str, rec: dict) -> None:
    b = rec["bench"]
    print(
        f"[{tag}] {rec['workload']:24s} {b['req_per_s']:6.2f} req/s "
        f"TTFT med {b['ttft_median_ms']:8.0f} p99 {b['ttft_p99_ms']:8.0f} "
        f"max {b['ttft_max_ms'] or 0:8.0f} ms TPOT {b['tpot_mean_ms']:6.1f} ms "
        f"failed {b['failed']:.0f} cpu-hit {rec['counters']['cpu_hit_tokens']:.0f} "
        f"load {report.peak_load(rec):.1f} ({rec['seconds']:.0f} s)",
        flush=True,
    )


def run_server(args, model, sizes, plan, rnd: int, offload: bool, log_dir, result):
    """One server's round: start, every workload, the greedy check, stop.
    Records go into ``result`` as they are measured."""
    tag = f"r{rnd}-{'on' if offload else 'off'}"
    (log_dir / tag).mkdir(exist_ok=True)
    flags = serve_flags(
        sizes.device_blocks, max(args.concurrency + [args.mt_clients]),
        sizes.cpu_blocks if offload else None, args.dtype, args.max_model_len,
    )  # fmt: skip
    server = ServingServer(serve_command(model, flags), log_dir / f"server-{tag}.log")
    info = {"round": rnd, "offload": offload}
    try:
        info["start_s"] = server.wait_ready()
        info["omp_binding"] = server.omp_binding()
        print(f"[{tag}] OpenMP binding {info['omp_binding']}", flush=True)
        for w in plan:
            log = log_dir / tag / f"{w.name}.log"
            rec = run_workload(server, model, w, args, args.seed + rnd, log)
            rec.update(
                round=rnd, offload=offload, workload=w.name, kind=w.kind,
                concurrency=w.concurrency,
            )  # fmt: skip
            result["records"].append(rec)
            print_record(tag, rec)
        result["greedy"][tag] = greedy_outputs(
            server, model, args.greedy_prompts, args.greedy_tokens
        )
    finally:
        info.update(server.stop())
        result["servers"].append(info)


def summarize(result: dict, goal_set: str) -> dict:
    """Pairs, goals and the greedy check of the recorded numbers."""
    result["pairs"] = report.pair_rounds(result["records"])
    result["goal_set"] = goal_set
    result["goals"] = report.check_goals(result["pairs"], report.GOALS[goal_set])
    result["greedy_differing"] = report.greedy_differences(result.get("greedy", {}))
    return result


def run(args) -> dict:
    model_spec = model_args(args)
    model = model_spec.ensure(max_positions=max(8192, 2 * args.max_model_len))
    sizes = wl.Sizes.of(args)
    plan = wl.workloads(args, sizes)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_serving."))
    log_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "command": " ".join(sys.argv),
        "model": {**asdict(model_spec), "params": model_spec.num_params()},
        "dtype": args.dtype,
        "sizes": {**asdict(sizes), "num_prefixes": sizes.num_prefixes},
        "workloads": [asdict(w) for w in plan],
        "nproc": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "records": [],
        "servers": [],
        "greedy": {},
    }
    estimate = wl.estimate_seconds(plan, 2 * args.rounds, model_spec.layers)
    print(
        f"[bench_serving] model {model_spec.num_params() / 1e6:.1f} M params, "
        f"device cache {sizes.device_blocks} blocks, {sizes.num_prefixes} "
        f"prefixes x {sizes.prefix_len} tokens (working set "
        f"{sizes.working_set:g}x), CPU pool {sizes.cpu_blocks} blocks; "
        f"{len(plan)} workloads x {2 * args.rounds} servers: about "
        f"{estimate / 60:.0f} min on a quiet 2-core host (an estimate); "
        f"logs {log_dir}",
        flush=True,
    )
    t_start = time.perf_counter()
    for rnd in range(args.rounds):
        for offload in (False, True) if rnd % 2 == 0 else (True, False):
            try:
                run_server(args, model, sizes, plan, rnd, offload, log_dir, result)
            finally:
                if args.json:  # what has been measured so far survives
                    write_json(args.json, result)
    result["seconds"] = time.perf_counter() - t_start
    result["loadavg_end"] = os.getloadavg()
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="a run's shape")
    p.add_argument("--quick", action="store_true", help="--preset quick")
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternating")
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    add_int_args(p, INT_FLAGS)
    p.add_argument("--working-set", type=float, default=2.0, help=WORKING_SET_HELP)
    p.add_argument("--hog-s", type=float, default=900, help="CPU hog's time limit")
    p.add_argument("--only", nargs="+", choices=wl.KINDS, help="only these kinds")
    p.add_argument("--goals", default="issue26", choices=sorted(report.GOALS))
    add_output_args(p, logs="server/client logs")
    p.add_argument("--plot-dir", type=Path, default=None, help="PNG figures here")
    p.add_argument(
        "--from-json", type=Path, help="no run: report (and plot) an earlier --json"
    )
    add_model_args(p, SMALL_MODEL)
    args = p.parse_args(argv)
    preset = "quick" if args.quick else args.preset
    if preset:
        p.set_defaults(**PRESETS[preset])
        args = p.parse_args(argv)
    if args.prefix_len % wl.BLOCK_TOKENS:
        p.error(f"--prefix-len must be a multiple of {wl.BLOCK_TOKENS}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json is not None:
        result = summarize(json.loads(args.from_json.read_text()), args.goals)
    else:
        result = summarize(run(args), args.goals)
        if args.json:
            write_json(args.json, result)
    print(report.report_markdown(result))
    print(
        f"\nload average at start {result['loadavg_start']}, at end "
        f"{result['loadavg_end']}; {result['nproc']} CPUs; "
        f"{result['seconds']:.0f} s"
    )
    try:  # matplotlib: a benchmark-only dependency, the figures are optional
        for path in report.plot(result, args.plot_dir) if args.plot_dir else []:
            print(f"figure: {path}")
    except ImportError:
        print(
            "--plot-dir: matplotlib is not installed (pip install matplotlib); "
            "no figures written, the JSON and the table above are complete",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
