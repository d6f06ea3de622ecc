"""``python -m vllm_ascend.kv_offload.doctor``: can KV offloading run here?

One line per check, for a first run and for bug reports: versions, the
platform, the op's backends, a test pool, the worker's self-check and the copy
path it binds, with ``--model DIR`` one CPU block (``sizing``) and how many fit
in host memory (``host_guard``), and a bandwidth table by the copy benchmark's
code (``copy_bandwidth``). Exit status 1 when something is broken (a FAIL
line); a model the sizing does not cover warns "cannot size this model: <why>".
"""

from __future__ import annotations

import argparse
import json
import os
import platform as py_platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

import vllm_ascend.kv_offload as kv_offload

# Modules that import vLLM's platform are imported by the checks that need
# them: a platform that fails to resolve is then one FAIL line, not a crash.
from vllm_ascend.kv_offload import copy_bandwidth, host_guard, ops, sizing
from vllm_ascend.kv_offload.upstream_guard import refuse_conflicting_upstream

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"
NOT_FOUND = "not found"
# Where CANN and the Ascend driver write their versions.
_CANN_HOMES = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
_CANN_FILES = ("version.cfg", "*-linux/ascend_toolkit_install.info")
_DRIVER_FILE = Path("/usr/local/Ascend/driver/version.info")
MAX_TEST_FRAGMENT_BYTES = 8 << 20  # larger would only allocate more, same code
# Qwen3-0.6B's K (or V) page of one 128-token device block, without --model.
_DEFAULT_FRAGMENT = 8 * 128 * 2 * 128
# The copy benchmark's methods shown: the limit, the naive loop, the op.
_METHODS = ("contiguous", "loop", "op")
_DIRECTION = {"d2h": "store", "h2d": "load"}
_REPORTED = ("copy_path", "vllm_platform", "bytes_per_cpu_block", "host")
_REPORTED += ("max_num_cpu_blocks", "cpu_bytes_to_use", "sizing")


class Report:
    def __init__(self, fields: dict[str, Any]) -> None:
        self.checks: list[dict[str, Any]] = []
        self.fields = fields  # the --json object

    def add(self, name: str, status: str, summary: str, lines=()) -> None:
        """One check's line; ``lines``: text lines under it."""
        self.checks.append(dict(name=name, status=status, summary=summary, lines=lines))


