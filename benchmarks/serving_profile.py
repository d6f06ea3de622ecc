"""Where a serving step's time goes, offloading off vs on (issue 26).

    python benchmarks/serving_profile.py                 # issue 26's shape
    python benchmarks/serving_profile.py --num-prompts 24 --prefixes 8
    python benchmarks/serving_profile.py --before /path/to/old/worktree
    python benchmarks/serving_profile.py --py-spy /tmp/pyspy/bin/py-spy

Starts ``vllm serve`` (``serving_server.ServingServer``) with offloading
off and on (the guide's ``--kv-transfer-config`` as is:
``serving_server.offload_config``), alternating the order between rounds,
and runs vLLM's own client (``bench_serving.run_workload``: both prefix
caches emptied first) with ``--dataset-name prefix_repetition`` against
each (``--hog``: beside one busy core). The servers load ``serving_probe/``
(a ``sitecustomize`` on their ``PYTHONPATH`` only), which times the engine
core's calls from outside the runtime package; this script diffs its
totals around the workload and splits each engine step into scheduling,
connector scheduler calls, worker-side submission, polls, waits for loads,
copies (on the copy threads), model forward and the rest of the step, in
wall time and in CPU time of the calling thread, as sums and per-step
means, with the load average sampled during the run.

``--before DIR``: a third server per round, offloading on with DIR (another
worktree, e.g. of an older commit) first on its ``PYTHONPATH``: before/after
figures of a fix in one run. ``--py-spy BIN``: a sampling profile of the
"on" server's engine core (``py-spy record --native --idle -r 100``,
collapsed stacks) and its hottest frames.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script

from benchmarks import bench_serving as bs  # noqa: E402
from benchmarks import serving_server  # noqa: E402
from benchmarks import serving_workloads as wl  # noqa: E402
from benchmarks.common import SMALL_MODEL, add_int_args, write_json  # noqa: E402
from benchmarks.serving_probe.sitecustomize import SCHEDULER_HOOKS, WORKER_HOOKS  # noqa: E402
from vllm_ascend.kv_offload.testing import server  # noqa: E402

PROBE_DIR = Path(__file__).resolve().parent / "serving_probe"
GUIDE_CPU_BLOCKS = 1000  # the guide's num_cpu_blocks, as is

# Row of the split -> the probe's keys ("Class.method", exclusive time).
CONN = ("AscendOffloadingConnector.", "OffloadingConnector.")  # ours, vLLM's
WORKER = "NPUOffloadingWorker."
SPLIT = {
    "scheduling": ["Scheduler.schedule", "Scheduler.update_from_output"],
    "connector scheduler calls": [c + m for c in CONN for m in SCHEDULER_HOOKS],
    "store/load submission": [WORKER + "submit_store", WORKER + "submit_load"],
    "poll of finished jobs": [WORKER + "get_finished"],
    "waits for loads": [WORKER + "wait", WORKER + "wait_for_progress"],
    "connector worker calls, rest": [c + m for c in CONN for m in WORKER_HOOKS],
    "model forward": ["Worker.execute_model", "Worker.sample_tokens"],
    "rest of the engine step": ["EngineCore.step", "EngineCore.step_with_batch_queue"],
    "copies (copy threads)": ["copy.store", "copy.load", "copy.expedited_load"],
}
ON_ENGINE_THREAD = [k for k in SPLIT if not k.startswith("copies")]


def workload(args) -> wl.Workload:
    """``prefix_repetition``; beside one busy core (``hog``) with ``--hog``."""
    dataset = wl.prefix_repetition(
        args.prefix_len, args.suffix_len, args.prefixes, args.output_len
    )
    kind = "hog" if args.hog else "prefix_repetition"
    return wl.Workload(kind, kind, args.concurrency, args.num_prompts, dataset)


ROLES = {"engine": "EngineCore.step", "worker": "Worker.execute_model"}


def snapshots(probe_dir: Path) -> dict:
    """The latest probe totals of the engine core and of its worker."""
    time.sleep(2.5)  # the probe writes every second
    found = {}
    for path in probe_dir.glob("probe-*.json"):
        snap = json.loads(path.read_text())
        for role, key in ROLES.items():
            if key in snap["stats"]:
                found[role] = snap
    if set(found) != set(ROLES):
        raise RuntimeError(f"probe files of {set(ROLES) - set(found)} missing")
    return found


def diff(before: dict, after: dict) -> dict:
    """Totals during the workload, both processes' stats together."""
    stats: dict = {}
    out = {"stats": stats}
    for role in ROLES:
        b, a = before[role], after[role]
        for key, vals in a["stats"].items():
            old = b["stats"].get(key, [0, 0, 0])
            s = stats.setdefault(key, [0, 0, 0])
            for i in range(3):
                s[i] += vals[i] - old[i]
        out[f"{role}_cpu_s"] = (a["process_cpu_ns"] - b["process_cpu_ns"]) / 1e9
        out["wall_s"] = (a["time_ns"] - b["time_ns"]) / 1e9
        out[f"{role}_pid"] = a["pid"]
    return out


