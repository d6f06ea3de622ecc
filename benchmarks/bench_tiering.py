"""Tiering benchmark: TTFT from the fs tier vs a CPU hit vs recompute, and the
fs tier's read bandwidth vs a plain sequential read of the same files.

    python benchmarks/bench_tiering.py [--lengths 1024 2048 4096 8192]
        [--reps 2] [--json out.json] [--root-dir DIR] [--quick]

Runs real vLLM engines (here its CPU backend) with ``NPUTieringOffloadingSpec``
and one ``fs`` tier, on a generated Qwen3 (random weights; the model helpers
of ``bench_e2e_offload.py``, smaller defaults so that 8k-token prefills fit a
10-minute run on 2 cores). Both engines have the same configuration, each is
its own process, like two nodes sharing a file system:

1. engine A (writer) serves ``reps`` never-seen prompts of ``L + 1`` tokens
   per length ``L`` and waits until their ``L / 128`` block files are in
   ``root_dir``; then it shuts down.
2. engine B (reader; cold CPU tier, same ``root_dir``) measures, prompt by
   prompt, side by side (the order of the lengths rotates per repetition):

   ``fs``         A's prompt: the device cache and B's CPU tier miss, the
                  ``L`` tokens are read from A's files (fs -> CPU tier ->
                  device), 1 token is computed;
   ``cpu``        the same prompt after ``llm.reset_prefix_cache()``: the
                  blocks promoted by the fs hit are in B's CPU tier now;
   ``recompute``  a never-seen prompt of the same length;
   ``1-token``    a 1-token prompt, the engine's floor.

   TTFT is the wall time of ``llm.generate([prompt], max_tokens=1)``. Each
   hit is checked: ``num_cached_tokens == L``, the fs hit read bytes from the
   tier (``vllm:kv_offload_tiering_read_bytes``), the CPU hit none.
3. Read bandwidth, after both engines have exited, on every block file of
   the run (A's, and B's from its fresh prompts; one thread, the same files
   in the same order): a plain sequential read (``readv`` of
   each whole file into one buffer) with a cold page cache (every file
   ``fsync``-ed and dropped with ``posix_fadvise(DONTNEED)`` first) and a warm
   one (read again at once); the fs tier's own read path (``read_block``:
   header + payload, identity, key and CRC32 checks) with ``O_DIRECT`` where
   the file system allows it, as the engine reads (no page cache: cold by
   construction), and buffered with a warm cache (the verification's cost
   alone). Plus the engine's own figure: tier read bytes / read time during
   the fs hits.

The load average is recorded at the start, per prompt and at the end: the
figures are only comparable with a similar load. Results: docs/tiering.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import mmap
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_e2e_offload import (  # noqa: E402
    CPU_BLOCK_TOKENS,
    delta,
    machine_facts,
    med,
    percentile,
)
from benchmarks.bench_e2e_offload import read_counters as read_offload_counters  # noqa: E402
from benchmarks.common import SMALL_MODEL, add_model_args, model_args  # noqa: E402

TIER_COUNTERS = {
    "vllm:kv_offload_tiering_read_bytes": "tier_read_bytes",
    "vllm:kv_offload_tiering_read_time": "tier_read_s",
    "vllm:kv_offload_tiering_write_bytes": "tier_write_bytes",
    "vllm:kv_offload_load_bytes": "load_bytes",
    "vllm:external_prefix_cache_hits": "external_hit_tokens",
}


# --------------------------------------------------------------------------
# Engine side (role subprocesses)
# --------------------------------------------------------------------------


def read_counters() -> dict[str, float]:
    return read_offload_counters(TIER_COUNTERS)


def make_llm(cfg: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "spec_name": "NPUTieringOffloadingSpec",
            "spec_module_path": "vllm_ascend.kv_offload.tiering",
            "num_cpu_blocks": cfg["num_cpu_blocks"],
            "block_size": CPU_BLOCK_TOKENS,
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": cfg["root_dir"],
                    "n_read_threads": cfg["fs_threads"],
                    "n_write_threads": cfg["fs_threads"],
                }
            ],
        },
    )
    return LLM(
        model=cfg["model_path"],
        dtype=cfg["dtype"],
        max_model_len=cfg["max_model_len"],
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
        kv_transfer_config=transfer,
    )


def block_files(root: str) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.join(d, n) for n in names if n.endswith(".bin")]
    return sorted(out)


def prompt_for(cfg: dict, length: int, rep: int, fresh: bool) -> str:
    from vllm_ascend.kv_offload.testing.tiny_model import make_prompt

    seed = 50_000 + 1000 * rep + length // CPU_BLOCK_TOKENS + (500 if fresh else 0)
    return make_prompt(length + 1, seed=seed, vocab_size=cfg["vocab"])


def shutdown(llm) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def role_writer(cfg: dict) -> dict:
    from vllm import SamplingParams

    llm = make_llm(cfg)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    flush = SamplingParams(max_tokens=2, temperature=0.0)
    expected = 0
    t0 = time.perf_counter()
    for rep in range(cfg["reps"]):
        for length in cfg["lengths"]:
            (out,) = llm.generate(
                [prompt_for(cfg, length, rep, fresh=False)], one, use_tqdm=False
            )
            assert (out.num_cached_tokens or 0) == 0, out.num_cached_tokens
            expected += length // CPU_BLOCK_TOKENS
    # Stores reach the CPU tier at the next steps, the files after them.
    for _ in range(600):
        llm.generate(["flush"], flush, use_tqdm=False)
        if len(block_files(cfg["root_dir"])) >= expected:
            break
        time.sleep(0.1)
    files = block_files(cfg["root_dir"])
    assert len(files) >= expected, (len(files), expected)
    counters = read_counters()
    seconds = time.perf_counter() - t0
    shutdown(llm)
    return {"files": len(files), "expected": expected, "seconds": seconds,
            "counters": counters}  # fmt: skip


def role_reader(cfg: dict) -> dict:
    from vllm import SamplingParams

    llm = make_llm(cfg)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    flush = SamplingParams(max_tokens=2, temperature=0.0)
    block_bytes = CPU_BLOCK_TOKENS * cfg["kv_bytes_per_token"]

    def ttft(prompt: str, cached: int) -> float:
        t0 = time.perf_counter()
        (out,) = llm.generate([prompt], one, use_tqdm=False)
        seconds = time.perf_counter() - t0
        assert (out.num_cached_tokens or 0) == cached, (out.num_cached_tokens, cached)
        return seconds

    def settled(c0: dict[str, float]) -> dict[str, float]:
        # A hit's counters reach the front-end with a later step.
        llm.generate(["flush"], flush, use_tqdm=False)
        return delta(read_counters(), c0)

    ttft("warm up", 0)
    trials = []
    t_start = time.perf_counter()
    lengths = cfg["lengths"]
    for rep in range(cfg["reps"]):
        k = rep % len(lengths)
        for length in lengths[k:] + lengths[:k]:
            prompt = prompt_for(cfg, length, rep, fresh=False)
            c0 = read_counters()
            fs_s = ttft(prompt, length)
            fs = settled(c0)
            assert fs["tier_read_bytes"] >= length // CPU_BLOCK_TOKENS * block_bytes, fs
            assert llm.reset_prefix_cache()
            c1 = read_counters()
            cpu_s = ttft(prompt, length)
            cpu = settled(c1)
            assert cpu["tier_read_bytes"] == 0, cpu  # served by the CPU tier
            assert cpu["load_bytes"] > 0, cpu
            recompute_s = ttft(prompt_for(cfg, length, rep, fresh=True), 0)
            one_token_s = ttft("hello", 0)
            row = {
                "length": length,
                "rep": rep,
                "fs_s": fs_s,
                "cpu_s": cpu_s,
                "recompute_s": recompute_s,
                "one_token_s": one_token_s,
                "fs_tier_read_bytes": fs["tier_read_bytes"],
                "fs_tier_read_s": fs["tier_read_s"],
                "fs_load_bytes": fs["load_bytes"],
                "cpu_load_bytes": cpu["load_bytes"],
                "loadavg": os.getloadavg()[0],
            }
            trials.append(row)
            print(
                f"[tiering] L={length:5d} rep={rep} fs={fs_s * 1e3:7.0f} ms "
                f"cpu={cpu_s * 1e3:6.0f} ms recompute={recompute_s * 1e3:7.0f} ms "
                f"1-token={one_token_s * 1e3:4.0f} ms tier read "
                f"{fs['tier_read_bytes'] / 2**20:.0f} MiB in "
                f"{fs['tier_read_s'] * 1e3:.0f} ms, load {row['loadavg']:.2f}",
                file=sys.stderr,
                flush=True,
            )
    seconds = time.perf_counter() - t_start
    shutdown(llm)
    return {"trials": trials, "seconds": seconds}


# --------------------------------------------------------------------------
# Read bandwidth (orchestrator, after the engines have exited)
# --------------------------------------------------------------------------


def _drop_page_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _resident_fraction(paths: list[str]) -> float | None:
    """Share of the files' pages in the page cache (mincore(2)), or None."""
    import ctypes

    import numpy as np

    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    resident = total = 0
    for path in paths:
        size = os.path.getsize(path)
        pages = -(-size // mmap.PAGESIZE)
        vec = np.zeros(pages, dtype=np.uint8)
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
            try:
                view = np.frombuffer(m, dtype=np.uint8)
                rc = mincore(view.ctypes.data, size, vec.ctypes.data)
                del view
            finally:
                m.close()
        if rc != 0:
            return None
        resident += int((vec & 1).sum())
        total += pages
    return resident / total if total else None


def read_bandwidth(root: str, block_bytes: int) -> dict:
    from vllm.v1.kv_offload.tiering.fs.io import probe_o_direct

    from vllm_ascend.kv_offload.tiering.block_file import (
        _HEADER,
        HEADER_BYTES,
        read_block,
    )

    paths = block_files(root)
    assert paths, f"no block files under {root}"
    size = HEADER_BYTES + block_bytes
    sizes = {os.path.getsize(p) for p in paths}
    assert sizes == {size}, sizes
    total = len(paths) * size
    buf = mmap.mmap(-1, size)  # page-aligned (O_DIRECT)
    payload = memoryview(buf)[HEADER_BYTES:]
    ids = []
    for p in paths:  # identity and key from each header (verified below)
        with open(p, "rb") as f:
            _, _, _, _, identity, key = _HEADER.unpack(f.read(_HEADER.size))
        ids.append((identity, key))
    use_o_direct = probe_o_direct(root)
    o_direct = getattr(os, "O_DIRECT", 0) if use_o_direct else 0

    def plain() -> None:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                got = os.readv(fd, [buf])
            finally:
                os.close(fd)
            assert got == size

    def verified(flags: int):
        def run() -> None:
            for p, (identity, key) in zip(paths, ids, strict=True):
                read_block(p, payload, identity, key, flags)

        return run

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    rows = {}

    def record(name: str, seconds: float, cache: str, resident) -> None:
        rows[name] = {
            "seconds": seconds,
            "gbps": total / seconds / 1e9,
            "page_cache": cache,
            "resident_before": resident,
            "loadavg": os.getloadavg()[0],
        }

    _drop_page_cache(paths)
    resident = _resident_fraction(paths)
    record("plain_cold", timed(plain), "cold (fsync + fadvise DONTNEED)", resident)
    resident = _resident_fraction(paths)
    record("plain_warm", timed(plain), "warm (read just before)", resident)
    _drop_page_cache(paths)
    resident = _resident_fraction(paths)
    record(
        "fs_tier_read",
        timed(verified(o_direct)),
        "O_DIRECT: bypassed" if o_direct else "cold (buffered; no O_DIRECT here)",
        resident,
    )
    timed(verified(0))  # warm the cache through the buffered path
    resident = _resident_fraction(paths)
    record("fs_tier_read_buffered_warm", timed(verified(0)), "warm", resident)
    return {
        "files": len(paths),
        "file_bytes": size,
        "total_bytes": total,
        "o_direct": bool(o_direct),
        "rows": rows,
    }


# --------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------


def run_role(name: str, cfg: dict, log_dir: Path) -> dict:
    cfg_path = log_dir / f"{name}.config.json"
    out_path = log_dir / f"{name}.result.json"
    cfg_path.write_text(json.dumps(cfg))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), env.get("PYTHONPATH", "")) if p
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg["kvcache_gib"]))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    log_path = log_dir / f"{name}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--_role",
                name,
                "--_config",
                str(cfg_path),
                "--_out",
                str(out_path),
            ],  # fmt: skip
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        seen = 0
        while proc.poll() is None:
            time.sleep(1)
            seen = _echo(log_path, seen)
        _echo(log_path, seen)
    if proc.returncode != 0:
        tail = log_path.read_text()[-6000:]
        raise SystemExit(f"{name} exited with {proc.returncode}; {log_path}:\n{tail}")
    result = json.loads(out_path.read_text())
    result["process_seconds"] = time.perf_counter() - t0
    return result


