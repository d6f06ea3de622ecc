"""Serving benchmark: ``vllm serve`` with offloading off and on, driven by
vLLM's own benchmark client.

    python benchmarks/bench_serving.py                    # the docs' run
    python benchmarks/bench_serving.py --quick            # a smoke run
    python benchmarks/bench_serving.py --from-json out.json --plot-dir DIR

Each round starts ``vllm serve`` (its module: ``testing.server``) twice, once
without and once with the guide's ``--kv-transfer-config`` (every other flag
the same; the order alternates between rounds), runs every workload against
it and stops it with SIGINT. Workloads (the device and CPU prefix caches are
emptied before each, ``POST /reset_prefix_cache?reset_external=true``):

* ``prefix_repetition``: ``vllm bench serve --dataset-name prefix_repetition``
  (vLLM's own client, in this process: ``run_bench_serve``)
  with as many distinct prefixes as fill ``--working-set`` times the device
  KV cache, at each ``--concurrency``;
* ``hog``: the same at the first concurrency with a CPU hog (one busy
  process, ``--hog-s`` at most) beside the server;
* ``shared_prefix``: ``--dataset-name random`` with one shared prefix;
* ``no_reuse``: ``--dataset-name random``, every prompt unique;
* ``multi_turn``: a replay in the shape of vLLM's multi-turn benchmark
  (``benchmarks/multi_turn`` in vLLM's repository, not in the wheel):
  conversations with a shared system prompt, user turns of 120-160 tokens
  and answers of 80-120, several concurrent clients, each sending its
  conversation's turns in order with the history as the prompt; requests go
  through vLLM's client (``vllm.benchmarks.lib.endpoint_request_func``).

Per workload it records what ``bench serve`` reports (request and output
throughput, TTFT mean/median/p99/max, TPOT, failed requests), the
``/metrics`` deltas (prompt tokens cached on the device and in host memory,
preemptions) and the server's RSS (all its processes); per round the ratio
on/off of each. At the end of each server's round, fixed prompts are sent
twice (greedy; the device prefix cache emptied between, so the second pass
reads the CPU pool) and their token ids compared across servers.
``VLLM_CPU_NUM_OF_RESERVED_CPU`` is left to vLLM and our plugin unless
``--reserved-cpus`` sets it (0 is what vLLM did on 2 cores before the
plugin's fix). ``--unpatched`` adds a third server per round, offloading on
with ``VLLM_CPU_NUM_OF_RESERVED_CPU=2``: what vLLM asks for with a KV
connector and one rank, which our plugin leaves alone when set explicitly,
so that server runs as before the plugin's correction (the "before" of
docs/serving_benchmark.md's busy-host section). Each server's OpenMP binding
is read from its log (vLLM's "OpenMP thread binding info").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    SMALL_MODEL,
    add_model_args,
    loadavg,
    model_args,
    percentile,
)
from vllm_ascend.kv_offload.testing import server  # noqa: E402

# `vllm bench serve` is vllm.benchmarks.serve's parser and main, what the
# CLI subcommand runs (run_bench_serve); the server is testing.server's.
BLOCK_TOKENS = 128  # the guide's block_size, also the device block size here
START_TIMEOUT_S = 600
STOP_TIMEOUT_S = 120
# /metrics counters recorded per workload (summed over labels but source).
COUNTERS = {
    "device_hit_tokens": "vllm:prompt_tokens_cached_by_source_total{source=device}",
    "cpu_hit_tokens": "vllm:prompt_tokens_cached_by_source_total{source=host}",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
    "load_bytes": "vllm:kv_offload_load_bytes_total",
    "store_bytes": "vllm:kv_offload_store_bytes_total",
}
# bench serve's result keys -> ours.
BENCH_KEYS = {
    "completed": "completed",
    "failed": "failed",
    "request_throughput": "req_per_s",
    "output_throughput": "out_tok_per_s",
    "mean_ttft_ms": "ttft_mean_ms",
    "median_ttft_ms": "ttft_median_ms",
    "p99_ttft_ms": "ttft_p99_ms",
    "p100_ttft_ms": "ttft_max_ms",
    "mean_tpot_ms": "tpot_mean_ms",
    "median_tpot_ms": "tpot_median_ms",
}
# Ratios on/off reported, and what "better" means for the goals.
RATIO_KEYS = (
    "req_per_s",
    "out_tok_per_s",
    "ttft_median_ms",
    "ttft_p99_ms",
    "ttft_max_ms",
    "tpot_mean_ms",
)
# Issue 18's goals: (workload kind, ratio key, bound, "min"|"max").
GOALS = [
    ("prefix_repetition", "req_per_s", 1.5, "min"),
    ("prefix_repetition", "ttft_median_ms", 0.5, "max"),
    ("prefix_repetition", "ttft_p99_ms", 1.0, "max"),
    ("prefix_repetition", "tpot_mean_ms", 1.0, "max"),
    ("hog", "req_per_s", 1.5, "min"),
    ("hog", "ttft_median_ms", 0.5, "max"),
    ("hog", "ttft_p99_ms", 1.0, "max"),
    ("hog", "tpot_mean_ms", 1.0, "max"),
    ("no_reuse", "req_per_s", 0.98, "min"),
    ("no_reuse", "tpot_mean_ms", 1.02, "max"),
]


# --------------------------------------------------------------------------
# Parsing and arithmetic (unit-tested, no engine)
# --------------------------------------------------------------------------


def prometheus_totals(text: str) -> dict[str, float]:
    """Every sample of a /metrics page, summed over labels except ``source``."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if "source" in sample.labels:
                name += f"{{source={sample.labels['source']}}}"
            totals[name] = totals.get(name, 0.0) + sample.value
    return totals


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict:
    return {k: after.get(n, 0.0) - before.get(n, 0.0) for k, n in COUNTERS.items()}


