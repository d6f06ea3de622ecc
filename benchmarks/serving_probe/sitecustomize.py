"""Per-step timing of a ``vllm serve`` process, loaded from outside the
runtime package: ``benchmarks/serving_profile.py`` puts this folder first on
the server's ``PYTHONPATH`` (and only the server's), so Python imports it at
start-up in every process of the server.

It wraps methods once their modules are imported (a post-import hook): the
engine step, the scheduler, the executor's model calls, the connector's
scheduler and worker calls, our worker's submissions, polls and waits, and
the copy jobs on the copy threads. Each call's *exclusive* time (minus the
wrapped calls inside it) is added to its name, in wall time and in CPU time
of the calling thread (``time.thread_time_ns``). Totals are cumulative;
every second they are written to ``$SERVING_PROBE_DIR/probe-<pid>.json``
(processes that recorded nothing write nothing), so a caller diffs two
snapshots around a workload.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time

OUT_DIR = os.environ.get("SERVING_PROBE_DIR")

SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc",
    "build_connector_meta", "update_connector_output", "request_finished",
    "request_finished_all_groups", "take_events",
)  # fmt: skip
WORKER_HOOKS = (  # get_kv_connector_stats: called on both sides
    "bind_connector_metadata", "handle_preemptions", "start_load_kv",
    "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
    "get_transfer_results", "get_block_ids_with_load_errors",
    "get_kv_connector_stats", "get_kv_connector_kv_cache_events",
    "build_connector_worker_meta", "clear_connector_metadata",
)  # fmt: skip
CONNECTOR_METHODS = SCHEDULER_HOOKS + WORKER_HOOKS
# module -> (class, method names); the stats key is "Class.method". A
# connector method is wrapped where it is defined: vLLM's OffloadingConnector
# and our subclass separately, so each one's exclusive time is its own share.
TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm.v1.engine.core": ("EngineCore", ("step", "step_with_batch_queue")),
    "vllm.v1.core.sched.scheduler": ("Scheduler", ("schedule", "update_from_output")),
    # The worker process (vLLM's CPU backend runs it beside the engine core).
    "vllm.v1.worker.gpu_worker": ("Worker", ("execute_model", "sample_tokens")),
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector": (
        "OffloadingConnector",
        CONNECTOR_METHODS,
    ),
    "vllm_ascend.kv_offload.connector": (
        "AscendOffloadingConnector",
        CONNECTOR_METHODS,
    ),
    "vllm_ascend.kv_offload.worker": (
        "NPUOffloadingWorker",
        ("submit_store", "submit_load", "get_finished", "wait", "wait_for_progress"),
    ),
}

_lock = threading.Lock()
_stats: dict[str, list[int]] = {}  # key -> [calls, wall_ns, cpu_ns]
_local = threading.local()


def _add(key: str, wall: int, cpu: int) -> None:
    with _lock:
        s = _stats.setdefault(key, [0, 0, 0])
        s[:] = s[0] + 1, s[1] + wall, s[2] + cpu


def timed(key: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        stack = _local.__dict__.setdefault("stack", [])
        frame = [0, 0]  # wall, cpu of the wrapped calls inside this one
        stack.append(frame)
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            result = fn(*args, **kwargs)
        finally:
            wall = time.perf_counter_ns() - w0
            cpu = time.thread_time_ns() - c0
            stack.pop()
            if stack:
                stack[-1][0] += wall
                stack[-1][1] += cpu
            _add(key, wall - frame[0], cpu - frame[1])
        if key == "EngineCore.step" and isinstance(result, tuple) and result[1]:
            _add("steps_with_forward", 0, 0)
        return result

    wrapper.__wrapped_by_probe__ = True
    return wrapper


def _patch(module) -> None:
    cls_name, methods = TARGETS[module.__name__]
    cls = getattr(module, cls_name)
    for name in methods:
        fn = cls.__dict__.get(name)  # defined here, not inherited
        if fn is None or getattr(fn, "__wrapped_by_probe__", False):
            continue
        setattr(cls, name, timed(f"{cls_name}.{name}", fn))
    if module.__name__ == "vllm_ascend.kv_offload.worker":
        _patch_copies(cls)


def _patch_copies(worker_cls) -> None:
    """Times each job's copy on the thread that runs it (at the top of that
    thread's stack): the worker's ``copy_job`` seam returns it wrapped."""
    make = worker_cls.copy_job

    def copy_job(self, kind: str, job_id: int, desc):
        return timed(f"copy.{kind}", make(self, kind, job_id, desc))

    worker_cls.copy_job = functools.wraps(make)(copy_job)


class _PostImport(importlib.abc.MetaPathFinder):
    """Runs ``_patch`` right after a target module is executed."""

    def __init__(self):
        self._busy: set[str] = set()

    def find_spec(self, name, path, target=None):
        if name not in TARGETS or name in self._busy:
            return None
        self._busy.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy.discard(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def snapshot() -> dict:
    with _lock:
        stats = {k: list(v) for k, v in _stats.items()}
    return {
        "pid": os.getpid(),
        "argv": sys.argv[:3],
        "time_ns": time.perf_counter_ns(),
        "process_cpu_ns": time.process_time_ns(),
        "loadavg": os.getloadavg(),
        "stats": stats,
    }


def _write() -> None:
    snap = snapshot()
    if not snap["stats"]:
        return
    path = os.path.join(OUT_DIR, f"probe-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(snap, f)
    os.replace(path + ".tmp", path)


def _writer() -> None:
    while True:
        time.sleep(1.0)
        _write()


if OUT_DIR:
    sys.meta_path.insert(0, _PostImport())
    threading.Thread(target=_writer, name="serving-probe", daemon=True).start()
    atexit.register(_write)