def _dist(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return NOT_FOUND


def _version_in(path: Path) -> str | None:
    """``version=...`` of an Ascend version file."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        key, sep, value = line.partition("=")
        if sep and key.strip().lower() in ("version", "runtime_version"):
            return value.strip().strip('"')
    return None


def _cann() -> str:
    homes = [os.environ[v] for v in _CANN_HOMES if os.environ.get(v)]
    for home in [*homes, "/usr/local/Ascend/ascend-toolkit/latest"]:
        for pattern in _CANN_FILES:
            for path in sorted(Path(home).glob(pattern)):
                if version := _version_in(path):
                    return f"{version} ({path})"
    return NOT_FOUND


def _torch_npu() -> tuple[str, str | None]:
    """(version, why the NPU is unusable or None)."""
    try:
        import torch_npu  # noqa: F401  (fails without CANN or a driver)
    except Exception as e:
        return _dist("torch_npu"), f"import torch_npu failed: {type(e).__name__}: {e}"
    usable = torch.npu.is_available()
    return _dist("torch_npu"), None if usable else "torch.npu.is_available() is False"


def check_versions(report: Report, npu_version: str) -> None:
    try:
        import vllm

        vllm_version = vllm.__version__
    except Exception as e:
        vllm_version = f"{NOT_FOUND} ({type(e).__name__}: {e})"
    v = report.fields["versions"] = {
        "python": py_platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or NOT_FOUND,
        "torch_npu": npu_version,
        "cann": _cann(),
        # The Ascend driver's (vLLM's collect_env has NVIDIA's).
        "driver": _version_in(_DRIVER_FILE) or NOT_FOUND,
        "vllm": vllm_version,
        "vllm_ascend_upstream": _dist("vllm-ascend"),
        "vllm_ascend_kv_offload": kv_offload.__version__,
    }
    lines = [f"{k:<23} {v[k]}" for k in v if k != "python"]
    summary = f"python {v['python']}; the rest: python -m vllm.collect_env"
    report.add("versions", OK, summary, lines)
    try:
        if vllm_version.startswith(NOT_FOUND):
            raise ImportError(f"vLLM {vllm_version}: install vLLM 0.30-0.33")
        refuse_conflicting_upstream(kv_offload.__version__)
    except ImportError as e:
        return report.add("vllm", FAIL, str(e))
    up = v["vllm_ascend_upstream"]
    up = "not installed" if up == NOT_FOUND else f"{up}: coexists"
    report.add("vllm", OK, f"vLLM {vllm_version}; upstream vllm-ascend {up}")


def check_platform(report: Report, npu_problem: str | None) -> None:
    torch_device = report.fields["torch_device"]
    try:
        from vllm.platforms import current_platform

        vllm_device = str(current_platform.device_type)
    except Exception as e:
        # E.g. upstream vllm-ascend's platform plugin importing a missing
        # torch_npu: vLLM cannot start here, and says so only in a traceback.
        summary = f"torch: {torch_device}; vLLM could not resolve its platform "
        summary += f"({type(e).__name__}: {e})"
        if "torch_npu" in str(e):
            summary += (
                ". If upstream vllm-ascend is installed on a machine without "
                "torch_npu, its platform plugin fails so; check the rest with "
                "VLLM_PLUGINS=ascend_kv_offload (this package's plugin alone)"
            )
        report.add("platform", FAIL, summary)
        return
    report.fields["vllm_platform"] = vllm_device
    status, note = OK, ""
    if vllm_device != torch_device:
        status = WARN
        note = f"; vLLM and torch disagree: offloading runs on vLLM's {vllm_device}"
    if npu_problem and report.fields["versions"]["torch_npu"] != NOT_FOUND:
        note += f"; torch_npu: {npu_problem}"
    cls = type(current_platform).__name__
    summary = f"torch: {torch_device}; vLLM: {vllm_device} ({cls}){note}"
    report.add("platform", status, summary)


def check_pool_allocation(report: Report, device: str, mib: int) -> None:
    """One pool of ``mib`` MiB from the pool factory, timed, and how much of
    it became resident."""
    import psutil

    from vllm_ascend.kv_offload.cpu_pool import private_pool

    before, t0 = psutil.Process().memory_info().rss, time.perf_counter()
    pool = private_pool([1 << 20], 1, mib, device)
    seconds = time.perf_counter() - t0
    resident = (psutil.Process().memory_info().rss - before) / (mib << 20)
    kind = str(pool.memory.kind)
    pool.release()
    report.fields["pool_allocation"] = dict(
        asked_bytes=mib << 20, kind=kind, seconds=seconds, resident_ratio=resident
    )
    summary = f"{mib} MiB {kind} in {seconds * 1e3:.0f} ms; resident {resident:.2f}"
    if device != "cpu" and "pageable" in kind:
        summary += " x asked; page-locked memory unavailable: slower transfers"
        return report.add("pool alloc", WARN, summary)
    report.add("pool alloc", OK, summary + " x asked")


def check_copy_path(report: Report, device: str, fragments: Sequence[int]) -> None:
    """The worker's self-check on scratch memory: the path it binds."""
    from vllm_ascend.kv_offload import self_check

    result = self_check.run_self_check(device, list(fragments))
    lines = [f"{a.path}: {a.failure or 'byte-exact'}" for a in result.attempts]
    if not result.passed:
        report.fields["self_check"] = f"failed: {result.failure}"
        report.add("self-check", FAIL, report.fields["self_check"], lines)
        report.add("copy path", FAIL, f"none on {device} is byte-exact")
        return
    report.fields["self_check"] = "passed"
    report.fields["copy_path"] = result.path
    report.add("self-check", OK, result.summary(), lines)
    report.add("copy path", OK, f"{result.path}: the first byte-exact one, bound")


def check_bandwidth(
    report: Report, device: str, fragments: Sequence[int], mib: int, rounds: int
) -> None:
    bench = copy_bandwidth.Device(device)
    bench.settle_s = 0.01  # let torch's OpenMP workers sleep between methods
    plan = [(f, max(1, (mib << 20) // f)) for f in sorted(set(fragments))]
    found, _ = copy_bandwidth.measure(bench, plan, repeats=rounds, only=_METHODS)
    rows, lines = [], [f"{'GB/s':<8}{'direction':<10}{'fragment':>10}"]
    lines[0] += "".join(f"{m:>12}" for m in _METHODS)
    for (direction, frag, n), by in copy_bandwidth.by_case(found).items():
        gbps = {m: r["gbps"] for m, r in by.items()}
        # Contiguous is the limit the others are measured against.
        ok = {m: r["verified"] for m, r in by.items() if m != "contiguous"}
        rows.append({"direction": _DIRECTION[direction], "fragment_bytes": frag,
                     "fragments": n, "gbps": gbps, "verified": ok})  # fmt: skip
        cells = "".join(f"{gbps.get(m, float('nan')):12.2f}" for m in _METHODS)
        lines.append(f"{'':<8}{_DIRECTION[direction]:<10}{frag >> 10:>6} KiB{cells}")
    report.fields["bandwidth"] = rows
    wrong = [f"{r['method']} ({_DIRECTION[r['direction']]}, {r['fragment_bytes']} B)"
             for r in found if not r["verified"]]  # fmt: skip
    if wrong:
        why = "offloading this way would corrupt KV: attach this to a bug report"
        summary = f"WRONG BYTES from {', '.join(wrong)}; {why}"
        return report.add("bandwidth", FAIL, summary, lines)
    summary = (
        f"{plan[0][1]} scattered fragments per copy (store: KV cache -> CPU "
        f"pool, load: back), median of {rounds} rounds, verified byte for byte"
    )
    report.add("bandwidth", OK, summary, lines)


def _reserve(args: argparse.Namespace, vllm_device: str | None) -> tuple[int, str]:
    """Host memory vLLM takes before the pool: on its CPU backend the device
    KV cache is host memory too (VLLM_CPU_KVCACHE_SPACE GiB)."""
    if args.reserve_gib is not None:
        return int(args.reserve_gib * 2**30), f"{args.reserve_gib:g} GiB kept back"
    gib = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if vllm_device != "cpu":
        return 0, ""
    if gib.isdigit() and int(gib) > 0:
        return int(gib) << 30, f"VLLM_CPU_KVCACHE_SPACE={gib} GiB kept back"
    why = "its KV cache: set VLLM_CPU_KVCACHE_SPACE, or --reserve-gib"
    return 0, f"vLLM's CPU backend also takes host memory for {why}"


def check_sizing(report: Report, args: argparse.Namespace) -> list[int]:
    """One CPU block of ``--model`` and how many fit in host memory now;
    returns the model's fragment sizes."""
    if args.model is None:
        summary = "no --model DIR: pass a local model directory (config.json is "
        report.add("sizing", SKIP, summary + "enough) for the CPU block size")
        return []
    vllm_device = report.fields["vllm_platform"]
    try:
        s = sizing.size_model_dir(
            args.model,
            block_size=args.block_size,
            device_block_size=args.device_block_size
            or (16 if vllm_device == "cuda" else 128),
            tensor_parallel_size=args.tensor_parallel_size,
            kv_cache_dtype=args.kv_cache_dtype,
            dtype=args.dtype,
        )
    except sizing.SizingError as e:
        report.fields["sizing"] = {"error": str(e)}
        if isinstance(e, sizing.UnsupportedModelError):
            # Offloading may still run (the worker logs its block size).
            report.add("sizing", WARN, f"cannot size this model: {e}")
        else:  # a config.json with a size out of bounds or missing
            report.add("sizing", FAIL, f"{args.model}: {e}")
        return []
    report.fields["sizing"] = asdict(s)  # tuples: JSON lists
    report.fields["bytes_per_cpu_block"] = s.bytes_per_cpu_block
    heads = f"{s.kv_heads_per_worker} KV heads/worker x head size {s.head_size}"
    heads = f"MLA latent {s.head_size}" if s.attention == "mla" else heads
    lines = [
        f"model: {s.model_type}, {s.attention.upper()}, {s.num_attention_layers} "
        f"attention layers of {s.num_layers}, {heads}, KV {s.kv_cache_dtype}, "
        f"TP {s.tensor_parallel_size}",
        f"CPU block: {s.block_size} tokens ({s.blocks_per_chunk} device "
        f"block(s) of {s.device_block_size}) = {s.bytes_per_cpu_block:,} bytes "
        f"({s.bytes_per_cpu_block / 2**20:.2f} MiB){'' if s.exact else ' at least'}",
    ] + [f"note: {n}" for n in s.notes]
    reserve, reserve_note = _reserve(args, vllm_device)
    try:
        fit = host_guard.fit_host_memory(s, reserved_bytes=reserve)
    except sizing.SizingError as e:  # a host-budget setting that is not one
        report.add("sizing", FAIL, str(e), lines)
        return list(s.fragment_bytes)
    report.fields["host"] = asdict(fit)
    lines.append(
        f"host: {fit.available_bytes / 2**30:.2f} GiB available"
        + (f", {reserve_note}" if reserve_note else "")
        + f"; the guard allows {fit.usable_bytes / 2**30:.2f} GiB for "
        f"{fit.workers_on_host} worker pool(s)"
    )
    if not s.exact:  # a lower bound: a count from it could exceed the host
        report.add("sizing", WARN, "hybrid model: no exact count (see note)", lines)
    elif fit.max_num_cpu_blocks == 0:
        report.add("sizing", FAIL, "not even one CPU block fits in host memory now")
    else:
        report.fields["max_num_cpu_blocks"] = fit.max_num_cpu_blocks
        report.fields["cpu_bytes_to_use"] = fit.cpu_bytes_to_use
        summary = (
            f"num_cpu_blocks <= {fit.max_num_cpu_blocks} (cpu_bytes_to_use="
            f"{fit.cpu_bytes_to_use}) fits now; leave room for what else runs"
        )
        report.add("sizing", OK, summary, lines)
    return list(s.fragment_bytes)


_OPTIONS = (  # flag, type, default, help
    ("--model", str, None, "local Hugging Face model directory, or its config.json"),
    ("--block-size", int, 128, "tokens per CPU block: the guide's block_size"),
    ("--device-block-size", int, None, "vLLM's KV block size (default 128, cuda 16)"),
    ("--tensor-parallel-size", int, 1, "as vLLM's"),
    ("--kv-cache-dtype", str, "auto", "as vLLM's"),
    ("--dtype", str, "auto", "as vLLM's"),
    ("--reserve-gib", float, None, "host memory kept for what vLLM allocates "
     "before the pool (default: VLLM_CPU_KVCACHE_SPACE on the CPU backend)"),
    ("--alloc-mib", int, 256, "test pool size, MiB; 0 skips it"),
    ("--bandwidth-mib", int, 16, "MiB per timed copy; 0 skips the table"),
    ("--rounds", int, 3, "timed rounds per copy"),
    ("--device", str, None, "cpu, cuda or npu (default: vLLM's platform)"),
)  # fmt: skip


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="vllm-ascend-kv-offload-doctor",
        description="Checks that KV-cache CPU offloading can run here, and sizes "
        "its CPU pool for a model.",
    )
    for flag, kind, default, text in _OPTIONS:
        shown = text if default is None else f"{text} (default {default})"
        p.add_argument(flag, type=kind, default=default, help=shown)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> Report:
    """Every check; one that crashes is a FAIL line and the rest still run (a
    report with one broken part is still worth attaching)."""
    t0 = time.perf_counter()
    # Present whatever happens below (--json promises them).
    report = Report(dict.fromkeys(_REPORTED, None) | {"self_check": "not run"})
    npu_version, npu_problem = _torch_npu()
    cuda = torch.cuda.is_available()
    torch_device = "npu" if npu_problem is None else "cuda" if cuda else "cpu"
    report.fields["torch_device"] = torch_device

    def guarded(name: str, fn: Callable[..., Any], *fn_args: Any) -> Any:
        try:
            return fn(report, *fn_args)
        except Exception as e:
            report.add(name, FAIL, f"the check crashed: {type(e).__name__}: {e}")

    guarded("versions", check_versions, npu_version)
    guarded("platform", check_platform, npu_problem)
    device = args.device or report.fields["vllm_platform"] or torch_device
    report.fields["platform"] = device
    backends = report.fields["native_backends"] = list(ops.native_backends())
    op = f"native op loaded, backends: {', '.join(backends) or 'none'}"
    op = op if ops.HAS_NATIVE_OP else f"no native op: {ops.fallback_reason()}"
    report.add("backends", OK, op)
    fragments = guarded("sizing", check_sizing, args) or [_DEFAULT_FRAGMENT]
    if args.alloc_mib > 0:
        guarded("pool alloc", check_pool_allocation, device, args.alloc_mib)
    fragments = [min(f, MAX_TEST_FRAGMENT_BYTES) for f in fragments]
    guarded("self-check", check_copy_path, device, fragments)
    if args.bandwidth_mib > 0:
        mib = args.bandwidth_mib
        guarded("bandwidth", check_bandwidth, device, fragments, mib, args.rounds)
    report.fields["seconds"] = round(time.perf_counter() - t0, 2)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    report = run(args)
    failed = [c["name"] for c in report.checks if c["status"] == FAIL]
    if args.json:
        out = dict(report.fields, ok=not failed, checks=report.checks)
        print(json.dumps(out, indent=2))
        return 1 if failed else 0
    print(f"vllm-ascend-kv-offload doctor {kv_offload.__version__}")
    for c in report.checks:
        print(f"[{c['status']:^4}] {c['name']:<11} {c['summary']}")
        print("".join(f"{'':18}{line}\n" for line in c["lines"]), end="")
    verdict = f"BROKEN: {', '.join(failed)} failed" if failed else "OK"
    print(f"{verdict} ({report.fields['seconds']:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