def parse_bench_result(result: dict) -> dict:
    """The figures we keep from ``bench serve --save-result``'s JSON."""
    # bench serve's figures may be numpy scalars: plain floats for JSON.
    out = {
        ours: None if result.get(theirs) is None else float(result[theirs])
        for theirs, ours in BENCH_KEYS.items()
    }
    missing = [k for k in ("request_throughput", "completed") if k not in result]
    if missing:
        raise ValueError(f"not a bench serve result (no {missing})")
    return out


def summarize_requests(outputs: list[dict], duration_s: float) -> dict:
    """bench serve's figures for requests we sent ourselves (multi-turn):
    ``outputs`` are vLLM's ``RequestFuncOutput`` fields as dicts."""
    ok = [o for o in outputs if o["success"]]
    ttft = [o["ttft"] * 1e3 for o in ok]
    tpot = [
        (o["latency"] - o["ttft"]) / (o["output_tokens"] - 1) * 1e3
        for o in ok
        if o["output_tokens"] > 1
    ]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "req_per_s": len(ok) / duration_s,
        "out_tok_per_s": sum(o["output_tokens"] for o in ok) / duration_s,
        "ttft_mean_ms": mean(ttft),
        "ttft_median_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "ttft_max_ms": max(ttft, default=float("nan")),
        "tpot_mean_ms": mean(tpot),
        "tpot_median_ms": percentile(tpot, 50),
    }


def ratios(off: dict, on: dict) -> dict[str, float]:
    """on / off for each ratio key both sides have (nan where off is 0)."""
    out = {}
    for key in RATIO_KEYS:
        a, b = off.get(key), on.get(key)
        if a is None or b is None:
            continue
        out[key] = b / a if a else float("nan")
    return out


def check_goals(results: list[dict]) -> list[dict]:
    """Each goal against every measured (round, workload) of its kind: met
    only if every ratio measured meets it."""
    rows = []
    for kind, key, bound, sense in GOALS:
        seen = [
            r["ratios"][key]
            for r in results
            if r["kind"] == kind and key in r.get("ratios", {})
        ]
        if not seen:
            continue
        worst = min(seen) if sense == "min" else max(seen)
        met = worst >= bound if sense == "min" else worst <= bound
        rows.append(
            {
                "kind": kind,
                "ratio": key,
                "goal": f"{'>=' if sense == 'min' else '<='} {bound:g}",
                "measured": seen,
                "met": bool(met),
            }
        )
    return rows