def split(d: dict) -> dict:
    """Rows of SPLIT: calls, wall and thread-CPU seconds, and per step."""
    stats = d["stats"]
    steps = stats.get("Scheduler.schedule", [0])[0] or 1
    rows = {}
    for row, keys in SPLIT.items():
        calls, wall, cpu = (
            sum(stats.get(k, [0, 0, 0])[i] for k in keys) for i in range(3)
        )
        wall, cpu = wall / 1e9, cpu / 1e9
        rows[row] = {"calls": calls, "wall_s": wall, "cpu_s": cpu,
                     "wall_ms_step": 1e3 * wall / steps,
                     "cpu_ms_step": 1e3 * cpu / steps}  # fmt: skip
    return {
        "steps": steps,
        "steps_with_forward": stats.get("steps_with_forward", [0])[0],
        "rows": rows,
        "engine_thread_cpu_s": sum(rows[r]["cpu_s"] for r in ON_ENGINE_THREAD),
        "engine_cpu_s": d["engine_cpu_s"],
        "worker_cpu_s": d["worker_cpu_s"],
        "wall_s": d["wall_s"],
    }


def hot_frames(collapsed: Path, top: int = 15) -> dict:
    """Self and inclusive sample counts per frame of py-spy's raw output
    (all threads of the process)."""
    own: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    return {
        "samples": total,
        "self": own.most_common(top),
        "inclusive": [(f, n) for f, n in incl.most_common(4 * top)
                      if "kv_offload" in f or "offloading" in f][:top],
    }  # fmt: skip


def run_one(args, model: str, variant: str, pythonpath: str, tmp: Path) -> dict:
    probe_dir = tmp / "probe"
    probe_dir.mkdir(parents=True)
    env = {"SERVING_PROBE_DIR": str(probe_dir),
           "PYTHONPATH": os.pathsep.join([str(PROBE_DIR), pythonpath])}  # fmt: skip
    cpu_blocks = None if variant == "off" else GUIDE_CPU_BLOCKS
    flags = serving_server.serve_flags(
        args.device_blocks, args.concurrency, cpu_blocks,
        max_model_len=args.max_model_len,
    )  # fmt: skip
    cmd = server.serve_command(model, flags)
    srv = serving_server.ServingServer(cmd, tmp / "server.log", env)
    spies = {}
    try:
        srv.wait_ready()
        # One step, so both processes have totals to diff from (and warm-up).
        srv.post("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 1})
        before = snapshots(probe_dir)
        if args.py_spy and variant == "on":
            for role in ROLES:
                spies[role] = subprocess.Popen(
                    [args.py_spy, "record", "--native", "--idle", "-r", "100",
                     "--format", "raw", "-o", str(tmp / f"pyspy-{role}.txt"),
                     "--pid", str(before[role]["pid"])],
                    stdout=subprocess.DEVNULL,
                    stderr=open(tmp / f"pyspy-{role}.log", "w"),
                )  # fmt: skip
        rec = bs.run_workload(srv, model, workload(args), args, 0, tmp / "bench.log")
        for spy in spies.values():
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=120)
        after = snapshots(probe_dir)
    finally:
        srv.stop()
    rec["variant"] = variant
    d = diff(before, after)
    rec.update(split(d))
    rec["detail"] = d["stats"]
    for role in spies:
        if (tmp / f"pyspy-{role}.txt").exists():
            rec[f"py_spy_{role}"] = hot_frames(tmp / f"pyspy-{role}.txt")
    return rec


def mean_load(rec: dict) -> float:
    return sum(rec["loadavg_1m"]) / max(1, len(rec["loadavg_1m"]))


