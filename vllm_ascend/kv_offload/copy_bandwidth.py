"""Copy bandwidth of scattered KV fragments between a device and a host pool:
the measuring code of ``benchmarks/copy_benchmark.py`` (which documents the
methods and the timing) and of the doctor's bandwidth table, in one place.

Every method first copies into a poisoned destination and is checked byte
for byte (the op again after timing); a row whose bytes were wrong says so
(``verified`` False, ``failure``) instead of stopping the measurement, so
that the doctor can report it and the benchmark refuse it.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from unittest import mock

import numpy as np
import torch

from vllm_ascend.kv_offload import ops

POISON = -7  # every destination byte holds this until a copy writes it
CONTIGUOUS = "contiguous"
DIRECTIONS = ("d2h", "h2d")
CONCURRENT = "d2h+h2d"
# Methods that copy the whole pool in one piece (verified as such).
WHOLE_COPIES = (CONTIGUOUS, "memcpy", "torch_copy")
CPU_COPY_METHOD_ENV = "VLLM_ASCEND_CPU_COPY_METHOD"


class Device:
    """What differs between cpu and an accelerator (torch.cuda / torch.npu)."""

    def __init__(self, name: str):
        self.name = name
        if name == "npu":
            import torch_npu  # noqa: F401  (registers torch.npu)
        self.mod = None if name == "cpu" else getattr(torch, name)
        if self.mod is not None and not self.mod.is_available():
            raise RuntimeError(f"device '{name}' is not available here")
        self.pinned = name != "cpu"
        self.settle_s = 0.0
        self._streams: list = []
        # What CopyEngine copies with here (the worker's first candidate),
        # and what "op" times: the first that is not the torch path. Imported
        # here: it imports vLLM's platform, which the doctor checks first.
        from vllm_ascend.kv_offload.copy_paths import candidate_paths

        self.paths = candidate_paths(name)
        self.op_path = next((p for p in self.paths if p.native), None)

    def empty(self, nbytes: int, on_device: bool) -> torch.Tensor:
        if on_device and self.mod is not None:
            return torch.empty(nbytes, dtype=torch.int8, device=self.name)
        return torch.empty(nbytes, dtype=torch.int8, pin_memory=self.pinned)

    def synchronize(self) -> None:
        if self.mod is not None:
            self.mod.synchronize()

    def streams(self, k: int) -> list:
        while len(self._streams) < k:
            self._streams.append(self.mod.Stream())
        return self._streams[:k]

    def time(self, fns: Sequence[Callable[[], object]]) -> float:
        """Seconds to run ``fns``: on a device each on its own side stream, all
        at once, between events; on cpu one after another (synchronous)."""
        if self.mod is None:
            # Let the previous method's OpenMP workers go to sleep first: they
            # spin for ~10 ms after a parallel region and would take a core
            # from the op's copy threads (measured on a 2-core VM).
            time.sleep(self.settle_s)
            t0 = time.perf_counter()
            for fn in fns:
                fn()
            return time.perf_counter() - t0
        streams = self.streams(len(fns))
        start = self.mod.Event(enable_timing=True)
        end = self.mod.Event(enable_timing=True)
        with self.mod.stream(streams[0]):
            start.record()
        for s in streams[1:]:
            s.wait_event(start)
        # What each fn returns (the op's workspace) lives until `end`.
        results = []
        for s, fn in zip(streams, fns, strict=True):
            with self.mod.stream(s):
                results.append(fn())
        for s in streams[1:]:
            done = self.mod.Event()
            done.record(s)
            streams[0].wait_event(done)
        with self.mod.stream(streams[0]):
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def scatter_slots(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination slot of each fragment: two random permutations
    in which no neighbouring fragments are adjacent on both sides (so nothing
    can be merged)."""
    while True:
        src, dst = rng.permutation(n), rng.permutation(n)
        if not np.any((np.diff(src) == 1) & (np.diff(dst) == 1)):
            return src, dst


