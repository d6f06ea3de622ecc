"""The serving benchmark's workloads and the clients that run them.

Every workload but the multi-turn replay is one ``vllm bench serve`` (vLLM's
own client, run in this process: ``run_bench_serve``); the replay sends
each request through vLLM's request function. ``estimate_seconds`` says
beforehand how long a plan takes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

BLOCK_TOKENS = 128  # the guide's block_size, also the device block size here
KINDS = ("prefix_repetition", "hog", "shared_prefix", "no_reuse", "multi_turn")
# bench serve's result keys -> ours.
BENCH_KEYS = {
    "completed": "completed", "failed": "failed",
    "request_throughput": "req_per_s", "output_throughput": "out_tok_per_s",
    "mean_ttft_ms": "ttft_mean_ms", "median_ttft_ms": "ttft_median_ms",
    "p99_ttft_ms": "ttft_p99_ms", "p100_ttft_ms": "ttft_max_ms",
    "mean_tpot_ms": "tpot_mean_ms", "median_tpot_ms": "tpot_median_ms",
}  # fmt: skip


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # one of KINDS
    concurrency: int
    num_prompts: int
    dataset_args: tuple[str, ...] = ()
    prompt_tokens: int = 0  # per prompt; what the estimate counts


@dataclass
class Sizes:
    """Request and cache sizes, derived from the command line. ``cpu_blocks``
    0: a pool twice the working set's blocks (prefixes and suffixes)."""

    device_blocks: int
    working_set: float
    prefix_len: int
    suffix_len: int
    output_len: int
    repeats: int
    cpu_blocks: int = 0

    @classmethod
    def of(cls, args: argparse.Namespace) -> Sizes:
        return cls(*(getattr(args, f.name) for f in fields(cls)))

    def __post_init__(self):
        ws_tokens = self.working_set * self.device_blocks * BLOCK_TOKENS
        self.num_prefixes = max(1, round(ws_tokens / self.prefix_len))
        if not self.cpu_blocks:
            per_prompt = (self.prefix_len + self.suffix_len) // BLOCK_TOKENS
            self.cpu_blocks = 2 * self.num_prefixes * self.repeats * per_prompt


def _random(input_len: int, output_len: int, prefix_len: int = 0) -> tuple:
    """``--dataset-name random`` arguments, every prompt exactly that long."""
    prefix = ("--random-prefix-len", str(prefix_len)) if prefix_len else ()
    return (
        "--dataset-name", "random", *prefix,
        "--random-input-len", str(input_len),
        "--random-output-len", str(output_len),
        "--random-range-ratio", "0",
    )  # fmt: skip


def prefix_repetition(prefix: int, suffix: int, prefixes: int, output: int) -> tuple:
    """``--dataset-name prefix_repetition`` arguments."""
    return (
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(prefix),
        "--prefix-repetition-suffix-len", str(suffix),
        "--prefix-repetition-num-prefixes", str(prefixes),
        "--prefix-repetition-output-len", str(output),
    )  # fmt: skip


