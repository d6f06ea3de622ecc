"""Copy-engine benchmark: scattered KV fragments between a device and a host pool.

    python -m benchmarks.copy_benchmark [--device cpu|cuda|npu] [--json]

For every direction and fragment size, ``num_fragments`` fragments of
``fragment_bytes`` are copied from random slots of the source pool to random
slots of the destination pool (two independent permutations, rejected while
any neighbouring pair is adjacent on both sides, so the op's coalescer merges
nothing -- asserted through the count it returns). Measured in the same run,
with the repeats interleaved (method order rotated each repeat) and the median
reported, in GB/s = 1e9 bytes/s:

``contiguous``
    The limit: one copy of the same total bytes. On a device, one
    ``copy_(non_blocking=True)`` of the whole pool, i.e. one DMA. On cpu,
    ``swap_blocks_batch`` with a single fragment: one copy split over the
    same threads, with the same copy routine (non-temporal stores for large
    jobs on AVX2 CPUs), as the scattered call, so the ratio isolates the cost
    of scattering.
``memcpy`` (cpu only, native op)
    The same single fragment with ``VLLM_ASCEND_CPU_COPY_METHOD=memcpy``:
    one plain glibc ``memcpy`` of all the bytes over the same threads.
``torch_copy`` (cpu only)
    One ``Tensor.copy_`` of the whole pool, as another reference for the limit.
``loop``
    The naive baseline: one ``copy_(non_blocking=True)`` per fragment on
    pre-sliced tensor views (on a device one async memcpy each).
``op``
    One call for the whole batch through the copy path the worker's
    self-check tries first, short of the torch path (``copy_paths.py``): our
    op's ``swap_blocks_batch`` on cpu and npu, vLLM's ``swap_blocks_batch``
    on cuda (``vllm-batch``). The rows name it (``op_path``).

The host pool is pinned on devices; on cpu the "device" pool is host memory
too and ``d2h`` / ``h2d`` only name which pool is the source. Device timings
use events on a side stream; cpu timings use ``time.perf_counter`` (the cpu
backend is synchronous) after an idle gap (``--settle-ms``): torch's OpenMP
workers keep a core busy for ~10 ms after a parallel region, which on a small
machine slows whatever is timed next. Before timing, every method copies once
into a poisoned destination and the result is checked byte for byte against
the random source; the op is checked again after timing.

The descriptor section times the real ``CopyEngine.build`` on synthetic
``CanonicalKVCaches`` (tiny pages, e.g. 64 B, so that copying is small),
alone and together with ``CopyEngine.submit`` (on the worker's first
candidate path, ``op`` where there is one), and reports host microseconds
per fragment. On a device the submit time is the enqueue cost only; on cpu
it includes copying the tiny fragments (an upper bound on the submit cost).
This section imports vLLM; ``--descriptor-fragments 0`` skips it.

The layout section runs one real store job per Ascend KV-cache shape
(28 layers of bf16 ``(K, V)`` with 8 KV heads x 128; 61 MLA layers of
``(nope 512, rope 64)``) through ``kv_layout.canonicalize`` and
``CopyEngine``, scattered blocks, against one contiguous copy of the same
bytes, verified byte for byte (``"kind": "layout_job"`` rows). It imports vLLM
too; ``--layout-blocks 0`` skips it.

``--json`` prints one object per line: ``"kind": "copy"`` rows (``device``,
``direction``, ``fragment_bytes``, ``num_fragments``, ``method``, ``gbps``,
``contiguous_gbps``, ``ratio_to_contiguous``, ``verified``, ...) and one
``"kind": "descriptor_cost"`` row.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch

from vllm_ascend.kv_offload import ops
from vllm_ascend.kv_offload.copy_bandwidth import (
    CONTIGUOUS,
    CPU_COPY_METHOD_ENV,
    DIRECTIONS,
    POISON,
    Device,
    by_case,
    measure,
    scatter_slots,
)

KiB = 1 << 10
MiB = 1 << 20
DEFAULT_FRAGMENT_BYTES = (16 * KiB, 64 * KiB, 256 * KiB, MiB)
DEFAULT_TOTAL_BYTES = {"cpu": 64 * MiB, "cuda": 256 * MiB, "npu": 256 * MiB}


_UNITS = {"": 1, "B": 1, "K": KiB, "KB": KiB, "KIB": KiB}
_UNITS |= {"M": MiB, "MB": MiB, "MIB": MiB, "G": 1 << 30, "GB": 1 << 30}
_UNITS |= {"GIB": 1 << 30}


def parse_bytes(text: str) -> int:
    """``"64K"``, ``"64KiB"``, ``"1M"``, ``"4096"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}; use e.g. 4096, 16K, 64KiB, 1M"
        )
    value = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


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
# Host cost of building descriptors and submitting them.
# --------------------------------------------------------------------------