@dataclass
class Case:
    """``n`` fragments of ``frag`` bytes from ``src`` to ``dst`` (flat pools)."""

    device: Device
    direction: str
    src: torch.Tensor
    dst: torch.Tensor
    frag: int
    n: int
    src_slots: np.ndarray
    dst_slots: np.ndarray

    def __post_init__(self) -> None:
        self.nbytes = self.n * self.frag
        self.src = self.src[: self.nbytes]
        self.dst = self.dst[: self.nbytes]
        s_base, d_base, f = self.src.data_ptr(), self.dst.data_ptr(), self.frag
        self.src_addrs = torch.from_numpy(s_base + self.src_slots.astype(np.int64) * f)
        self.dst_addrs = torch.from_numpy(d_base + self.dst_slots.astype(np.int64) * f)
        self.sizes = torch.full((self.n,), f, dtype=torch.int64)
        self.one_src = torch.tensor([s_base], dtype=torch.int64)
        self.one_dst = torch.tensor([d_base], dtype=torch.int64)
        self.one_size = torch.tensor([self.nbytes], dtype=torch.int64)
        src2d, dst2d = self.src.view(self.n, f), self.dst.view(self.n, f)
        slots = zip(self.src_slots.tolist(), self.dst_slots.tolist(), strict=True)
        self.pairs = [(src2d[s], dst2d[d]) for s, d in slots]
        self.op_copies: int | None = None
        path = self.device.op_path
        self.swap = path.bind([self.src, self.dst]) if path is not None else None

    # Methods: each copies the whole case once (asynchronously on a device).
    def contiguous(self) -> None:
        if self.device.name == "cpu" and ops.HAS_NATIVE_OP:
            ops.swap_blocks_batch(self.one_src, self.one_dst, self.one_size, "cpu")
        else:
            self.dst.copy_(self.src, non_blocking=True)

    def memcpy(self) -> None:
        # The native cpu backend reads its copy routine from the environment
        # on every call.
        with mock.patch.dict(os.environ, {CPU_COPY_METHOD_ENV: "memcpy"}):
            ops.swap_blocks_batch(self.one_src, self.one_dst, self.one_size, "cpu")

    def torch_copy(self) -> None:
        self.dst.copy_(self.src, non_blocking=True)

    def loop(self) -> None:
        for s, d in self.pairs:
            d.copy_(s, non_blocking=True)

    def op(self) -> object:
        """Returns the op's workspace: keep it until the copies are done."""
        assert self.swap is not None
        self.op_copies, workspace = self.swap(
            self.src_addrs, self.dst_addrs, self.sizes
        )
        return workspace

    # Verification.
    def fill_source(self, gen: torch.Generator) -> None:
        if self.device.mod is None:
            self.src.random_(-128, 128, generator=gen)
        else:  # faster on the device (its default generator, seeded in main())
            data = torch.empty_like(self.src, device=self.device.name)
            self.src.copy_(data.random_(-128, 128))

    def poison(self) -> None:
        self.dst.fill_(POISON)

    def check(self, method: str) -> str | None:
        """Why ``dst`` does not hold exactly what ``method`` should copy, or
        None when it does."""
        where = self.device.name  # compare on the device: much faster there
        src, dst = self.src.to(where), self.dst.to(where)
        if method in WHOLE_COPIES:
            ok = torch.equal(src, dst)
        else:
            src2d, dst2d = src.view(self.n, self.frag), dst.view(self.n, self.frag)
            ok = torch.equal(
                dst2d[torch.from_numpy(self.dst_slots).to(where)],
                src2d[torch.from_numpy(self.src_slots).to(where)],
            )
        if not ok:
            return (
                f"{method} copied wrong bytes ({self.device.name} "
                f"{self.direction}, {self.n} x {self.frag} B)"
            )
        if method == "op" and self.op_copies != self.n:
            return (
                f"swap_blocks_batch merged fragments: {self.n} submitted, "
                f"{self.op_copies} copies; the pattern must not be contiguous"
            )
        return None


def methods_for(device: Device) -> tuple[list[str], str | None]:
    """Methods to time, and why the op is missing (None when present)."""
    names = [CONTIGUOUS]
    if device.name == "cpu":
        names += (["memcpy"] if ops.HAS_NATIVE_OP else []) + ["torch_copy"]
    names.append("loop")
    if device.op_path is None:
        where = (
            "vLLM's swap_blocks_batch is not registered in this vLLM"
            if device.name == "cuda"
            else f"swap_blocks_batch has no '{device.name}' backend in this build "
            f"(compiled: {', '.join(ops.native_backends()) or 'none'})"
        )
        return names, f"no copy op on {device.name}: {where}"
    return names + ["op"], None