def workloads(args: argparse.Namespace, sizes: Sizes) -> list[Workload]:
    """Prefix reuse and the same beside a busy core at each concurrency, one
    shared prefix (last concurrency), no reuse at each, the multi-turn
    replay; only ``args.only``'s kinds when given."""
    prompt_len = sizes.prefix_len + sizes.suffix_len
    rep = prefix_repetition(
        sizes.prefix_len, sizes.suffix_len, sizes.num_prefixes, sizes.output_len
    )
    n_rep = sizes.num_prefixes * sizes.repeats
    n_small = max(2 * max(args.concurrency), n_rep // 3)
    shared = _random(sizes.suffix_len, sizes.output_len, sizes.prefix_len)
    plan = [  # kind, concurrencies, prompts, dataset arguments
        ("prefix_repetition", args.concurrency, n_rep, rep),
        ("hog", args.concurrency, n_rep, rep),
        ("shared_prefix", args.concurrency[-1:], n_small, shared),
        ("no_reuse", args.concurrency, n_small, _random(prompt_len, sizes.output_len)),
    ]
    out = [
        Workload(f"{kind}_c{c}", kind, c, n, dataset, prompt_len)
        for kind, concurrencies, n, dataset in plan
        for c in concurrencies
    ]
    turns = args.mt_conversations * args.mt_turns
    # History grows by ~140 user + ~100 answer tokens a turn: ~mid-way on average.
    mt_len = args.mt_system_len + 240 * (args.mt_turns + 1) // 2
    out.append(
        Workload(
            f"multi_turn_c{args.mt_clients}", "multi_turn", args.mt_clients, turns,
            prompt_tokens=mt_len,
        )
    )  # fmt: skip
    kinds = set(args.only or KINDS)
    return [w for w in out if w.kind in kinds]


# Cost model of ``estimate_seconds``, from a --quick run on this 2-core VM
# (vLLM 0.32.0's CPU backend, the 4-layer SMALL_MODEL, load average 10 when
# the off server ran): a server start took 49 s; a workload's fixed cost
# (cache reset, /metrics, the client) a few s; prompt tokens the server
# computed (not hit) went at ~9-10k tokens x layers per second. The hog
# takes one of the two cores.
START_S = 60.0
WORKLOAD_S = 5.0
LAYER_TOKENS_PER_S = 12000.0
HOG_SLOWDOWN = 1.5


def estimate_seconds(plan: list[Workload], servers: int, layers: int) -> float:
    """How long ``servers`` server rounds of ``plan`` take, an upper-ish
    estimate: every prompt token computed (no prefix hit), as offloading off
    does where the working set overflows the device cache."""
    per_server = START_S
    for w in plan:
        compute = w.num_prompts * w.prompt_tokens * layers / LAYER_TOKENS_PER_S
        per_server += WORKLOAD_S + compute * (HOG_SLOWDOWN if w.kind == "hog" else 1)
    return servers * per_server


def bench_serve_argv(base_url: str, model: str, w: Workload, seed: int) -> list:
    """``vllm bench serve`` arguments for workload ``w``: greedy, EOS
    ignored, TTFT/TPOT at the 50th, 99th and 100th percentiles."""
    return [
        "--backend", "vllm", "--base-url", base_url,
        "--model", model, "--tokenizer", model,
        *w.dataset_args,
        "--num-prompts", str(w.num_prompts),
        "--max-concurrency", str(w.concurrency),
        "--ignore-eos", "--temperature", "0", "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,e2el",
        "--metric-percentiles", "50,99,100",
        "--disable-tqdm",
    ]  # fmt: skip


def parse_bench_result(result: dict) -> dict:
    """The figures we keep from ``bench serve``'s result."""
    missing = [k for k in ("request_throughput", "completed") if k not in result]
    if missing:
        raise ValueError(f"not a bench serve result (no {missing})")
    # bench serve's figures may be numpy scalars: plain floats for JSON.
    return {
        ours: None if result.get(theirs) is None else float(result[theirs])
        for theirs, ours in BENCH_KEYS.items()
    }


def run_bench_serve(base_url: str, model: str, w: Workload, seed: int, log: Path):
    """vLLM's ``vllm bench serve`` in this process (its client start-up, tens
    of seconds on a busy 2-core host, is paid once); its report to ``log``."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    bench_args = parser.parse_args(bench_serve_argv(base_url, model, w, seed))
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

    def turn(c: int, t: int) -> tuple[str, int]:
        user = make_prompt(rng.randint(120, 160), seed=seed * 100003 + c * 101 + t)
        return user, rng.randint(80, 120)

    turns = range(args.mt_turns)
    return system, [[turn(c, t) for t in turns] for c in range(args.mt_conversations)]


async def multi_turn(base_url: str, model: str, args, seed: int):
    """A replay in the shape of vLLM's multi-turn benchmark (not in the
    wheel): ``args.mt_clients`` clients, each sending one conversation's
    turns in order with the history as the prompt. Returns each request's
    ``RequestFuncOutput`` and the seconds it all took."""
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        async_request_openai_completions,
    )

    system, convs = conversation_texts(args, seed)
    todo: asyncio.Queue = asyncio.Queue()
    for conv in convs:
        todo.put_nowait(conv)
    outputs: list = []

    async def client(session):
        while not todo.empty():
            history = system
            for user, answer_len in todo.get_nowait():
                history = f"{history} {user}"
                request = RequestFuncInput(
                    prompt=history,
                    api_url=base_url + "/v1/completions",
                    prompt_len=len(history.split()),
                    output_len=answer_len,
                    model=model,
                    ignore_eos=True,
                    extra_body={"temperature": 0.0},
                )
                out = await async_request_openai_completions(request, session)
                out.output_tokens = out.output_tokens or answer_len
                outputs.append(out)
                history = f"{history} {out.generated_text}"

    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(args.mt_clients)))
        return outputs, time.perf_counter() - t0


def summarize_requests(outputs: list, duration_s: float) -> dict:
    """bench serve's figures, by its own ``calculate_metrics``, for requests
    we sent ourselves (multi-turn: vLLM's ``RequestFuncOutput``s)."""
    from vllm.benchmarks.serve import calculate_metrics

    with contextlib.redirect_stdout(sys.stderr):  # its failed requests, tips
        m, _ = calculate_metrics([], outputs, duration_s, None, [99, 100], {})
    ttft = dict(m.percentiles_ttft_ms)
    return parse_bench_result(
        {**vars(m), "p99_ttft_ms": ttft[99], "p100_ttft_ms": ttft[100]}
    )


def fixed_prompts(n: int) -> list[str]:
    """Greedy check prompts: 2 shared 512-token documents, n/2 questions each."""
    from vllm_ascend.kv_offload.testing.tiny_model import make_prompt

    docs = [make_prompt(4 * BLOCK_TOKENS, seed=900 + d) for d in range(2)]
    return [f"{docs[i % 2]} {make_prompt(24, seed=950 + i)}" for i in range(n)]
