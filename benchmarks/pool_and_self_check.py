"""Measures the CPU block pool's allocation (resident / asked, seconds per
GiB) before and after exact-size pool memory, in alternating rounds of one
run, and the start-up self-check's cost for a model's fragment sizes.

    python benchmarks/pool_and_self_check.py --gib 1 --rounds 3

"before": what the CPU pool was (``torch.zeros`` of the pool's shape; on an
accelerator it was ``torch.empty(..., pin_memory=True)``, not measurable
here). "after": ``cpu_pool.private_pool(..., "cpu")``, an anonymous mmap
faulted in with MADV_POPULATE_WRITE. Self-check: ``run_self_check`` on
"cpu" with the guide's Qwen3-0.6B layout by default (28 layers x K, V pages
of 128 tokens x 8 heads x 128 dims x 2 bytes = 256 KiB each).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch

from vllm_ascend.kv_offload.cpu_pool import private_pool
from vllm_ascend.kv_offload.self_check import run_self_check

GiB = 2**30


def resident() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def before(nbytes: int, row: int):
    return torch.zeros((nbytes // row, row), dtype=torch.int8)


def after(nbytes: int, row: int):
    return private_pool([row], 1, nbytes // row, "cpu")


def measure(alloc, nbytes: int, row: int) -> tuple[float, float]:
    gc.collect()
    rss0 = resident()
    t0 = time.perf_counter()
    pool = alloc(nbytes, row)
    seconds = time.perf_counter() - t0
    ratio = (resident() - rss0) / nbytes
    if hasattr(pool, "release"):
        pool.release()
    del pool
    return ratio, seconds * GiB / nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="pool size per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--page-bytes", type=int, default=128 * 8 * 128 * 2)
    p.add_argument("--checks", type=int, default=5, help="self-check repetitions")
    args = p.parse_args()
    row = 1 << 20
    nbytes = int(args.gib * GiB) // row * row
    results: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for name, alloc in (("before", before), ("after", after)):
            results[name].append(measure(alloc, nbytes, row))
    fragments = [args.page_bytes] * (2 * args.layers)
    checks = [run_self_check("cpu", fragments) for _ in range(args.checks)]
    report = {
        "pool_bytes": nbytes,
        "rounds": args.rounds,
        **{
            name: {
                "resident_over_asked": [round(r, 4) for r, _ in rows],
                "seconds_per_gib": [round(s, 3) for _, s in rows],
            }
            for name, rows in results.items()
        },
        "self_check": {
            "fragments": len(fragments),
            "bytes_per_direction": checks[0].bytes_per_direction,
            "path": checks[0].path,
            "passed": all(c.passed for c in checks),
            "seconds": [round(c.seconds, 3) for c in checks],
            "median_seconds": round(statistics.median(c.seconds for c in checks), 3),
            "gbps": [round(c.bandwidth_gbps or 0, 2) for c in checks],
        },
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