# The server variants of a round: offloading off, on (vLLM's reservation as
# our plugin corrects it), and on with vLLM's own reservation (--unpatched).
UNPATCHED = "on_unpatched"
RATIO_FIELD = {"on": "ratios", UNPATCHED: "ratios_unpatched"}
# VLLM_CPU_NUM_OF_RESERVED_CPU of the --unpatched server: what vLLM reserves
# for one rank with a KV connector (cpu_threads.RESERVED_WITH_CONNECTOR).
UNPATCHED_RESERVED_CPUS = 2


def record_variant(rec: dict) -> str:
    return rec.get("variant") or ("on" if rec["offload"] else "off")


def parse_omp_binding(log_text: str) -> dict | None:
    """Rank 0's OpenMP cores and the reserved cores from vLLM's "OpenMP thread
    binding info" log lines (``OMPProcessManager``), or None if absent."""
    import re

    cores = re.search(r"local_rank=0, core ids=\[([0-9, ]*)\]", log_text)
    reserved = re.search(r"reserved_cpus=\[([0-9, ]*)\]", log_text)
    if cores is None or reserved is None:
        return None

    def ids(m):
        return [int(x) for x in m.group(1).replace(" ", "").split(",") if x]

    return {"omp_cores": ids(cores), "reserved_cpus": ids(reserved)}


def pair_rounds(records: list[dict]) -> list[dict]:
    """Joins off and on records of the same round and workload; adds ratios."""
    by_key: dict[tuple, dict] = {}
    for rec in records:
        key = (rec["round"], rec["workload"])
        by_key.setdefault(key, {"round": rec["round"], "workload": rec["workload"]})
        by_key[key]["kind"] = rec["kind"]
        by_key[key]["concurrency"] = rec["concurrency"]
        by_key[key][record_variant(rec)] = rec
    pairs = []
    for key in sorted(by_key):
        p = by_key[key]
        if "off" in p:
            for variant in ("on", UNPATCHED):
                if variant in p:
                    p[RATIO_FIELD[variant]] = ratios(
                        p["off"]["bench"], p[variant]["bench"]
                    )
        pairs.append(p)
    return pairs


# --------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # prefix_repetition | hog | shared_prefix | no_reuse | multi_turn
    concurrency: int
    num_prompts: int
    dataset_args: tuple[str, ...] = ()


@dataclass
class Sizes:
    """Request and cache sizes, derived from the command line."""

    device_blocks: int
    working_set: float
    prefix_len: int
    suffix_len: int
    output_len: int
    repeats: int
    num_prefixes: int = field(init=False)
    cpu_blocks: int = field(init=False)

    def __post_init__(self):
        ws_tokens = self.working_set * self.device_blocks * BLOCK_TOKENS
        self.num_prefixes = max(1, round(ws_tokens / self.prefix_len))
        # The working set's prefix blocks plus their suffixes' full blocks,
        # twice over: the CPU pool holds it all (the point of the test).
        per_prompt = (self.prefix_len + self.suffix_len) // BLOCK_TOKENS
        self.cpu_blocks = 2 * self.num_prefixes * self.repeats * per_prompt