def report(records: list[dict]) -> str:
    by = collections.defaultdict(list)
    for r in records:
        by[r["variant"]].append(r)
    variants = list(by)
    lines = ["| per step, ms (CPU / wall) | " + " | ".join(variants) + " |",
             "|---" * (len(variants) + 1) + "|"]  # fmt: skip

    def avg(rs, f):
        return sum(f(r) for r in rs) / len(rs)

    for row in SPLIT:
        cells = []
        for v in variants:
            cpu = avg(by[v], lambda r, row=row: r["rows"][row]["cpu_ms_step"])
            wall = avg(by[v], lambda r, row=row: r["rows"][row]["wall_ms_step"])
            cells.append(f"{cpu:.2f} / {wall:.2f}")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    extra = {
        "engine steps": lambda r: r["steps"],
        "steps with a forward": lambda r: r["steps_with_forward"],
        "engine + worker main threads CPU, s": lambda r: r["engine_thread_cpu_s"],
        "engine-core process CPU, s": lambda r: r["engine_cpu_s"],
        "worker process CPU, s (all threads)": lambda r: r["worker_cpu_s"],
        "copy threads CPU, s": lambda r: r["rows"]["copies (copy threads)"]["cpu_s"],
        "request throughput, req/s": lambda r: r["bench"]["req_per_s"],
        "p99 TTFT, ms": lambda r: r["bench"]["ttft_p99_ms"],
        "load average (1 min), mean of samples": mean_load,
    }
    for name, f in extra.items():
        cells = [f"{avg(by[v], f):.2f}" for v in variants]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def connector_shares(rec: dict, top: int = 12) -> str:
    """Connector methods by CPU per step: our subclass's share and vLLM's."""
    per = collections.defaultdict(lambda: [0, 0])
    for key, (_, _, cpu) in rec["detail"].items():
        for i, prefix in enumerate(CONN):
            if key.startswith(prefix):
                per[key[len(prefix) :]][i] += cpu
    rows = sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]
    lines = ["| connector method | ours, µs CPU/step | vLLM's, µs CPU/step |",
             "|---|---|---|"]  # fmt: skip
    for name, (ours, vllm) in rows:
        lines.append(f"| {name} | {ours / 1e3 / rec['steps']:.1f} | "
                     f"{vllm / 1e3 / rec['steps']:.1f} |")  # fmt: skip
    return "\n".join(lines)


INT_FLAGS = {"rounds": 1, "num-prompts": 96, "concurrency": 8, "prefixes": 32,
             "prefix-len": 1024, "suffix-len": 64, "output-len": 16,
             "device-blocks": 128, "max-model-len": 2048, "layers": 6}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_int_args(p, INT_FLAGS)
    p.add_argument(
        "--variants", nargs="+", default=["off", "on"], choices=["off", "on"]
    )
    p.add_argument(
        "--before", type=Path, help="also 'on' with this worktree's package first"
    )
    p.add_argument("--hog", action="store_true", help="one busy core beside it")
    p.set_defaults(hog_s=3600)  # the busy core's time limit (bench_serving's)
    p.add_argument("--py-spy", default=None, help="py-spy binary: profile 'on'")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=None)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    spec = dataclasses.replace(SMALL_MODEL, layers=args.layers)
    model = spec.ensure(max_positions=max(8192, 2 * args.max_model_len))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="serving_profile."))
    base_path = os.environ.get("PYTHONPATH", "")
    paths = {v: base_path for v in args.variants}
    if args.before:
        paths["before"] = os.pathsep.join([str(args.before.resolve()), base_path])
    records = []
    print(f"[serving_profile] logs {log_dir}; load {os.getloadavg()}", flush=True)
    for rnd in range(args.rounds):
        order = list(paths) if rnd % 2 == 0 else list(paths)[::-1]
        for variant in order:
            tmp = log_dir / f"r{rnd}-{variant}"
            rec = run_one(args, model, variant, paths[variant], tmp)
            rec["round"] = rnd
            records.append(rec)
            print(f"[serving_profile] {variant}: {rec['steps']} steps, engine "
                  f"thread CPU {rec['engine_thread_cpu_s']:.1f} s, "
                  f"load {mean_load(rec):.2f}", flush=True)  # fmt: skip
    result = {"command": " ".join(sys.argv), "records": records}
    if args.json:
        write_json(args.json, result)
    print(report(records))
    for r in records:
        if r["variant"] != "off":
            print(f"\n{r['variant']} r{r['round']}:\n{connector_shares(r)}")
    for r in records:
        for role in ROLES:
            spy = r.get(f"py_spy_{role}")
            if not spy:
                continue
            print(
                f"\npy-spy, {r['variant']} r{r['round']}, {role}: "
                f"{spy['samples']} samples; self, then offloading's inclusive"
            )
            for frame, n in spy["self"] + spy["inclusive"]:
                print(f"  {n:6d}  {frame}")


if __name__ == "__main__":
    main()