def descriptor_cost(
    device: Device,
    num_fragments: int,
    fragment_bytes: int,
    num_tensors: int,
    repeats: int,
    seed: int,
) -> dict:
    """Times CopyEngine.build, and build + submit, for one store job of
    ``num_fragments`` tiny fragments (``num_tensors`` cached tensors, e.g.
    layers x K/V, times ``ceil(num_fragments / num_tensors)`` blocks)."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )

    from vllm_ascend.kv_offload.copy_engine import CopyEngine
    from vllm_ascend.kv_offload.cpu_pool import private_pool

    num_tensors = max(1, min(num_tensors, num_fragments))
    blocks = -(-num_fragments // num_tensors)
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for _ in range(num_tensors):
        t = device.empty(blocks * fragment_bytes, on_device=True)
        data = torch.randint(
            -128, 128, (blocks * fragment_bytes,), dtype=torch.int8, generator=gen
        )
        t.copy_(data)
        tensors.append(t.view(blocks, fragment_bytes))
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, fragment_bytes) for t in tensors],
        group_data_refs=[
            [CanonicalKVCacheRef(i, fragment_bytes) for i in range(num_tensors)]
        ],
    )
    pool = private_pool([fragment_bytes] * num_tensors, 1, blocks, device.name)
    engine = CopyEngine(kv, pool)
    engine.use(device.paths[0].bind(engine.buffers()))
    rng = np.random.default_rng(seed)
    dev_ids, cpu_ids = scatter_slots(blocks, rng)
    spec = GPULoadStoreSpec(dev_ids.tolist(), group_sizes=[blocks], block_indices=[0])
    device.synchronize()

    merged = 0

    def build():
        return engine.build(spec, cpu_ids, to_cpu=True)

    def build_submit():
        nonlocal merged
        # The workspace is returned to be kept until the synchronize below.
        merged, workspace = engine.submit(engine.build(spec, cpu_ids, to_cpu=True))
        return workspace

    t_build: list[float] = []
    t_both: list[float] = []
    timed = ((build, t_build), (build_submit, t_both))
    for r in range(repeats + 1):  # the first round warms up; order alternates
        for fn, out in timed if r % 2 else timed[::-1]:
            t0 = time.perf_counter()
            result = fn()
            elapsed = time.perf_counter() - t0
            device.synchronize()
            del result  # the workspace (if any) outlived the copies
            if r:
                out.append(elapsed)

    n = build().num_fragments
    # The store must have put block dev_ids[j] of tensor t in CPU row cpu_ids[j].
    rows = pool.tensor.view(blocks, num_tensors, fragment_bytes)
    cpu_idx, dev_idx = torch.from_numpy(cpu_ids), torch.from_numpy(dev_ids)
    verified = all(
        torch.equal(rows[cpu_idx, t], tensors[t].cpu()[dev_idx])
        for t in range(num_tensors)
    )
    if not verified:
        raise SystemExit("benchmark: CopyEngine build + submit copied wrong bytes")
    return {
        "kind": "descriptor_cost",
        "device": device.name,
        "copy_path": device.paths[0].name,
        "num_fragments": n,
        "fragment_bytes": fragment_bytes,
        "num_tensors": num_tensors,
        "blocks": blocks,
        "build_us_per_fragment": statistics.median(t_build) / n * 1e6,
        "build_submit_us_per_fragment": statistics.median(t_both) / n * 1e6,
        "build_ms": statistics.median(t_build) * 1e3,
        "build_submit_ms": statistics.median(t_both) * 1e3,
        "copies_after_merging": merged,
        "repeats": repeats,
        "verified": verified,
    }


# Ascend KV-cache shapes (bf16, 128-token blocks): the parts of one layer.
LAYOUTS: dict[str, tuple[int, tuple[tuple[int, ...], ...]]] = {
    # 28 standard-attention layers, (K, V) of 8 KV heads x 128.
    "kv_tuple_28x(8x128)": (28, ((128, 8, 128), (128, 8, 128))),
    # 61 MLA layers, (nope, rope) of widths 512 and 64.
    "mla_61x(512,64)": (61, ((128, 1, 512), (128, 1, 64))),
}


def layout_jobs(device: Device, blocks: int, repeats: int, seed: int) -> list[dict]:
    """One real store job per Ascend layout through ``kv_layout`` and
    ``CopyEngine`` (scattered blocks), timed against one contiguous copy of
    the same bytes, and checked byte for byte."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from vllm_ascend.kv_offload.copy_engine import CopyEngine
    from vllm_ascend.kv_offload.cpu_pool import private_pool
    from vllm_ascend.kv_offload.kv_layout import canonicalize

    rows = []
    rng = np.random.default_rng(seed)
    for name, (layers, part_shapes) in LAYOUTS.items():
        caches = {}
        for layer in range(layers):
            parts = []
            for shape in part_shapes:
                numel = blocks * int(np.prod(shape))
                t = device.empty(numel * 2, on_device=True).view(torch.bfloat16)
                parts.append(t.view(blocks, *shape))
            caches[f"layers.{layer}"] = tuple(parts)
        kv = canonicalize(caches, [list(caches)], blocks)
        for t in kv.tensors:
            t.tensor.copy_(torch.randint(-128, 128, t.tensor.shape, dtype=torch.int8))
        pages = [t.page_size_bytes for t in kv.tensors]
        pool = private_pool(pages, 1, blocks, device.name)
        engine = CopyEngine(kv, pool)
        assert device.op_path is not None  # run only where there is one
        engine.use(device.op_path.bind(engine.buffers()))
        dev_ids, cpu_ids = scatter_slots(blocks, rng)
        spec = GPULoadStoreSpec(dev_ids.tolist(), [blocks], [0])
        desc = engine.build(spec, cpu_ids, to_cpu=True)
        flat_src = device.empty(desc.num_bytes, on_device=True)
        flat_dst = device.empty(desc.num_bytes, on_device=False)
        # Written before timing: never-touched pageable memory reads as the
        # kernel's shared zero page, from cache, and would flatter the limit.
        flat_src.fill_(1)
        flat_dst.fill_(POISON)

        def contiguous(src=flat_src, dst=flat_dst) -> None:
            if device.name == "cpu":
                one = torch.tensor([src.data_ptr()], dtype=torch.int64)
                to = torch.tensor([dst.data_ptr()], dtype=torch.int64)
                size = torch.tensor([src.numel()], dtype=torch.int64)
                ops.swap_blocks_batch(one, to, size, "cpu")
            else:
                dst.copy_(src, non_blocking=True)

        def job(desc=desc, engine=engine):
            return engine.submit(desc)  # (copies, workspace)

        times: dict[str, list[float]] = {"contiguous": [], "op": []}
        for r in range(repeats + 1):  # the first round warms up
            for method, fn in (("contiguous", contiguous), ("op", job))[
                :: 1 if r % 2 else -1
            ]:
                device.synchronize()
                if device.name == "cpu":
                    time.sleep(device.settle_s)
                t0 = time.perf_counter()
                result = fn()
                device.synchronize()
                del result  # the workspace (if any) outlived the copies
                if r:
                    times[method].append(time.perf_counter() - t0)
        rows_cpu = pool.tensor.view(blocks, -1)
        cpu_idx, dev_idx = torch.from_numpy(cpu_ids), torch.from_numpy(dev_ids)
        offsets = [0, *np.cumsum(pages)]
        verified = all(
            torch.equal(
                rows_cpu[cpu_idx, offsets[i] : offsets[i + 1]],
                t.tensor.cpu()[dev_idx],
            )
            for i, t in enumerate(kv.tensors)
        )
        if not verified:
            raise SystemExit(f"benchmark: layout job {name} copied wrong bytes")
        op_s = statistics.median(times["op"])
        cont_s = statistics.median(times["contiguous"])
        rows.append(
            {
                "kind": "layout_job",
                "device": device.name,
                "layout": name,
                "blocks": blocks,
                "num_fragments": desc.num_fragments,
                "mean_fragment_bytes": desc.num_bytes / desc.num_fragments,
                "bytes": desc.num_bytes,
                "gbps": desc.num_bytes / op_s / 1e9,
                "contiguous_gbps": desc.num_bytes / cont_s / 1e9,
                "ratio_to_contiguous": cont_s / op_s,
                "repeats": repeats,
                "verified": verified,
            }
        )
    return rows


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
            f"{'native' if ops.HAS_NATIVE_OP else 'Python fallback'}; contiguous = "
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
    head = f"{'dir':<8}{'fragment':>10}{'n':>8}"
    for m in methods:
        head += f"{m:>18}"
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
    p.add_argument("--device", choices=("cpu", "cuda", "npu"), default=None)
    p.add_argument(
        "--fragment-bytes",
        nargs="+",
        type=parse_bytes,
        default=list(DEFAULT_FRAGMENT_BYTES),
        help="fragment sizes (default 16K 64K 256K 1M)",
    )
    p.add_argument(
        "--num-fragments",
        type=int,
        default=None,
        help="fragments per row (default: --total-bytes / fragment size)",
    )
    p.add_argument(
        "--total-bytes",
        type=parse_bytes,
        default=None,
        help="bytes per row when --num-fragments is not given "
        "(default 256M on devices, 64M on cpu)",
    )
    p.add_argument("--direction", choices=("d2h", "h2d", "both"), default="both")
    p.add_argument(
        "--concurrent",
        action="store_true",
        help="also time d2h and h2d at once on two streams (devices only)",
    )
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument(
        "--settle-ms",
        type=float,
        default=30.0,
        help="cpu only: idle gap before each timed copy, so that torch's "
        "OpenMP workers (spinning ~10 ms after the previous method) are asleep",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--layout-blocks",
        type=int,
        default=8,
        help="device blocks per Ascend-layout store job (0 skips; imports vLLM)",
    )
    p.add_argument(
        "--descriptor-fragments",
        type=int,
        default=50_000,
        help="fragments of the descriptor-cost job (0 skips that section)",
    )
    p.add_argument("--descriptor-fragment-bytes", type=parse_bytes, default=64)
    p.add_argument(
        "--descriptor-tensors",
        type=int,
        default=40,
        help="cached tensors of the descriptor-cost job (e.g. 20 layers x K/V)",
    )
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
    desc = None
    if args.descriptor_fragments > 0:
        desc = descriptor_cost(
            device,
            args.descriptor_fragments,
            args.descriptor_fragment_bytes,
            args.descriptor_tensors,
            args.repeats,
            args.seed,
        )
    layouts = []
    if args.layout_blocks > 0 and not op_missing:
        layouts = layout_jobs(device, args.layout_blocks, args.repeats, args.seed)
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