def workloads(args: argparse.Namespace, sizes: Sizes) -> list[Workload]:
    rep = (
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        str(sizes.prefix_len),
        "--prefix-repetition-suffix-len",
        str(sizes.suffix_len),
        "--prefix-repetition-num-prefixes",
        str(sizes.num_prefixes),
        "--prefix-repetition-output-len",
        str(sizes.output_len),
    )
    n_rep = sizes.num_prefixes * sizes.repeats
    out: list[Workload] = []
    for c in args.concurrency:
        out.append(
            Workload(f"prefix_repetition_c{c}", "prefix_repetition", c, n_rep, rep)
        )
    if not args.skip_hog:
        c = args.concurrency[-1]
        out.append(Workload(f"hog_c{c}", "hog", c, n_rep, rep))
    random_len = sizes.prefix_len + sizes.suffix_len
    n_small = max(2 * max(args.concurrency), n_rep // 3)
    out.append(
        Workload(
            f"shared_prefix_c{args.concurrency[-1]}",
            "shared_prefix",
            args.concurrency[-1],
            n_small,
            (
                "--dataset-name",
                "random",
                "--random-prefix-len",
                str(sizes.prefix_len),
                "--random-input-len",
                str(sizes.suffix_len),
                "--random-output-len",
                str(sizes.output_len),
                "--random-range-ratio",
                "0",
            ),
        )
    )
    for c in args.concurrency:
        out.append(
            Workload(
                f"no_reuse_c{c}",
                "no_reuse",
                c,
                n_small,
                (
                    "--dataset-name",
                    "random",
                    "--random-input-len",
                    str(random_len),
                    "--random-output-len",
                    str(sizes.output_len),
                    "--random-range-ratio",
                    "0",
                ),
            )
        )
    if not args.skip_multi_turn:
        out.append(
            Workload(
                f"multi_turn_c{args.mt_clients}",
                "multi_turn",
                args.mt_clients,
                args.mt_conversations * args.mt_turns,
            )
        )
    if args.only:
        out = [w for w in out if w.kind in args.only]
    return out


# --------------------------------------------------------------------------
# Server and client processes
# --------------------------------------------------------------------------


def offload_config(cpu_blocks: int) -> str:
    """The guide's --kv-transfer-config, with a pool sized for the run."""
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "num_cpu_blocks": cpu_blocks,
                "block_size": BLOCK_TOKENS,
                "spec_name": "NPUOffloadingSpec",
                "spec_module_path": "vllm_ascend.kv_offload.npu",
            },
        }
    )


class Server(server.Server):
    def __init__(
        self,
        args,
        model: str,
        sizes: Sizes,
        offload: bool,
        log: Path,
        reserved_cpus: int | None = None,
    ):
        flags = [
            "--dtype",
            args.dtype,
            "--enforce-eager",
            "--block-size",
            str(BLOCK_TOKENS),
            "--max-model-len",
            str(args.max_model_len),
            "--num-gpu-blocks-override",
            str(sizes.device_blocks),
            "--max-num-seqs",
            str(max(args.concurrency + [args.mt_clients])),
            "--seed",
            "0",
        ]
        if offload:
            flags += ["--kv-transfer-config", offload_config(sizes.cpu_blocks)]
        env = {
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
        }
        if reserved_cpus is None:
            reserved_cpus = args.reserved_cpus
        if reserved_cpus is not None:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cpus)
        super().__init__(server.serve_command(model, flags), log, env, REPO)

    def wait_ready(self) -> float:
        return super().wait_ready(START_TIMEOUT_S)

    def metrics(self) -> dict[str, float]:
        return prometheus_totals(self.get("/metrics").decode())

    def reset_caches(self) -> None:
        deadline = time.monotonic() + 120
        while True:
            body = self.post("/reset_prefix_cache?reset_external=true", timeout=60)
            if body.get("success", True):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"reset_prefix_cache kept failing: {body}")
            time.sleep(0.5)  # refused while transfers are in flight

    def reset_device_cache(self) -> None:
        self.post("/reset_prefix_cache", timeout=60)

    def rss_bytes(self) -> int:
        try:
            procs = [self.proc, *self.proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def complete(self, model: str, prompt: str, max_tokens: int) -> list[int]:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        return self.post("/v1/completions", body)["choices"][0]["token_ids"]

    def stop(self) -> dict:
        return super().stop(timeout_s=STOP_TIMEOUT_S)


class LoadSampler:
    """Samples /proc/loadavg every few seconds while a workload runs."""

    def __init__(self, period_s: float = 5.0):
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._period = period_s
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while True:
            self.samples.append(loadavg())
            if self._stop.wait(self._period):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class CpuHog:
    """One busy process beside the server, ended after ``seconds`` at most."""

    CODE = (
        "import sys, time\n"
        "end = time.time() + float(sys.argv[1])\n"
        "while time.time() < end: pass"
    )

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.CODE, str(self.seconds)]
        )
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=30)


