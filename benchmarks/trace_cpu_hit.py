"""Where a CPU hit's time goes: a timeline of engine steps and copy jobs.

    python benchmarks/trace_cpu_hit.py [--length 8192] [--hits 16]
        [--compare-no-wait] [--json out.json]

Starts one engine (offloading on, the same model, configuration and core
layout as ``bench_e2e_offload.py``), computes one prompt of ``length + 1``
tokens, then alternates device hits and CPU hits of it (``reset_prefix_cache``
before each CPU hit), ``--hits`` of each. The engine's offloading spec is this
module: ``NPUOffloadingSpec`` unchanged, plus timestamps written by the
worker process (``time.perf_counter``, i.e. CLOCK_MONOTONIC, comparable
across processes) at every ``execute_model`` / ``sample_tokens`` call, load
submission, copy start and end (on the copy thread), and ``get_finished``
result. Per request, with ``t0``/``t1`` the front-end's ``generate`` call:

``to_first_step``      t0 -> the first ``execute_model`` of the request;
``submit_to_copy``     load submitted -> copy thread starts it;
``copy``               the copy job (what ``kv_offload_load_time`` reports);
``copy_to_finished``   copy done -> ``get_finished`` hands it to vLLM;
``finished_to_fwd``    -> start of the step that computes the last token;
``forward``            that ``execute_model`` (1 token, ``length`` cached);
``after_forward``      its end -> ``generate`` returns (sampling, output);
``steps``              ``execute_model`` calls during the request.

``--compare-no-wait`` also measures, interleaved hit by hit with the stock
behaviour, the engine without the idle-step wait (``connector.IDLE_STEP_WAIT_S``
set to 0 in the worker): each step that computes nothing then returns at once
and vLLM steps again, busy-polling while the copy runs (see
docs/e2e_benchmark.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_ascend.kv_offload import npu as _npu  # noqa: E402

__all__ = ["NPUOffloadingSpec"]

_DIR_ENV = "TRACE_CPU_HIT_DIR"
_lock = threading.Lock()
_out = None


def _log(event: str, **fields) -> None:
    global _out
    with _lock:
        if _out is None:
            path = Path(os.environ[_DIR_ENV]) / f"events_{os.getpid()}.jsonl"
            _out = open(path, "a")  # noqa: SIM115 (process lifetime)
        fields.update(ev=event, t=time.perf_counter())
        _out.write(json.dumps(fields) + "\n")
        _out.flush()


def _install_tracing() -> None:
    """Wrap the worker-side methods; they only fire in the worker process."""
    from vllm.v1.worker import gpu_worker

    import vllm_ascend.kv_offload.connector as cn
    import vllm_ascend.kv_offload.transfer_queue as tq
    import vllm_ascend.kv_offload.worker as wk

    if getattr(wk.NPUOffloadingWorker, "_traced", False):
        return
    wk.NPUOffloadingWorker._traced = True

    submit = tq.ThreadTransferQueue.submit

    def traced_submit(self, job_id, copy):
        def traced_copy():
            _log("copy_start", job=job_id)
            try:
                return copy()
            finally:
                _log("copy_end", job=job_id)

        return submit(self, job_id, traced_copy)

    tq.ThreadTransferQueue.submit = traced_submit

    submit_load = wk.NPUOffloadingWorker.submit_load

    def traced_submit_load(self, job_id, *args, **kwargs):
        _log("submit_load", job=job_id)
        return submit_load(self, job_id, *args, **kwargs)

    wk.NPUOffloadingWorker.submit_load = traced_submit_load

    get_finished = wk.NPUOffloadingWorker.get_finished
    connector_get_finished = cn.AscendOffloadingConnector.get_finished
    default_wait_s = cn.IDLE_STEP_WAIT_S
    flag = Path(os.environ[_DIR_ENV]) / "no_wait"

    def switched_get_finished(self, finished_req_ids):
        cn.IDLE_STEP_WAIT_S = 0.0 if flag.exists() else default_wait_s
        return connector_get_finished(self, finished_req_ids)

    cn.AscendOffloadingConnector.get_finished = switched_get_finished

    def traced_get_finished(self):
        results = get_finished(self)
        if results:
            _log("get_finished", jobs=[r.job_id for r in results])
        return results

    wk.NPUOffloadingWorker.get_finished = traced_get_finished

    for name in ("execute_model", "sample_tokens"):
        original = getattr(gpu_worker.Worker, name)

        def traced(self, *args, _original=original, _name=name, **kwargs):
            n = None
            if _name == "execute_model":
                sched = args[0] if args else kwargs["scheduler_output"]
                n = sched.total_num_scheduled_tokens
            _log(f"{_name}_start", n=n)
            try:
                return _original(self, *args, **kwargs)
            finally:
                _log(f"{_name}_end", n=n)

        setattr(gpu_worker.Worker, name, traced)


class NPUOffloadingSpec(_npu.NPUOffloadingSpec):
    """The stock spec; its worker process gets the tracing wrappers."""

    def get_worker(self, kv_caches):
        _install_tracing()
        return super().get_worker(kv_caches)


def breakdown(requests: list[dict], events: list[dict]) -> dict[str, dict]:
    """Per request kind, the median (and min/max) of every phase, in ms."""
    by_kind: dict[str, list[dict]] = {}
    for req in requests:
        ev = [e for e in events if req["t0"] <= e["t"] <= req["t1"]]

        def first(name: str, ev=ev) -> float:
            return next(e["t"] for e in ev if e["ev"] == name)

        steps = [e for e in ev if e["ev"] == "execute_model_start"]
        fwd = [e for e in steps if e["n"]][-1]["t"]
        fwd_end = [e for e in ev if e["ev"] == "execute_model_end" and e["n"]][-1]["t"]
        row = {
            "total": req["t1"] - req["t0"],
            "to_first_step": steps[0]["t"] - req["t0"],
            "forward": fwd_end - fwd,
            "after_forward": req["t1"] - fwd_end,
            "steps": len(steps),
        }
        if req["kind"].startswith("cpu"):
            row.update(
                submit_to_copy=first("copy_start") - first("submit_load"),
                copy=first("copy_end") - first("copy_start"),
                copy_to_finished=first("get_finished") - first("copy_end"),
                finished_to_fwd=fwd - first("get_finished"),
            )
        by_kind.setdefault(req["kind"], []).append(row)
    out = {}
    for kind, rows in sorted(by_kind.items()):
        out[kind] = {"n": len(rows)}
        for key in rows[0]:
            scale = 1 if key == "steps" else 1e3
            vals = [r[key] * scale for r in rows]
            out[kind][key] = {
                "median": statistics.median(vals),
                "min": min(vals),
                "max": max(vals),
            }
    return out


def print_breakdown(result: dict[str, dict], length: int) -> None:
    keys = [k for k in max(result.values(), key=len) if k != "n"]
    print(f"\nlength {length}: median ms (steps: count), min..max")
    print(f"{'':22s}" + "".join(f"{kind:>22s}" for kind in result))
    for key in keys:
        cells = []
        for kind in result:
            v = result[kind].get(key)
            cells.append(
                f"{v['median']:8.1f} ({v['min']:.1f}..{v['max']:.1f})" if v else ""
            )
        print(f"{key:22s}" + "".join(f"{c:>22s}" for c in cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--hits", type=int, default=16)
    p.add_argument("--compare-no-wait", action="store_true")
    p.add_argument("--reserved-cpus", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    trace_dir = Path(tempfile.mkdtemp(prefix="trace_cpu_hit."))
    os.environ[_DIR_ENV] = str(trace_dir)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.reserved_cpus >= 0:
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(args.reserved_cpus))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        x for x in (str(REPO), os.environ.get("PYTHONPATH", "")) if x
    )

    from vllm import SamplingParams

    from benchmarks.bench_e2e_offload import CPU_BLOCK_TOKENS, ModelArgs, make_llm
    from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model, make_prompt

    model = ModelArgs()
    path = ensure_tiny_model(
        REPO / ".models" / model.dirname(), model.spec(max_positions=32768)
    )
    cfg = {
        "model_path": path,
        "dtype": "float32",
        "max_model_len": args.length + 64,
        "num_cpu_blocks": 2 * args.length // CPU_BLOCK_TOKENS,
    }
    llm = make_llm(cfg, offload=True, spec_module="benchmarks.trace_cpu_hit")
    one = SamplingParams(max_tokens=1, temperature=0.0)
    prompt = make_prompt(args.length + 1, seed=77)
    llm.generate([prompt], one, use_tqdm=False)  # computed, then offloaded
    for _ in range(3):
        llm.generate(["flush"], SamplingParams(max_tokens=4), use_tqdm=False)

    modes = ["stock"] + (["no_wait"] if args.compare_no_wait else [])
    flag = trace_dir / "no_wait"
    requests = []
    for i in range(args.hits):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            if mode == "no_wait":
                flag.touch()
            else:
                flag.unlink(missing_ok=True)
            for kind in ("device", "cpu"):
                if kind == "cpu":
                    assert llm.reset_prefix_cache()
                t0 = time.perf_counter()
                (out,) = llm.generate([prompt], one, use_tqdm=False)
                t1 = time.perf_counter()
                assert out.num_cached_tokens == args.length, out.num_cached_tokens
                requests.append({"kind": f"{kind}/{mode}", "t0": t0, "t1": t1})
                time.sleep(0.05)

    events = sorted(
        (
            json.loads(line)
            for f in trace_dir.glob("events_*.jsonl")
            for line in f.read_text().splitlines()
        ),
        key=lambda e: e["t"],
    )
    result = breakdown(requests, events)
    print_breakdown(result, args.length)
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, **result})
        )


if __name__ == "__main__":
    main()
