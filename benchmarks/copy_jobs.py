"""The copy benchmark's sections that go through the real ``CopyEngine``
(they import vLLM): the host cost of building and submitting descriptors,
and one store job per Ascend KV-cache layout against one contiguous copy of
the same bytes. Each job is checked byte for byte (docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec

from vllm_ascend.kv_offload.copy_bandwidth import POISON, Case, Device, scatter_slots
from vllm_ascend.kv_offload.copy_engine import CopyEngine
from vllm_ascend.kv_offload.copy_paths import CopyPath
from vllm_ascend.kv_offload.cpu_pool import CpuBlockPool, private_pool
from vllm_ascend.kv_offload.kv_layout import canonicalize

# Ascend KV-cache shapes (bf16, 128-token blocks): the parts of one layer.
LAYOUTS: dict[str, tuple[int, tuple[tuple[int, ...], ...]]] = {
    # 28 standard-attention layers, (K, V) of 8 KV heads x 128.
    "kv_tuple_28x(8x128)": (28, ((128, 8, 128), (128, 8, 128))),
    # 61 MLA layers, (nope, rope) of widths 512 and 64.
    "mla_61x(512,64)": (61, ((128, 1, 512), (128, 1, 64))),
}


@dataclass
class StoreJob:
    """One store of every block of ``kv`` to scattered rows of a pool of
    its own, copied by ``engine`` on the path it was given."""

    kv: CanonicalKVCaches
    pool: CpuBlockPool
    engine: CopyEngine
    spec: GPULoadStoreSpec
    dev_ids: np.ndarray
    cpu_ids: np.ndarray

    @classmethod
    def of(cls, device: Device, caches: dict, blocks: int, path: CopyPath, seed: int):
        kv = canonicalize(caches, [list(caches)], blocks)
        gen = torch.Generator().manual_seed(seed)
        for t in kv.tensors:
            rand = torch.randint(
                -128, 128, t.tensor.shape, generator=gen, dtype=torch.int8
            )
            t.tensor.copy_(rand)
        pages = [t.page_size_bytes for t in kv.tensors]
        pool = private_pool(pages, 1, blocks, device.name)
        engine = CopyEngine(kv, pool)
        engine.use(path.bind(engine.buffers()))
        dev_ids, cpu_ids = scatter_slots(blocks, np.random.default_rng(seed))
        spec = GPULoadStoreSpec(dev_ids.tolist(), [blocks], [0])
        return cls(kv, pool, engine, spec, dev_ids, cpu_ids)

    def build(self):
        return self.engine.build(self.spec, self.cpu_ids, to_cpu=True)

    def copy(self, desc):
        """Copies ``desc`` as the worker does: (copies, what to keep)."""
        return self.engine.swap(desc.src, desc.dst, desc.sizes)

    def stored(self) -> bool:
        """Whether block ``dev_ids[j]`` of every tensor is in row ``cpu_ids[j]``."""
        rows = self.pool.tensor.view(len(self.cpu_ids), -1)
        cpu_idx, dev_idx = map(torch.from_numpy, (self.cpu_ids, self.dev_ids))
        pages = np.array([t.page_size_bytes for t in self.kv.tensors])
        ends = np.cumsum(pages)
        return all(
            torch.equal(rows[cpu_idx, start:end], t.tensor.cpu()[dev_idx])
            for t, start, end in zip(self.kv.tensors, ends - pages, ends, strict=True)
        )


def alternate(
    device: Device, fns: dict[str, Callable[[], object]], repeats: int, host_only: bool
) -> dict[str, float]:
    """Median seconds of each of ``fns`` over ``repeats`` rounds after one
    warm-up round, the order reversed every other round. ``host_only``:
    the time to return (e.g. an enqueue); else until the device is done,
    after ``device.settle_s`` of rest on cpu. What a fn returns (the op's
    workspace) is kept until the device is done."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    items = list(fns.items())
    for r in range(repeats + 1):
        for name, fn in items if r % 2 else items[::-1]:
            device.synchronize()
            if not host_only and device.name == "cpu":
                time.sleep(device.settle_s)
            t0 = time.perf_counter()
            result = fn()
            if not host_only:
                device.synchronize()
            elapsed = time.perf_counter() - t0
            device.synchronize()
            del result
            if r:
                times[name].append(elapsed)
    return {name: statistics.median(t) for name, t in times.items()}


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
    layers x K/V, times ``ceil(num_fragments / num_tensors)`` blocks), on the
    worker's first candidate path."""
    num_tensors = max(1, min(num_tensors, num_fragments))
    blocks = -(-num_fragments // num_tensors)
    caches = {
        f"layers.{i}": device.empty(blocks * fragment_bytes, True).view(blocks, -1)
        for i in range(num_tensors)
    }
    job = StoreJob.of(device, caches, blocks, device.paths[0], seed)
    merged = 0

    def build_submit():
        nonlocal merged
        merged, workspace = job.copy(job.build())
        return workspace

    median = alternate(
        device, {"build": job.build, "both": build_submit}, repeats, host_only=True
    )
    if not job.stored():
        raise SystemExit("benchmark: CopyEngine build + submit copied wrong bytes")
    n = job.build().num_fragments
    return {
        "kind": "descriptor_cost",
        "device": device.name,
        "copy_path": device.paths[0].name,
        "num_fragments": n,
        "fragment_bytes": fragment_bytes,
        "num_tensors": num_tensors,
        "blocks": blocks,
        "build_us_per_fragment": median["build"] / n * 1e6,
        "build_submit_us_per_fragment": median["both"] / n * 1e6,
        "build_ms": median["build"] * 1e3,
        "build_submit_ms": median["both"] * 1e3,
        "copies_after_merging": merged,
        "repeats": repeats,
        "verified": True,
    }


def layout_jobs(device: Device, blocks: int, repeats: int, seed: int) -> list[dict]:
    """One store job per Ascend layout through ``kv_layout`` and
    ``CopyEngine`` on the op's path (scattered blocks), timed against one
    contiguous copy of the same bytes."""
    assert device.op_path is not None  # run only where there is one
    rows = []
    for name, (layers, part_shapes) in LAYOUTS.items():
        caches = {
            f"layers.{layer}": tuple(
                device.empty(blocks * int(np.prod(shape)) * 2, True)
                .view(torch.bfloat16)
                .view(blocks, *shape)
                for shape in part_shapes
            )
            for layer in range(layers)
        }
        job = StoreJob.of(device, caches, blocks, device.op_path, seed)
        desc = job.build()
        # The limit: one contiguous copy of the same bytes, as copy_bandwidth
        # times it. Written first: never-touched pageable memory reads as the
        # kernel's shared zero page, from cache, and would flatter the limit.
        n, one = desc.num_bytes, np.zeros(1, dtype=np.int64)
        src, dst = device.empty(n, True), device.empty(n, False)
        limit = Case(device, "d2h", src.fill_(1), dst.fill_(POISON), n, 1, one, one)
        median = alternate(
            device,
            {
                "contiguous": limit.contiguous,
                "op": lambda d=desc, j=job: j.copy(d),
            },
            repeats,
            host_only=False,
        )
        if not job.stored():
            raise SystemExit(f"benchmark: layout job {name} copied wrong bytes")
        rows.append(
            {
                "kind": "layout_job",
                "device": device.name,
                "layout": name,
                "blocks": blocks,
                "num_fragments": desc.num_fragments,
                "mean_fragment_bytes": desc.num_bytes / desc.num_fragments,
                "bytes": desc.num_bytes,
                "gbps": desc.num_bytes / median["op"] / 1e9,
                "contiguous_gbps": desc.num_bytes / median["contiguous"] / 1e9,
                "ratio_to_contiguous": median["contiguous"] / median["op"],
                "repeats": repeats,
                "verified": True,
            }
        )
    return rows