def _echo(path: Path, seen: int) -> int:
    with open(path, "rb") as f:
        f.seek(seen)
        data = f.read()
    complete = data[: data.rfind(b"\n") + 1]
    for line in complete.decode(errors="replace").splitlines():
        if line.startswith("[tiering]"):
            print(line, file=sys.stderr, flush=True)
    return seen + len(complete)


def summarize(trials: list[dict], lengths: list[int]) -> list[dict]:
    rows = []
    for length in lengths:
        ts = [t for t in trials if t["length"] == length]

        def stat(key: str, ts=ts) -> dict[str, float]:
            xs = [t[key] * 1e3 for t in ts]
            return {"median": med(xs), "p90": percentile(xs, 90)}

        fs, cpu, rec = stat("fs_s"), stat("cpu_s"), stat("recompute_s")
        read = [t["fs_tier_read_bytes"] / t["fs_tier_read_s"] / 1e9 for t in ts
                if t["fs_tier_read_s"] > 0]  # fmt: skip
        rows.append(
            {
                "length": length,
                "n": len(ts),
                "fs_ms": fs,
                "cpu_ms": cpu,
                "recompute_ms": rec,
                "one_token_ms": stat("one_token_s"),
                "fs_over_cpu": fs["median"] / cpu["median"],
                "recompute_over_fs": rec["median"] / fs["median"],
                "recompute_over_cpu": rec["median"] / cpu["median"],
                "engine_tier_read_gbps": med(read),
                "loadavg": [t["loadavg"] for t in ts],
            }
        )
    return rows