def bench_serve_argv(server: Server, model: str, w: Workload, seed: int) -> list:
    """``vllm bench serve`` arguments for workload ``w``."""
    return [
        "--backend",
        "vllm",
        "--base-url",
        server.base,
        "--model",
        model,
        "--tokenizer",
        model,
        *w.dataset_args,
        "--num-prompts",
        str(w.num_prompts),
        "--max-concurrency",
        str(w.concurrency),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,e2el",
        "--metric-percentiles",
        "50,99,100",
        "--disable-tqdm",
    ]


def run_bench_serve(
    server: Server, model: str, w: Workload, seed: int, log: Path
) -> dict:
    """vLLM's ``vllm bench serve`` in this process (its client start-up, tens
    of seconds on a busy 2-core host, is paid once); its report to ``log``."""
    import contextlib

    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    bench_args = parser.parse_args(bench_serve_argv(server, model, w, seed))
    with open(log, "a") as f, contextlib.redirect_stdout(f):
        result = bench_main(bench_args)
    return parse_bench_result(result)


def conversation_texts(args, seed: int) -> tuple[str, list[list[tuple[str, int]]]]:
    """The shared system prompt and, per conversation, (user turn, answer
    length) pairs: user turns of 120-160 words (= tokens of the word-level
    tokenizer), answers of 80-120 tokens."""
    from vllm_ascend.kv_offload.testing.tiny_model import make_prompt

    rng = random.Random(seed)
    system = make_prompt(args.mt_system_len, seed=seed)
    convs = []
    for c in range(args.mt_conversations):
        turns = []
        for t in range(args.mt_turns):
            n_in = rng.randint(120, 160)
            turns.append(
                (
                    make_prompt(n_in, seed=seed * 100003 + c * 101 + t),
                    rng.randint(80, 120),
                )
            )
        convs.append(turns)
    return system, convs


async def _multi_turn(
    server: Server, model: str, args, seed: int
) -> tuple[list, float]:
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        async_request_openai_completions,
    )

    system, convs = conversation_texts(args, seed)
    todo: asyncio.Queue = asyncio.Queue()
    for conv in convs:
        todo.put_nowait(conv)
    outputs: list[dict] = []

    async def client(session):
        while not todo.empty():
            conv = todo.get_nowait()
            history = system
            for user, answer_len in conv:
                history = f"{history} {user}"
                out = await async_request_openai_completions(
                    RequestFuncInput(
                        prompt=history,
                        api_url=server.base + "/v1/completions",
                        prompt_len=len(history.split()),
                        output_len=answer_len,
                        model=model,
                        ignore_eos=True,
                        extra_body={"temperature": 0.0},
                    ),
                    session,
                )
                outputs.append(
                    {
                        "success": out.success,
                        "ttft": out.ttft,
                        "latency": out.latency,
                        "output_tokens": out.output_tokens or answer_len,
                    }
                )
                history = f"{history} {out.generated_text}"

    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(args.mt_clients)))
        return outputs, time.perf_counter() - t0


def run_workload(server: Server, model: str, w: Workload, args, seed, tmp: Path):
    server.reset_caches()
    before = server.metrics()
    hog = CpuHog(args.hog_s) if w.kind == "hog" else None
    t0 = time.perf_counter()
    with LoadSampler() as load:
        if hog:
            hog.__enter__()
        try:
            if w.kind == "multi_turn":
                outputs, dur = asyncio.run(_multi_turn(server, model, args, seed))
                bench = summarize_requests(outputs, dur)
            else:
                bench = run_bench_serve(server, model, w, seed, tmp / f"{w.name}.log")
        finally:
            if hog:
                hog.__exit__(None, None, None)
    seconds = time.perf_counter() - t0
    time.sleep(1)  # the last step's stats reach /metrics
    counters = counter_deltas(before, server.metrics())
    return {
        "bench": bench,
        "counters": counters,
        "rss_gib": server.rss_bytes() / 2**30,
        "seconds": seconds,
        "loadavg_1m": [s[0] for s in load.samples],
    }


