"""Copy-engine benchmark: scattered KV fragments between a device and a host pool.

    python -m benchmarks.copy_benchmark [--device cpu|cuda|npu] [--json]

For every direction and fragment size, fragments go from random slots of
the source pool to random slots of the destination pool, laid out so that
the op's coalescer can merge nothing (asserted through the count it
returns), by each method in turn: ``contiguous`` (the limit: one copy of
the same bytes), on cpu ``memcpy`` and ``torch_copy`` (references for the
limit), ``loop`` (one ``copy_`` per fragment) and ``op`` (one call for the
batch through the first copy path the worker's self-check tries short of
the torch path: ours on cpu and npu, vLLM's ``swap_blocks_batch`` on cuda).
Repeats are interleaved, medians reported in GB/s = 1e9 B/s, every copy
checked byte for byte. The measuring code is ``copy_bandwidth.py``, shared
with the doctor; the sections through ``CopyEngine`` (descriptor cost,
Ascend layouts) are ``copy_jobs.py``. What each method and row means, and
measured results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import torch

from benchmarks.common import add_int_args
from benchmarks.copy_jobs import descriptor_cost, layout_jobs
from vllm_ascend.kv_offload import host_guard, ops
from vllm_ascend.kv_offload.copy_bandwidth import (
    CONTIGUOUS,
    CPU_COPY_METHOD_ENV,
    DIRECTIONS,
    Device,
    by_case,
    measure,
)

KiB = 1 << 10
MiB = 1 << 20
DEFAULT_FRAGMENT_BYTES = (16 * KiB, 64 * KiB, 256 * KiB, MiB)
DEFAULT_TOTAL_BYTES = {"cpu": 64 * MiB, "cuda": 256 * MiB, "npu": 256 * MiB}


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return "cpu"
    return "npu" if torch.npu.is_available() else "cpu"


def run_copies(
    args: argparse.Namespace, device: Device
) -> tuple[list[dict], str | None]:
    """The copy rows of ``args`` (``copy_bandwidth.measure``); exits naming
    the first method that copied wrong bytes."""
    total = args.total_bytes or DEFAULT_TOTAL_BYTES[device.name]
    plan = [(f, args.num_fragments or max(1, total // f)) for f in args.fragment_bytes]
    directions = list(DIRECTIONS) if args.direction == "both" else [args.direction]
    rows, op_missing = measure(
        device, plan, directions, args.repeats, args.seed, args.concurrent
    )
    for row in rows:
        if not row["verified"]:
            raise SystemExit(f"benchmark: {row['failure']}")
    return rows, op_missing


# --------------------------------------------------------------------------
# Output and entry point.
# --------------------------------------------------------------------------


def print_table(
    args: argparse.Namespace,
    device: Device,
    rows: list[dict],
    desc: dict | None,
    op_missing: str | None,
) -> None:
    print(
        f"copy-engine benchmark: device={device.name}, host pool "
        f"{'pinned' if device.pinned else 'pageable'}, median of {args.repeats} "
        f"interleaved repeats, GB/s = 1e9 B/s, (x%) = of contiguous"
    )
    if device.name == "cpu":
        print(
            f"torch threads {torch.get_num_threads()}; settle "
            f"{device.settle_s * 1e3:g} ms; swap_blocks_batch "
            f"{'native' if ops.HAS_NATIVE_OP else 'not built'}; contiguous = "
            "swap_blocks_batch with one fragment (the op's own copy routine and "
            f"threads); {CPU_COPY_METHOD_ENV}="
            f"{os.environ.get(CPU_COPY_METHOD_ENV, 'auto')}"
        )
    else:
        print("contiguous = one copy_(non_blocking=True) of all bytes")
    if device.op_path is not None:
        print(f"op = copy path {device.op_path.name}")
    if op_missing:
        print(f"op: n/a, {op_missing}")
    methods = list(dict.fromkeys(r["method"] for r in rows))
    head = f"{'dir':<8}{'fragment':>10}{'n':>8}" + "".join(f"{m:>18}" for m in methods)
    vs_memcpy = "memcpy" in methods and "op" in methods
    print(head + f"{'op copies':>11}" + (f"{'op/memcpy':>11}" if vs_memcpy else ""))
    for (direction, frag, n), by_method in by_case(rows).items():
        line = f"{direction:<8}{format_bytes(frag):>10}{n:>8}"
        for m in methods:
            r = by_method[m]
            if m == CONTIGUOUS:
                line += f"{r['gbps']:>18.2f}"
            else:
                line += f"{r['gbps']:>11.2f} ({r['ratio_to_contiguous']:>3.0%})"
        op = by_method.get("op")
        line += f"{op['copies_per_direction'] if op else 'n/a':>11}"
        if vs_memcpy:
            line += f"{op['gbps'] / by_method['memcpy']['gbps']:>11.0%}"
        print(line)
    if desc:
        print(
            f"\ndescriptors: CopyEngine.build of one store job, "
            f"{desc['num_fragments']} fragments of {desc['fragment_bytes']} B "
            f"({desc['num_tensors']} tensors x {desc['blocks']} blocks), median of "
            f"{desc['repeats']}"
        )
        print(
            f"  build           {desc['build_ms']:8.2f} ms  "
            f"{desc['build_us_per_fragment']:.3f} us/fragment"
        )
        print(
            f"  build + submit  {desc['build_submit_ms']:8.2f} ms  "
            f"{desc['build_submit_us_per_fragment']:.3f} us/fragment  "
            f"({desc['copies_after_merging']} copies after merging)"
        )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.copy_benchmark",
        description="Scattered KV-fragment copies: contiguous limit vs per-fragment "
        "loop vs swap_blocks_batch, plus descriptor build cost.",
    )
    size = host_guard.size_flag
    p.add_argument("--device", choices=("cpu", "cuda", "npu"), default=None)
    p.add_argument(
        "--fragment-bytes", nargs="+", type=size, default=list(DEFAULT_FRAGMENT_BYTES),
        help="fragment sizes (default 16K 64K 256K 1M)",
    )  # fmt: skip
    p.add_argument(
        "--total-bytes", type=size, help="bytes per row without --num-fragments "
        "(default 256M on devices, 64M on cpu)",
    )  # fmt: skip
    p.add_argument("--direction", choices=("d2h", "h2d", "both"), default="both")
    p.add_argument(
        "--concurrent", action="store_true",
        help="also time d2h and h2d at once on two streams (devices only)",
    )  # fmt: skip
    p.add_argument(
        "--settle-ms", type=float, default=30.0,
        help="cpu only: idle gap before each timed copy, so that torch's "
        "OpenMP workers (spinning ~10 ms after the previous method) are asleep",
    )  # fmt: skip
    add_int_args(p, {
        "num-fragments": (None, "fragments per row (default: --total-bytes / "
                          "fragment size)"),
        "repeats": 20, "seed": 0,
        "layout-blocks": (8, "device blocks per Ascend-layout store job (0 skips; "
                          "imports vLLM)"),
        "descriptor-fragments": (50_000, "fragments of the descriptor-cost job "
                                 "(0 skips that section)"),
        "descriptor-tensors": (40, "cached tensors of the descriptor-cost job "
                               "(e.g. 20 layers x K/V)"),
    })  # fmt: skip
    p.add_argument("--descriptor-fragment-bytes", type=size, default=64)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    args = p.parse_args(argv)
    args.device = args.device or default_device()
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.num_fragments is not None and args.num_fragments < 1:
        p.error("--num-fragments must be >= 1")
    if args.concurrent and args.device == "cpu":
        p.error("--concurrent needs a device (the cpu backend is synchronous)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        device = Device(args.device)
    except RuntimeError as e:
        raise SystemExit(f"benchmark: {e}") from None
    device.settle_s = args.settle_ms / 1e3
    torch.manual_seed(args.seed)  # device-side random sources
    rows, op_missing = run_copies(args, device)
    desc, layouts, run = None, [], (args.repeats, args.seed)
    if args.descriptor_fragments > 0:
        sizes = (args.descriptor_fragment_bytes, args.descriptor_tensors)
        desc = descriptor_cost(device, args.descriptor_fragments, *sizes, *run)
    if args.layout_blocks > 0 and not op_missing:
        layouts = layout_jobs(device, args.layout_blocks, *run)
    if args.json:
        for row in rows + ([desc] if desc else []) + layouts:
            print(json.dumps(row))
    else:
        print_table(args, device, rows, desc, op_missing)
        for row in layouts:
            print(
                f"layout {row['layout']:<22} {row['num_fragments']:6d} fragments "
                f"of {format_bytes(int(row['mean_fragment_bytes']))} mean: "
                f"{row['gbps']:6.2f} GB/s vs contiguous {row['contiguous_gbps']:6.2f} "
                f"({row['ratio_to_contiguous']:.0%})"
            )
    if op_missing:
        print(f"benchmark: op not timed: {op_missing}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
