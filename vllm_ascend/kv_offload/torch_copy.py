"""A copy path made of public torch calls only, for any torch device with
streams (npu, cuda, xpu) when our native op is missing, and the baseline the
copy benchmark measures the op against.

The descriptors name raw addresses; torch copies tensors. ``TorchCopier``
holds a flat uint8 view of every buffer a job may touch (each device KV
cache storage and the CPU block pool) and turns each copy, after the op's own
validation and merging of adjacent fragments (``ops.coalesce``), into one
``dst[a:b].copy_(src[c:d], non_blocking=True)`` between views of those
buffers. Issued on the current stream, i.e. the transfer queue's side
stream: nothing is allocated, so nothing outlives the call but the copies.
One Python call per merged copy: fine for a fallback, which is why it is not
the default where the native op exists.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from vllm_ascend.kv_offload import ops

# Devices the path is meant for, when it holds no buffer to tell.
_DEVICE_TYPES = ["cpu", "cuda", "npu", "xpu"]


def _flat_storage(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole storage of ``t``."""
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.set_(t.untyped_storage())


class TorchCopier:
    """``swap_blocks_batch`` in torch, over the buffers it was given."""

    def __init__(self, buffers: Iterable[torch.Tensor]):
        views: dict[int, torch.Tensor] = {}
        for t in buffers:
            flat = _flat_storage(t)
            if flat.numel():
                views.setdefault(flat.data_ptr(), flat)
        self._device_types = sorted({v.device.type for v in views.values()})
        order = sorted(views)
        self._views = [views[b] for b in order]
        self._bases = np.asarray(order, dtype=np.uint64)
        self._ends = np.asarray([b + views[b].numel() for b in order], dtype=np.uint64)

    def _locate(self, addrs: np.ndarray, sizes: np.ndarray, side: str) -> np.ndarray:
        idx = np.searchsorted(self._bases, addrs, side="right").astype(np.int64) - 1
        inside = idx >= 0
        safe = np.maximum(idx, 0)
        if len(self._bases):
            inside &= addrs + sizes <= self._ends[safe]
        else:
            inside &= False
        if not inside.all():
            i = int(np.flatnonzero(~inside)[0])
            raise RuntimeError(
                f"swap_blocks_batch (torch path): {side} of copy {i} "
                f"([{int(addrs[i]):#x}, +{int(sizes[i])})) is not inside any buffer "
                "this copier was built over (the KV caches and the CPU pool)"
            )
        return idx

    def swap(
        self,
        src_addrs: torch.Tensor,
        dst_addrs: torch.Tensor,
        sizes: torch.Tensor,
        device: str = "",
    ) -> tuple[int, None]:
        """Same arguments and validation as ``ops.swap_blocks_batch``; returns
        ``(copies, None)``: no workspace, the views own nothing."""
        known = self._device_types or _DEVICE_TYPES
        if device and device not in known:
            raise RuntimeError(
                f"swap_blocks_batch (torch path): unknown device '{device}'; "
                f"expected one of {', '.join(map(repr, known))} (the devices "
                "of the buffers it copies between)"
            )
        src, dst, size, first = ops.coalesce(src_addrs, dst_addrs, sizes)
        if not len(size):
            return 0, None
        ops.check_disjoint(src, dst, size, first, device or "torch")
        s_idx = self._locate(src, size, "source")
        d_idx = self._locate(dst, size, "destination")
        s_off = (src - self._bases[s_idx]).tolist()
        d_off = (dst - self._bases[d_idx]).tolist()
        views = self._views
        for si, so, di, do, n in zip(
            s_idx.tolist(), s_off, d_idx.tolist(), d_off, size.tolist(), strict=True
        ):
            views[di][do : do + n].copy_(views[si][so : so + n], non_blocking=True)
        return len(size), None
