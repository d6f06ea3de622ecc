"""Faulting the CPU block pool in at start-up: seconds per GiB before and
after ``populate``, and threads x page size vs seconds per GiB, in
alternating rounds of one run.

    python -m benchmarks.populate_benchmark --gib 1 --rounds 5

``before``: what ``host_memory`` did, one ``mmap.madvise(MADV_POPULATE_WRITE)``
over the whole range on the calling thread (4 KiB pages, or huge pages only
where THP is ``always``). The other rows: ``populate.populate(addr, nbytes,
threads, huge_pages=...)``; the row with populate's defaults (threads from
the CPUs this process may use, huge pages on) is marked. Every round runs
every variant once, each on a fresh anonymous mapping of ``--gib`` that is
unmapped afterwards, in an order rotated by one each round. A trial counts
only if the process's resident memory grew by the mapping's size; ``huge``
is the share of it in transparent huge pages; CPU s/GiB the process's CPU
time (all threads), which a shared machine's load changes less than the
wall-clock time. The 1-minute load average is printed beside each trial.
First, how fast another Python thread runs while one thread faults a
mapping in with ``mmap.madvise`` and with ``populate.libc_madvise``:
whether each holds the GIL.
``--settle`` rests before each trial: on a VM whose hypervisor takes free
memory back (free page reporting), memory freed by the previous trial is
faulted in faster than memory free for a while, as an engine's pool is.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from benchmarks.common import write_json
from vllm_ascend.kv_offload import populate

GiB = 2**30


@dataclass
class Trial:
    variant: str
    round: int
    s_per_gib: float
    cpu_s_per_gib: float  # CPU time of the process (all threads)
    huge_share: float
    load1: float


def memory_kib(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/smaps_rollup, in KiB (Rss, AnonHugePages)."""
    found = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in keys:
                found[key] = int(rest.split()[0])
    return found


def before(region: mmap.mmap, addr: int, nbytes: int) -> None:
    region.madvise(populate.MADV_POPULATE_WRITE)


def after(threads: int, huge: bool, region: mmap.mmap, addr: int, nbytes: int) -> None:
    populate.populate(addr, nbytes, threads, huge_pages=huge)


def trial(fault_in, nbytes: int) -> tuple[float, float, float]:
    """Seconds and CPU seconds per GiB, share in huge pages, of faulting a
    fresh mapping in."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = torch.frombuffer(region, dtype=torch.int8)
    try:
        m0 = memory_kib("Rss", "AnonHugePages")
        c0, t0 = time.process_time(), time.perf_counter()
        fault_in(region, view.data_ptr(), nbytes)
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - c0
        m1 = memory_kib("Rss", "AnonHugePages")
    finally:
        del view
        region.close()
    grew = (m1["Rss"] - m0["Rss"]) * 1024
    if grew < nbytes * 0.99:
        raise RuntimeError(f"only {grew} of {nbytes} bytes became resident")
    huge = (m1["AnonHugePages"] - m0["AnonHugePages"]) * 1024 / nbytes
    return seconds * GiB / nbytes, cpu * GiB / nbytes, huge


def spins_during(call: Callable[[], None]) -> float:
    """Loop iterations per second a second Python thread makes while
    ``call`` runs on another: near zero where ``call`` holds the GIL."""
    window, done = [], threading.Event()

    def work() -> None:
        t0 = time.perf_counter()
        call()
        window.extend((t0, time.perf_counter()))
        done.set()

    stamps = []  # the spinning thread's clock, every 1024 iterations
    worker = threading.Thread(target=work)
    worker.start()
    while not done.is_set():
        stamps.append(time.perf_counter())
        for _ in range(1024):
            pass
    worker.join()
    t0, t1 = window
    return 1024 * sum(t0 <= t < t1 for t in stamps) / (t1 - t0)


def gil_check(nbytes: int) -> dict[str, float]:
    """``spins_during`` the fault-in of a fresh mapping by ``mmap.madvise``
    and by ``populate.libc_madvise`` (ctypes)."""
    found = {}
    for name in ("mmap.madvise", "libc_madvise"):
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = torch.frombuffer(region, dtype=torch.int8)
        call = partial(before, region, 0, nbytes)
        if name == "libc_madvise":
            advice = populate.MADV_POPULATE_WRITE
            call = partial(populate.libc_madvise, view.data_ptr(), nbytes, advice)
        found[name] = spins_during(call)
        del view, call
        region.close()
    return found


def variants(threads: list[int]) -> dict[str, Callable]:
    default = (populate.default_threads(), populate.huge_pages_setting())
    found = {"before: 1 thread, mmap.madvise": before}
    for n in threads:
        for huge in (False, True):
            pages = "huge" if huge else "4 KiB"
            name = f"populate: {n} thread{'s' * (n > 1)}, {pages} pages"
            if (n, huge) == default:
                name += " (default)"
            found[name] = partial(after, n, huge)
    return found


def run(args: argparse.Namespace, nbytes: int) -> list[Trial]:
    table = variants(args.threads)
    names = list(table)
    trials = []
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            time.sleep(args.settle)
            wall, cpu, huge = trial(table[name], nbytes)
            trials.append(Trial(name, r, wall, cpu, huge, os.getloadavg()[0]))
            print(
                f"round {r} {name:42s} {wall:6.3f} s/GiB (CPU {cpu:.3f}) "
                f"huge {huge:4.0%} load {trials[-1].load1:.2f}",
                flush=True,
            )
    return trials


def report(trials: list[Trial], names: list[str]) -> str:
    rows = [
        "| variant | median s/GiB | min-max s/GiB | x before | CPU s/GiB "
        "| huge pages | load (1 min) |",
        "|---|---|---|---|---|---|---|",
    ]
    base = statistics.median(t.s_per_gib for t in trials if t.variant == names[0])
    for n in names:
        mine = [t for t in trials if t.variant == n]
        values, loads = [t.s_per_gib for t in mine], [t.load1 for t in mine]
        median = statistics.median(values)
        huge = statistics.median(t.huge_share for t in mine)
        cpu = statistics.median(t.cpu_s_per_gib for t in mine)
        rows.append(
            f"| {n} | {median:.3f} | {min(values):.3f}-{max(values):.3f} | "
            f"{base / median:.2f} | {cpu:.3f} | {huge:.0%} | "
            f"{min(loads):.2f}-{max(loads):.2f} |"
        )
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="mapping per trial")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--threads", type=lambda s: [int(x) for x in s.split(",")],
        default=sorted({1, 2, len(os.sched_getaffinity(0))}),
        help="comma-separated thread counts (default: 1, 2, this process's CPUs)",
    )  # fmt: skip
    p.add_argument(
        "--settle", type=float, default=0.0, help="rest before each trial, s"
    )
    p.add_argument("--json", type=Path, default=None, help="write every trial")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    nbytes = int(args.gib * GiB) // populate.PAGE_BYTES * populate.PAGE_BYTES
    for name, rate in gil_check(nbytes).items():
        print(f"another Python thread during {name}: {rate:,.0f} iterations/s")
    trials = run(args, nbytes)
    names = list(variants(args.threads))
    print(report(trials, names))
    if args.json:
        write_json(args.json, [asdict(t) for t in trials])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
