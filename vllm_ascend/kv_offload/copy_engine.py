"""Copy engine: turns one transfer job into descriptor arrays and one op call.

A job names device blocks (per KV cache group) and CPU blocks. Every device
block of every cached tensor becomes one fragment ``(src, dst, bytes)``; the
whole job is then handed to ``swap_blocks_batch`` in a single submission, which
merges fragments that happen to be contiguous on both sides.

The CPU pool's addressing is its layout (``cpu_pool.PoolLayout``); how the
fragments are copied is the copy function of the path the start-up
self-check chose (``copy_paths.py``), bound over ``buffers()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec

from vllm_ascend.kv_offload.copy_paths import Swap
from vllm_ascend.kv_offload.cpu_pool import CpuBlockPool


@dataclass(frozen=True)
class Descriptors:
    """Fragment arrays of one job, ready for ``swap_blocks_batch``."""

    src: torch.Tensor  # int64 [N], source addresses
    dst: torch.Tensor  # int64 [N], destination addresses
    sizes: torch.Tensor  # int64 [N], bytes per fragment
    num_bytes: int

    @property
    def num_fragments(self) -> int:
        return self.sizes.numel()


@dataclass(frozen=True)
class _GroupTensors:
    """Cached tensors one KV cache group copies, as int64 columns [T, 1]."""

    device_base: np.ndarray  # address of device block 0
    device_stride: np.ndarray  # bytes between device blocks
    cpu_offset: np.ndarray  # offset of the tensor's pages in a CPU row
    page_bytes: np.ndarray  # stride of the tensor's pages in a CPU row
    copy_bytes: np.ndarray  # bytes copied per page (un-padded page size)


class CopyEngine:
    """Builds a job's descriptors (vectorised); ``swap`` copies them."""

    def __init__(self, kv_caches: CanonicalKVCaches, pool: CpuBlockPool):
        self.pool = pool
        self.groups = [
            self._group_tensors(kv_caches, refs) for refs in kv_caches.group_data_refs
        ]
        self._buffers = [t.tensor for t in kv_caches.tensors]
        # The copy function (``use``): ``swap(desc.src, desc.dst, desc.sizes)``.
        self.swap: Swap | None = None

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a job's copies may touch: the KV caches and the
        pool's pieces (what a copy path is bound over, ``CopyPath.bind``)."""
        assert not self.pool.released
        return [*self._buffers, *self.pool.tensors]

    def use(self, swap: Swap) -> None:
        """Copies with ``swap`` from now on (a path bound over ``buffers()``)."""
        self.swap = swap

    def _group_tensors(self, kv_caches: CanonicalKVCaches, refs) -> _GroupTensors:
        # Layers that alias one tensor reach it through several refs; copy it
        # once, with the largest un-padded page any of them uses.
        copy_bytes: dict[int, int] = {}
        for ref in refs:
            copy_bytes[ref.tensor_idx] = max(
                copy_bytes.get(ref.tensor_idx, 0), ref.page_size_bytes
            )
        idx = sorted(copy_bytes)
        tensors = [kv_caches.tensors[i] for i in idx]

        def column(values) -> np.ndarray:
            return np.asarray(values, dtype=np.int64).reshape(-1, 1)

        return _GroupTensors(
            device_base=column([t.tensor.data_ptr() for t in tensors]),
            device_stride=column(
                [t.tensor.stride(0) * t.tensor.element_size() for t in tensors]
            ),
            cpu_offset=column(self.pool.tensor_offsets[idx]),
            page_bytes=column([t.page_size_bytes for t in tensors]),
            copy_bytes=column([copy_bytes[i] for i in idx]),
        )

    def build(
        self,
        device_spec: GPULoadStoreSpec,
        cpu_block_ids: np.ndarray,
        to_cpu: bool,
    ) -> Descriptors:
        """Descriptors for one job.

        ``device_spec`` lists device blocks group by group; group ``g`` holds
        ``group_sizes[g]`` blocks whose first is logical block
        ``block_indices[g]`` of its request. A CPU block holds
        ``blocks_per_chunk`` logical blocks, so a group may start part-way
        into its first CPU block: that many pages are skipped there.
        """
        if self.pool.released:
            # Its base address is 0 now: the descriptors would name small,
            # non-null addresses that are not ours.
            raise RuntimeError(
                "KV offload: cannot build a copy job, the CPU block pool has "
                "been released (the offloading worker was shut down)"
            )
        bpc = self.pool.blocks_per_chunk
        device_ids = np.asarray(device_spec.block_ids, dtype=np.int64)
        cpu_ids = np.asarray(cpu_block_ids, dtype=np.int64)
        # Both required by vLLM's spec (no group_sizes=None single group).
        group_sizes = list(device_spec.group_sizes)
        if len(group_sizes) != len(self.groups):
            raise ValueError(
                f"job names {len(group_sizes)} KV cache groups, "
                f"the worker holds {len(self.groups)}"
            )

        device_parts: list[np.ndarray] = []
        cpu_parts: list[np.ndarray] = []
        size_parts: list[np.ndarray] = []
        dev_pos = cpu_pos = 0
        jobs = zip(self.groups, group_sizes, device_spec.block_indices, strict=True)
        for group, n, first in jobs:
            if n == 0:
                continue
            skip = first % bpc
            n_cpu = cdiv(skip + n, bpc)
            dev = device_ids[dev_pos : dev_pos + n]
            cpu = cpu_ids[cpu_pos : cpu_pos + n_cpu]
            if len(dev) != n or len(cpu) != n_cpu:
                raise ValueError(
                    f"job holds {len(device_ids)} device and {len(cpu_ids)} CPU "
                    f"blocks, too few for its group sizes {group_sizes} "
                    f"(blocks_per_chunk={bpc})"
                )
            dev_pos += n
            cpu_pos += n_cpu

            # Logical page k of the group sits in CPU block (skip + k) // bpc,
            # slot (skip + k) % bpc. Rows are tensors, columns are pages, so a
            # run of consecutive blocks stays contiguous for coalescing.
            logical = np.arange(skip, skip + n, dtype=np.int64)
            # Rows may sit in different pieces: one vectorised unit lookup.
            cpu_row = self.pool.row_addresses(cpu[logical // bpc])
            cpu_addr = (
                cpu_row[None, :]
                + group.cpu_offset
                + (logical % bpc)[None, :] * group.page_bytes
            )
            dev_addr = group.device_base + dev[None, :] * group.device_stride
            device_parts.append(dev_addr.ravel())
            cpu_parts.append(cpu_addr.ravel())
            size_parts.append(np.broadcast_to(group.copy_bytes, dev_addr.shape).ravel())

        if dev_pos != len(device_ids) or cpu_pos != len(cpu_ids):
            raise ValueError(
                f"job holds {len(device_ids)} device and {len(cpu_ids)} CPU blocks "
                f"but its group sizes {group_sizes} use {dev_pos} and {cpu_pos}"
            )
        dev_all, cpu_all, sizes = (
            np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
            for parts in (device_parts, cpu_parts, size_parts)
        )
        src, dst = (dev_all, cpu_all) if to_cpu else (cpu_all, dev_all)
        return Descriptors(
            src=torch.from_numpy(src),
            dst=torch.from_numpy(dst),
            sizes=torch.from_numpy(sizes),
            num_bytes=int(sizes.sum()),
        )