def bench_cases(
    device: Device,
    direction: str,
    cases: list[Case],
    methods: list[str],
    repeats: int,
    gen: torch.Generator,
) -> list[dict]:
    """Verifies, then times, every method on ``cases`` run together; a method
    that copied wrong bytes is still timed, its rows unverified."""
    for case in cases:
        case.fill_source(gen)
    device.synchronize()
    failures: dict[str, str] = {}

    def verify(name: str) -> None:
        """Copies with ``name`` into poisoned destinations and checks them."""
        for case in cases:
            case.poison()
        device.synchronize()  # the fill ran on the default stream
        device.time([getattr(case, name) for case in cases])  # run, not timed
        device.synchronize()
        for case in cases:
            failure = case.check(name)
            if failure and name not in failures:
                failures[name] = failure

    for name in methods:  # also the warm-up
        verify(name)

    times: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(repeats):
        k = r % len(methods)
        for name in methods[k:] + methods[:k]:
            times[name].append(device.time([getattr(c, name) for c in cases]))
    if "op" in methods:  # and once more after the timed runs
        verify("op")

    nbytes = sum(c.nbytes for c in cases)
    gbps = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
    copies = dict.fromkeys(WHOLE_COPIES, 1) | {"loop": cases[0].n}
    copies["op"] = cases[0].op_copies
    return [
        {
            "kind": "copy",
            "device": device.name,
            "direction": direction,
            "fragment_bytes": cases[0].frag,
            "num_fragments": cases[0].n,
            "total_bytes": nbytes,
            "method": name,
            "gbps": gbps[name],
            "contiguous_gbps": gbps[CONTIGUOUS],
            "ratio_to_contiguous": gbps[name] / gbps[CONTIGUOUS],
            "median_s": statistics.median(times[name]),
            "repeats": repeats,
            "copies_per_direction": copies[name],
            "op_path": device.op_path.name if name == "op" else None,
            "host_pinned": device.pinned,
            "verified": name not in failures,
            "failure": failures.get(name),
        }
        for name in methods
    ]


def by_case(rows: Sequence[dict]) -> dict[tuple[str, int, int], dict[str, dict]]:
    """``measure``'s rows by (direction, fragment bytes, fragments), then by
    method: one table line each."""
    cases: dict[tuple[str, int, int], dict[str, dict]] = {}
    for r in rows:
        key = (r["direction"], r["fragment_bytes"], r["num_fragments"])
        cases.setdefault(key, {})[r["method"]] = r
    return cases


def measure(
    device: Device,
    plan: Sequence[tuple[int, int]],
    directions: Sequence[str] = DIRECTIONS,
    repeats: int = 3,
    seed: int = 0,
    concurrent: bool = False,
    only: Sequence[str] | None = None,
) -> tuple[list[dict], str | None]:
    """Rows of ``bench_cases`` for each ``(fragment bytes, fragments)`` of
    ``plan`` and each direction (and both at once with ``concurrent``), with
    the methods ``methods_for`` offers (those of ``only`` if given); and why
    the op is missing (None when present)."""
    methods, op_missing = methods_for(device)
    if only is not None:
        methods = [m for m in methods if m in only]
    pool_bytes = max(frag * n for frag, n in plan)
    pairs = 2 if concurrent else 1
    pools = [
        (device.empty(pool_bytes, on_device=True), device.empty(pool_bytes, False))
        for _ in range(pairs)
    ]
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)

    def case(direction: str, pool: int, frag: int, n: int) -> Case:
        dev, host = pools[pool]
        src, dst = (dev, host) if direction == "d2h" else (host, dev)
        s, d = scatter_slots(n, rng)
        return Case(device, direction, src, dst, frag, n, s, d)

    rows: list[dict] = []
    for frag, n in plan:
        for direction in directions:
            cases = [case(direction, 0, frag, n)]
            rows += bench_cases(device, direction, cases, methods, repeats, gen)
        if concurrent:
            cases = [case("d2h", 0, frag, n), case("h2d", 1, frag, n)]
            rows += bench_cases(device, CONCURRENT, cases, methods, repeats, gen)
    return rows, op_missing
