"""Time to first token with KV offloading: cold, device hit, CPU hit and
fs-tier hit, measured on two engines in alternating A/B rounds.

    python benchmarks/bench_ttft.py [--lengths 1024 2048 4096 8192]
        [--rounds 4] [--json out.json] [--no-fs] [--quick]

Two engines, A and B, each in its own process (like two nodes sharing a file
system), run vLLM (whatever platform it finds; here its CPU backend) on a
generated Qwen3 (random weights, ``benchmarks/common.py``) with the same
configuration: the guide's 128-token CPU blocks through
``NPUTieringOffloadingSpec`` with one ``fs`` tier in a shared directory
(``--no-fs``: the guide's ``NPUOffloadingSpec``, no fs column). Round ``r``
has a writer (A on even rounds, B on odd ones) and a reader (the other);
alternating keeps load drift and one-time costs alike on both. Per prompt
length ``L`` (the order rotates every round), a never-seen prompt of
``L + 1`` tokens goes

``cold``    to the writer: nothing cached, all tokens computed;
``device``  to the writer again, once its blocks have landed in the CPU tier:
            ``L`` tokens hit the device prefix cache;
``cpu``     to the writer after ``reset_prefix_cache()``: ``L`` tokens are
            loaded from the CPU tier;
``fs``      to the reader, once the writer's block files are written (its
            own CPU tier never saw the prompt): ``L`` tokens are read from
            the fs tier.

(``L + 1`` so that every hit covers exactly ``L`` tokens: vLLM computes the
last prompt token, and a CPU block is 128 whole tokens.) TTFT is vLLM's
request metric (``testing.engine.ttft_s``: arrival to first token). Every
hit is checked through ``num_cached_tokens`` and the offloading counters,
and every figure carries the 1-minute load average when it was taken: the
figures are only comparable under a similar load. After both engines have
exited, ``fs_read_bandwidth.py`` reads every block file of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script

from benchmarks.common import (  # noqa: E402
    SMALL_MODEL,
    add_model_args,
    add_output_args,
    model_args,
    write_json,
)
from vllm_ascend.kv_offload.sizing import size_model_dir  # noqa: E402
from vllm_ascend.kv_offload.testing import engine  # noqa: E402 (no vLLM import)

CPU_BLOCK_TOKENS = 128  # the guide's block_size
CASES = ("cold", "device", "cpu", "fs")
LOAD_BYTES, LOAD_S = "vllm:kv_offload_load_bytes", "vllm:kv_offload_load_time"
TIER = "vllm:kv_offload_tiering_"
TIER_WRITE, TIER_READ, TIER_READ_S = (
    TIER + x for x in ("write_bytes", "read_bytes", "read_time")
)


def extra_config(cfg: dict) -> dict:
    """The guide's ``kv_connector_extra_config``; only the pool is sized to
    the run, and with the fs tier the spec is the tiering one."""
    extra = {**engine.GUIDE_EXTRA_CONFIG, "num_cpu_blocks": cfg["num_cpu_blocks"]}
    if cfg["root_dir"] is not None:
        extra.update(
            spec_name="NPUTieringOffloadingSpec",
            spec_module_path="vllm_ascend.kv_offload.tiering",
            secondary_tiers=[{"type": "fs", "root_dir": cfg["root_dir"]}],
        )
    return extra


# --------------------------------------------------------------------------
# Engine side (the A and B processes)
# --------------------------------------------------------------------------


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def timed_hit(llm, prompt: str, cached: int) -> float:
    """TTFT of ``prompt``, whose first ``cached`` tokens must hit a cache."""
    out = engine.generate(llm, prompt)
    got = out.num_cached_tokens or 0
    assert got == cached, f"{cached} cached tokens expected, {got} were"
    return engine.ttft_s(out)


def write(llm, cfg: dict, prompt: str, length: int) -> dict:
    """Cold, device hit and CPU hit of a never-seen prompt; returns once its
    blocks are in the CPU tier (and, with the fs tier, in files)."""
    expected = length // CPU_BLOCK_TOKENS * cfg["block_bytes"]
    c0 = engine.counters()
    row = {"cold": timed_hit(llm, prompt, 0), "cold_load": os.getloadavg()[0]}
    engine.settle(llm)
    stored = delta(c0, engine.counters(), engine.STORE_BYTES)
    assert stored >= expected, f"{stored} of {expected} bytes stored"
    row.update(device=timed_hit(llm, prompt, length), device_load=os.getloadavg()[0])
    engine.reset_prefix_cache(llm)
    c1 = engine.counters()
    row.update(cpu=timed_hit(llm, prompt, length), cpu_load=os.getloadavg()[0])
    engine.settle(llm, LOAD_BYTES)  # a load's stats come with a later step
    c2 = engine.counters()
    assert delta(c1, c2, LOAD_BYTES) == expected, (c1, c2)
    row["cpu_load_gbps"] = expected / max(delta(c1, c2, LOAD_S), 1e-9) / 1e9
    if cfg["root_dir"] is not None:
        engine.settle(llm, TIER_WRITE, steady_rounds=3, max_rounds=100, pause_s=0.1)
        written = delta(c0, engine.counters(), TIER_WRITE)
        assert written >= expected, f"{written} of {expected} bytes in files"
    return row


def read(llm, cfg: dict, prompt: str, length: int) -> dict:
    """The fs-tier hit of a prompt that another engine wrote."""
    c0 = engine.counters()
    row = {"fs": timed_hit(llm, prompt, length), "fs_load": os.getloadavg()[0]}
    engine.settle(llm, TIER_READ)
    c1 = engine.counters()
    expected = length // CPU_BLOCK_TOKENS * cfg["block_bytes"]
    assert delta(c0, c1, TIER_READ) >= expected, (c0, c1)
    row["fs_read_gbps"] = (
        delta(c0, c1, TIER_READ) / max(delta(c0, c1, TIER_READ_S), 1e-9) / 1e9
    )
    return row


def engine_process(cfg: dict, conn, name: str) -> None:
    """One engine; runs ``(role, length, seed)`` commands until ``None``."""
    from vllm_ascend.kv_offload.testing.tiny_model import make_prompt

    if cfg["log_dir"] is not None:  # the engine's output; [ttft] lines stay
        with open(os.path.join(cfg["log_dir"], f"engine_{name}.log"), "w") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
    transfer = engine.transfer_config(
        extra_config(cfg), kv_load_failure_policy="recompute"
    )
    shape = dict(dtype=cfg["dtype"], max_model_len=cfg["max_model_len"])
    llm = engine.start(cfg["model_path"], transfer, **shape, enforce_eager=True, seed=0)
    engine.generate(llm, "warm up")
    conn.send("ready")
    roles = {"write": write, "read": read}
    while (msg := conn.recv()) is not None:
        role, length, seed = msg
        prompt = make_prompt(length + 1, seed=seed, vocab_size=cfg["vocab"])
        conn.send(roles[role](llm, cfg, prompt, length))
    engine.shutdown(llm)
    conn.send("stopped")


# --------------------------------------------------------------------------
# Orchestration (no vLLM import in this process)
# --------------------------------------------------------------------------


def run_rounds(cfg: dict) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    engines = {}
    for name in "AB":
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=engine_process, args=(cfg, child, name), name=name)
        proc.start()
        engines[name] = (proc, parent)
    try:
        for proc, conn in engines.values():
            if conn.recv() != "ready":
                raise SystemExit(f"engine {proc.name} did not start")
        trials, lengths = [], cfg["lengths"]
        for rnd in range(cfg["rounds"]):
            writer, reader = ("A", "B") if rnd % 2 == 0 else ("B", "A")
            k = rnd % len(lengths)
            for length in lengths[k:] + lengths[:k]:
                seed = 50_000 + 1_000 * rnd + length // CPU_BLOCK_TOKENS
                engines[writer][1].send(("write", length, seed))
                row = {"round": rnd, "length": length, "writer": writer}
                row.update(engines[writer][1].recv())
                if cfg["root_dir"] is not None:
                    engines[reader][1].send(("read", length, seed))
                    row.update(engines[reader][1].recv())
                trials.append(row)
                head = f"[ttft] round {rnd} {writer}->{reader} L={length:5d}"
                cells = [f"{c}={row[c] * 1e3:.0f} ms (load {row[c + '_load']:.1f})"
                         for c in CASES if c in row]  # fmt: skip
                print(head, *cells, file=sys.stderr, flush=True)
        return trials
    finally:
        for proc, conn in engines.values():
            if proc.is_alive():
                with contextlib.suppress(OSError, EOFError):
                    conn.send(None)
                    conn.poll(180) and conn.recv()
            proc.join(60)
            if proc.is_alive():
                proc.kill()  # this benchmark's own process, by pid


def summarize(trials: list[dict], lengths: list[int]) -> list[dict]:
    """Per length: median and p90 of each case (ms), the load averages they
    were taken under, and the ratios of the medians."""
    rows = []
    for length in lengths:
        ts = [t for t in trials if t["length"] == length]
        row: dict = {"length": length, "n": len(ts)}
        for case in CASES:
            xs = [t[case] * 1e3 for t in ts if case in t]
            if xs:
                loads = [t[case + "_load"] for t in ts]
                row[case] = {
                    "median": float(np.percentile(xs, 50)),
                    "p90": float(np.percentile(xs, 90)),
                    "load": (min(loads), max(loads)),
                }
        row["cold_over_cpu"] = row["cold"]["median"] / row["cpu"]["median"]
        row["cpu_over_device"] = row["cpu"]["median"] / row["device"]["median"]
        if "fs" in row:
            row["cold_over_fs"] = row["cold"]["median"] / row["fs"]["median"]
        rows.append(row)
    return rows


def print_table(summary: list[dict]) -> None:
    print("\nTTFT, ms: median / p90 [1-min load average range]")
    print(f"{'tokens':>6}" + "".join(f"{c:>26}" for c in CASES) + "  cold/CPU")
    for r in summary:
        cells = [f"{r[c]['median']:6.0f} / {r[c]['p90']:<5.0f}"
                 f"[{r[c]['load'][0]:.1f}-{r[c]['load'][1]:.1f}]" if c in r else "-"
                 for c in CASES]  # fmt: skip
        cells = "".join(f"{c:>26}" for c in cells)
        print(f"{r['length']:6d}{cells}  {r['cold_over_cpu']:8.1f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--rounds", type=int, default=4, help="A/B rounds (even: fair)")
    p.add_argument("--no-fs", action="store_true", help="NPUOffloadingSpec only")
    p.add_argument("--root-dir", type=Path, default=None, help="fs tier (temp dir)")
    p.add_argument("--quick", action="store_true", help="256 and 512 tokens, 2 rounds")
    add_output_args(p)
    add_model_args(p, SMALL_MODEL)
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.rounds = [256, 512], 2
    for length in args.lengths:
        if length % CPU_BLOCK_TOKENS:
            p.error(f"--lengths must be multiples of {CPU_BLOCK_TOKENS}: {length}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = model_args(args)
    max_len = max(args.lengths) + 1
    t0, load_start = time.perf_counter(), os.getloadavg()
    model_path = model.ensure(max(32768, 1 << (2 * max_len).bit_length()))
    # The package's sizing (vLLM's ModelConfig of the generated config.json).
    kv_per_token = size_model_dir(model_path, dtype=args.dtype).kv_bytes_per_token
    with contextlib.ExitStack() as stack:
        root = None
        if not args.no_fs:
            root = args.root_dir or Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_ttft."))
            )
            root.mkdir(parents=True, exist_ok=True)
        cfg = {
            "model_path": model_path,
            "dtype": args.dtype,
            "max_model_len": max_len + 64,
            "block_bytes": kv_per_token * CPU_BLOCK_TOKENS,
            # Every prompt of the run, with room: no eviction.
            "num_cpu_blocks": args.rounds * sum(args.lengths) // CPU_BLOCK_TOKENS + 8,
            "vocab": model.vocab,
            "lengths": args.lengths,
            "rounds": args.rounds,
            "root_dir": None if root is None else str(root),
            "log_dir": None if args.log_dir is None else str(args.log_dir),
        }
        if args.log_dir is not None:
            args.log_dir.mkdir(parents=True, exist_ok=True)
        # Both engines: one core for the scheduler with a connector as
        # without, and a device KV cache for the longest prompt.
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        kvcache_gib = max(1, math.ceil(4 * max_len * kv_per_token / 2**30))
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kvcache_gib))
        print(
            f"model {model_path}: {model.num_params() / 1e6:.0f} M params, "
            f"{args.dtype}, KV {kv_per_token / 1024:.0f} KiB/token; fs tier "
            f"{root}; load average {load_start}",
            file=sys.stderr,
            flush=True,
        )
        trials = run_rounds(cfg)
        bandwidth = None
        if root is not None:
            from benchmarks.fs_read_bandwidth import read_bandwidth

            bandwidth = read_bandwidth(str(root), cfg["block_bytes"])
    summary = summarize(trials, args.lengths)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpus": os.cpu_count(),
        "model": {**asdict(model), "params": model.num_params(), "path": model_path},
        "config": cfg,
        "trials": trials,
        "summary": summary,
        "fs_read_bandwidth": bandwidth,
        "loadavg": {"start": load_start, "end": os.getloadavg()},
        "seconds": time.perf_counter() - t0,
    }
    if args.json:
        write_json(args.json, result)
    print_table(summary)
    if bandwidth is not None:
        print(f"\nfs read bandwidth, {bandwidth['files']} files, one thread:")
        for name, row in bandwidth["rows"].items():
            print(f"  {name:28s} {row['gbps']:6.2f} GB/s (load {row['loadavg']:.1f})")
    print(
        f"\nload average at start {load_start}, at end {result['loadavg']['end']}; "
        f"{result['seconds']:.0f} s"
    )


if __name__ == "__main__":
    main()