def fixed_prompts(n: int) -> list[str]:
    """Greedy check prompts: 2 shared 512-token documents, n/2 questions each."""
    from vllm_ascend.kv_offload.testing.tiny_model import make_prompt

    docs = [make_prompt(4 * BLOCK_TOKENS, seed=900 + d) for d in range(2)]
    return [f"{docs[i % 2]} {make_prompt(24, seed=950 + i)}" for i in range(n)]


def greedy_outputs(server: Server, model: str, n: int, max_tokens: int) -> list:
    """Each prompt twice; the device prefix cache emptied in between, so that
    with offloading the second pass loads its documents from the CPU pool."""
    prompts = fixed_prompts(n)
    first = [server.complete(model, p, max_tokens) for p in prompts]
    server.reset_device_cache()
    second = [server.complete(model, p, max_tokens) for p in prompts]
    return [first, second]


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


def run(args) -> dict:
    model_spec = model_args(args)
    model = model_spec.ensure(max_positions=max(8192, 2 * args.max_model_len))
    sizes = Sizes(
        device_blocks=args.device_blocks,
        working_set=args.working_set,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        output_len=args.output_len,
        repeats=args.repeats,
    )
    plan = workloads(args, sizes)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_serving."))
    log_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "command": " ".join(sys.argv),
        "model": {**asdict(model_spec), "params": model_spec.num_params()},
        "dtype": args.dtype,
        "sizes": asdict(sizes),
        "workloads": [asdict(w) for w in plan],
        "nproc": os.cpu_count(),
        "loadavg_start": loadavg(),
        "records": [],
        "servers": [],
        "greedy": {},
    }
    print(
        f"[bench_serving] model {model_spec.num_params() / 1e6:.1f} M params, "
        f"device cache {sizes.device_blocks} blocks, {sizes.num_prefixes} "
        f"prefixes x {sizes.prefix_len} tokens (working set "
        f"{sizes.working_set:g}x), CPU pool {sizes.cpu_blocks} blocks; "
        f"logs {log_dir}",
        flush=True,
    )
    t_start = time.perf_counter()
    variants = ["off", "on"] + ([UNPATCHED] if args.unpatched else [])
    for rnd in range(args.rounds):
        order = variants if rnd % 2 == 0 else variants[::-1]
        for variant in order:
            offload = variant != "off"
            tag = f"r{rnd}-{variant}"
            tmp = log_dir / tag
            tmp.mkdir(exist_ok=True)
            server = Server(
                args,
                model,
                sizes,
                offload,
                log_dir / f"server-{tag}.log",
                UNPATCHED_RESERVED_CPUS if variant == UNPATCHED else None,
            )
            info = {"round": rnd, "offload": offload, "variant": variant}
            try:
                info["start_s"] = server.wait_ready()
                info["omp_binding"] = parse_omp_binding(
                    server.log_path.read_text(errors="replace")
                )
                print(f"[{tag}] OpenMP binding {info['omp_binding']}", flush=True)
                for w in plan:
                    rec = run_workload(server, model, w, args, args.seed + rnd, tmp)
                    rec.update(
                        round=rnd,
                        offload=offload,
                        variant=variant,
                        workload=w.name,
                        kind=w.kind,
                        concurrency=w.concurrency,
                    )
                    result["records"].append(rec)
                    b = rec["bench"]
                    print(
                        f"[{tag}] {w.name:24s} {b['req_per_s']:6.2f} req/s "
                        f"TTFT med {b['ttft_median_ms']:8.0f} p99 "
                        f"{b['ttft_p99_ms']:8.0f} max {b['ttft_max_ms'] or 0:8.0f} "
                        f"ms TPOT {b['tpot_mean_ms']:6.1f} ms failed {b['failed']} "
                        f"cpu-hit {rec['counters']['cpu_hit_tokens']:.0f} "
                        f"load {max(rec['loadavg_1m'], default=0):.1f} "
                        f"({rec['seconds']:.0f} s)",
                        flush=True,
                    )
                result["greedy"][tag] = greedy_outputs(
                    server, model, args.greedy_prompts, args.greedy_tokens
                )
            finally:
                info.update(server.stop())
                result["servers"].append(info)
                if args.json:  # what has been measured so far survives
                    args.json.write_text(json.dumps(result, indent=1, default=_plain))
    result["seconds"] = time.perf_counter() - t_start
    result["loadavg_end"] = loadavg()
    result["pairs"] = pair_rounds(result["records"])
    result["goals"] = check_goals(result["pairs"])
    result["greedy_differing"] = greedy_differences(result["greedy"])
    return result