def print_report(result: dict) -> None:
    print("\nTTFT, ms (median / p90); ratios of medians")
    print(
        f"{'tokens':>6} | {'fs tier':>15} | {'CPU hit':>15} | {'recompute':>17} | "
        f"{'1-token':>7} | fs/CPU | recompute/fs | recompute/CPU | tier read GB/s"
    )
    for r in result["summary"]:
        print(
            f"{r['length']:6d} "
            f"| {r['fs_ms']['median']:7.0f} / {r['fs_ms']['p90']:<5.0f} "
            f"| {r['cpu_ms']['median']:7.0f} / {r['cpu_ms']['p90']:<5.0f} "
            f"| {r['recompute_ms']['median']:8.0f} / {r['recompute_ms']['p90']:<6.0f} "
            f"| {r['one_token_ms']['median']:7.0f} | {r['fs_over_cpu']:6.2f} "
            f"| {r['recompute_over_fs']:12.1f} | {r['recompute_over_cpu']:13.1f} "
            f"| {r['engine_tier_read_gbps']:.2f}"
        )
    bw = result["bandwidth"]
    print(
        f"\nRead bandwidth, {bw['files']} files of {bw['file_bytes']} bytes "
        f"({bw['total_bytes'] / 2**20:.0f} MiB), one thread, same files and order"
    )
    for name, row in bw["rows"].items():
        resident = row["resident_before"]
        shown = "?" if resident is None else f"{resident:.0%}"
        print(
            f"  {name:28s} {row['gbps']:6.2f} GB/s  page cache: {row['page_cache']}, "
            f"resident before: {shown}"
        )
    la = result["loadavg"]
    print(
        f"\nload average (1/5/15 min) at start {la['start']}, at end {la['end']}; "
        f"total {result['seconds']:.0f} s"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--reps", type=int, default=2, help="prompts per length")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--fs-threads", type=int, default=2, help="fs tier read/write threads"
    )
    p.add_argument(
        "--root-dir", type=Path, default=None, help="fs tier root (default: a temp dir)"
    )
    p.add_argument("--quick", action="store_true", help="512 and 1024 tokens, 1 rep")
    p.add_argument("--json", type=Path, default=None, help="write all raw numbers")
    p.add_argument("--log-dir", type=Path, default=None, help="engine logs")
    add_model_args(p, SMALL_MODEL)
    p.add_argument("--_role", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_config", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.reps = [512, 1024], 1
    for length in args.lengths:
        if length % CPU_BLOCK_TOKENS:
            p.error(f"--lengths must be multiples of {CPU_BLOCK_TOKENS}: {length}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args._role is not None:
        cfg = json.loads(args._config.read_text())
        role = {"writer": role_writer, "reader": role_reader}[args._role]
        args._out.write_text(json.dumps(role(cfg)))
        return

    from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model

    t_start = time.perf_counter()
    load_start = os.getloadavg()
    model = model_args(args)
    max_len = max(args.lengths) + 1
    model_path = ensure_tiny_model(
        REPO / ".models" / model.dirname(),
        model.spec(max_positions=max(32768, 1 << (2 * max_len).bit_length())),
    )
    kv_per_token = model.kv_bytes_per_token(args.dtype)
    block_bytes = kv_per_token * CPU_BLOCK_TOKENS
    round_blocks = sum(args.lengths) // CPU_BLOCK_TOKENS
    with contextlib.ExitStack() as stack:
        if args.root_dir is None:
            tmp = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="bench_tiering.")
            )
            root = Path(tmp) / "kv"
        else:
            root = args.root_dir
        root.mkdir(parents=True, exist_ok=True)
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_tiering_logs."))
        log_dir.mkdir(parents=True, exist_ok=True)
        cfg = {
            "model_path": model_path,
            "dtype": args.dtype,
            "max_model_len": max_len + 64,
            # Every prompt of the run (fs hits + fresh prompts), with room.
            "num_cpu_blocks": 2 * round_blocks + 8,
            "kvcache_gib": max(1, math.ceil(4 * max_len * kv_per_token / 2**30)),
            "kv_bytes_per_token": kv_per_token,
            "vocab": model.vocab,
            "lengths": args.lengths,
            "reps": args.reps,
            "root_dir": str(root),
            "fs_threads": args.fs_threads,
        }
        print(
            f"model {model_path}: {model.num_params() / 1e6:.0f} M params, "
            f"{args.dtype}, KV {kv_per_token / 1024:.0f} KiB/token, block file "
            f"{block_bytes / 2**20:.0f} MiB + header; fs tier at {root}; logs in "
            f"{log_dir}; load average {load_start}",
            file=sys.stderr,
            flush=True,
        )
        writer = run_role("writer", cfg, log_dir)
        reader = run_role("reader", cfg, log_dir)
        bandwidth = read_bandwidth(str(root), block_bytes)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_facts(),
        "model": {**asdict(model), "params": model.num_params(), "path": model_path},
        "config": cfg,
        "writer": writer,
        "reader": reader,
        "summary": summarize(reader["trials"], args.lengths),
        "bandwidth": bandwidth,
        "loadavg": {"start": load_start, "end": os.getloadavg()},
        "seconds": time.perf_counter() - t_start,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    print_report(result)


if __name__ == "__main__":
    main()