def greedy_differences(greedy: dict[str, list]) -> int:
    """Prompt outputs (over both passes) differing from the first server's."""
    tags = sorted(greedy)
    if not tags:
        return 0
    ref = greedy[tags[0]]
    n = 0
    for tag in tags[1:]:
        for pass_ref, pass_other in zip(ref, greedy[tag], strict=True):
            n += sum(a != b for a, b in zip(pass_ref, pass_other, strict=True))
    for passes in greedy.values():  # and within a server, pass 1 vs pass 2
        n += sum(a != b for a, b in zip(passes[0], passes[1], strict=True))
    return n


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def report_markdown(result: dict) -> str:
    lines = [
        "| round | workload | conc. | req/s off → on (×) | TTFT median ms off → on (×) "
        "| TTFT p99 ms (×) | TTFT max ms (×) | TPOT ms (×) | CPU-hit tokens on "
        "| device-hit off / on | preempt. off / on | failed | RSS GiB off / on "
        "| load avg (1 min, max) |",
        "|---" * 14 + "|",
    ]
    rows = [
        (p, variant)
        for variant in ("on", UNPATCHED)
        for p in result["pairs"]
        if variant in p and "off" in p
    ]
    for p, variant in rows:
        off, on, r = p["off"], p[variant], p[RATIO_FIELD[variant]]
        b0, b1 = off["bench"], on["bench"]
        label = p["workload"] + (" (vLLM's reservation)" if variant != "on" else "")

        def cell(key, fmt="{:.0f}", b0=b0, b1=b1, r=r):
            return f"{fmt.format(b0[key])} → {fmt.format(b1[key])} ({r[key]:.2f})"

        lines.append(
            f"| {p['round']} | {label} | {p['concurrency']} "
            f"| {cell('req_per_s', '{:.2f}')} | {cell('ttft_median_ms')} "
            f"| {cell('ttft_p99_ms')} | {cell('ttft_max_ms')} "
            f"| {cell('tpot_mean_ms', '{:.1f}')} "
            f"| {on['counters']['cpu_hit_tokens']:.0f} "
            f"| {off['counters']['device_hit_tokens']:.0f} / "
            f"{on['counters']['device_hit_tokens']:.0f} "
            f"| {off['counters']['preemptions']:.0f} / "
            f"{on['counters']['preemptions']:.0f} "
            f"| {b0['failed']:.0f} / {b1['failed']:.0f} "
            f"| {off['rss_gib']:.2f} / {on['rss_gib']:.2f} "
            f"| {max(off['loadavg_1m'] + on['loadavg_1m'], default=0):.1f} |"
        )
    lines += [
        "",
        "| goal | ratio | bound | measured (per round) | met |",
        "|---|---|---|---|---|",
    ]
    for g in result["goals"]:
        meas = ", ".join(f"{x:.2f}" for x in g["measured"])
        lines.append(
            f"| {g['kind']} | {g['ratio']} on/off | {g['goal']} | {meas} "
            f"| {'yes' if g['met'] else 'no'} |"
        )
    lines.append("")
    lines.append(f"greedy outputs differing: {result['greedy_differing']}")
    return "\n".join(lines)


def plot(result: dict, out_dir: Path) -> list[Path]:
    """Throughput and TTFT percentiles against concurrency (prefix reuse)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [
        r
        for r in result["records"]
        if r["kind"] == "prefix_repetition" and record_variant(r) != UNPATCHED
    ]
    conc = sorted({r["concurrency"] for r in recs})

    def series(offload: bool, key: str):
        ys = []
        for c in conc:
            vals = [
                r["bench"][key]
                for r in recs
                if r["offload"] == offload and r["concurrency"] == c
            ]
            ys.append(sum(vals) / len(vals) if vals else float("nan"))
        return ys

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for offload, style in ((False, "o--"), (True, "s-")):
        ax.plot(
            conc,
            series(offload, "req_per_s"),
            style,
            label=f"offloading {'on' if offload else 'off'}",
        )
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("requests / s")
    ax.set_title("prefix_repetition, working set 2x device cache")
    ax.set_xticks(conc)
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "serving_throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for offload, color in ((False, "tab:red"), (True, "tab:blue")):
        name = "on" if offload else "off"
        ax.plot(
            conc,
            series(offload, "ttft_median_ms"),
            "o-",
            color=color,
            label=f"{name} median",
        )
        ax.plot(
            conc,
            series(offload, "ttft_p99_ms"),
            "s--",
            color=color,
            label=f"{name} p99",
        )
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title("prefix_repetition: TTFT")
    ax.set_xticks(conc)
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "serving_ttft.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternating")
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    p.add_argument(
        "--device-blocks",
        type=int,
        default=96,
        help="device KV cache, blocks of 128 tokens",
    )
    p.add_argument(
        "--working-set",
        type=float,
        default=2.0,
        help="distinct prefixes' tokens / device cache tokens",
    )
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="prompts per prefix")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--mt-conversations", type=int, default=8)
    p.add_argument("--mt-turns", type=int, default=3)
    p.add_argument("--mt-clients", type=int, default=4)
    p.add_argument("--mt-system-len", type=int, default=256)
    p.add_argument("--hog-s", type=float, default=900, help="CPU hog's time limit")
    p.add_argument("--skip-hog", action="store_true")
    p.add_argument(
        "--only",
        nargs="+",
        default=None,
        choices=["prefix_repetition", "hog", "shared_prefix", "no_reuse", "multi_turn"],
        help="run only these workload kinds",
    )
    p.add_argument("--skip-multi-turn", action="store_true")
    p.add_argument("--greedy-prompts", type=int, default=8)
    p.add_argument("--greedy-tokens", type=int, default=16)
    p.add_argument(
        "--reserved-cpus",
        type=int,
        default=None,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU for both servers "
        "(default: unset, i.e. vLLM's choice as our plugin corrects it)",
    )
    p.add_argument(
        "--unpatched",
        action="store_true",
        help="also run, each round, offloading on with "
        f"VLLM_CPU_NUM_OF_RESERVED_CPU={UNPATCHED_RESERVED_CPUS} (vLLM's "
        "reservation with a connector, before our plugin's correction)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", type=Path, default=None, help="write all raw numbers")
    p.add_argument("--log-dir", type=Path, default=None, help="server/client logs")
    p.add_argument("--plot-dir", type=Path, default=None, help="PNG figures here")
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="no run: report (and plot) an earlier --json",
    )
    add_model_args(p, SMALL_MODEL)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = 1
        args.concurrency = [4]
        args.device_blocks = 24
        args.repeats = 2
        args.mt_conversations, args.mt_turns = 2, 2
        args.greedy_prompts = 2
    if args.prefix_len % BLOCK_TOKENS:
        p.error(f"--prefix-len must be a multiple of {BLOCK_TOKENS}")
    return args


def _plain(value):
    """JSON for numpy scalars that slip through (bool_, float64, int64)."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
    else:
        result = run(args)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1, default=_plain))
    print(report_markdown(result))
    print(
        f"\nload average at start {result['loadavg_start']}, at end "
        f"{result['loadavg_end']}; {result['nproc']} CPUs; "
        f"{result['seconds']:.0f} s"
    )
    if args.plot_dir:
        try:
            paths = plot(result, args.plot_dir)
        except ImportError:
            # A benchmark-only dependency: the figures are optional.
            print(
                "--plot-dir: matplotlib is not installed (pip install matplotlib); "
                "no figures written, the JSON and the table above are complete",
                file=sys.stderr,
            )
            paths = []
        for path in paths:
            print(f"figure: {path}")


if __name__ == "__main__":
    main()
