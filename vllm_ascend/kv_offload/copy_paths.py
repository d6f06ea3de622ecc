"""The ways the worker can copy a job's fragments, best first.

* ``native-batch`` (npu): our native op's ``aclrtMemcpyBatchAsync``.
* ``native-per-copy`` (npu): the same op, one async memcpy per merged copy
  (its ``per_copy`` argument), for a runtime whose batch call misbehaves.
* ``vllm-batch`` (cuda): vLLM's own ``swap_blocks_batch`` (batched
  ``cuMemcpyBatchAsync``), after the op's validation and merging of
  adjacent fragments (``ops.coalesce``); we build no CUDA code.
* ``native`` (cpu): the op's multi-threaded memcpy.
* ``torch``: public torch calls only (``TorchCopier``, below), on any device
  when the native op is missing (cpu included: a build without native code),
  and the baseline the copy benchmark measures the op against. The
  descriptors name raw addresses, torch copies tensors: after ``ops.coalesce``
  each copy is one ``dst[a:b].copy_(src[c:d], non_blocking=True)`` between
  flat uint8 views of the buffers a job may touch (the KV caches, the pool),
  on the current stream, allocating nothing. One Python call per merged
  copy: fine for a fallback, which is why it is not the default where the
  native op exists.

``candidate_paths`` lists those a device can try, in the order the start-up
self-check tries them (``self_check.py``), from what this process has
(``Available``); ``copy_path`` in ``kv_connector_extra_config`` ("auto",
"native", "torch") narrows the list. ``CopyPath.bind`` returns the copy
function itself: the op with its arguments bound, so that a job reaches it
through no Python frame of ours beyond the queue's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_ascend.kv_offload import ops, vllm_compat
from vllm_ascend.kv_offload.config import PREFIX, OffloadConfigError

# (src_addrs, dst_addrs, sizes) -> (copies, what must live until they complete)
Swap = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[int, object]]

NATIVE_BATCH = "native-batch"
NATIVE_PER_COPY = "native-per-copy"
VLLM_BATCH = "vllm-batch"
NATIVE_CPU = "native"
TORCH = "torch"
SETTINGS = ("auto", "native", "torch")
# Devices the path is meant for, when it holds no buffer to tell.
_DEVICE_TYPES = ["cpu", "cuda", "npu", "xpu"]


class TorchCopier:
    """``swap_blocks_batch`` in torch, over the buffers it was given."""

    def __init__(self, buffers: Iterable[torch.Tensor]):
        views: dict[int, torch.Tensor] = {}
        for t in buffers:  # a 1-D uint8 view over each whole storage
            flat = torch.empty(0, dtype=torch.uint8, device=t.device)
            flat.set_(t.untyped_storage())
            if flat.numel():
                views.setdefault(flat.data_ptr(), flat)
        self._device_types = sorted({v.device.type for v in views.values()})
        order = sorted(views)
        self._views = [views[b] for b in order]
        self._bases = np.asarray(order, dtype=np.uint64)
        self._ends = np.asarray([b + views[b].numel() for b in order], dtype=np.uint64)

    def _locate(self, addrs: np.ndarray, sizes: np.ndarray, side: str) -> np.ndarray:
        idx = np.searchsorted(self._bases, addrs, side="right").astype(np.int64) - 1
        inside = idx >= 0  # all False when there is no buffer
        if len(self._bases):
            inside &= addrs + sizes <= self._ends[np.maximum(idx, 0)]
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


@dataclass(frozen=True)
class Available:
    """What this process can copy with: our op's compiled backends (() when
    it is not loaded) and vLLM's CUDA op (None when absent)."""

    native_backends: tuple[str, ...]
    vllm_swap: Callable[..., None] | None = None

    @classmethod
    def here(cls, device_type: str) -> Available:
        # vLLM's op is looked up only where it can serve.
        vllm_swap = (
            vllm_compat.vllm_swap_blocks_batch() if device_type == "cuda" else None
        )
        return cls(ops.native_backends(), vllm_swap)


@dataclass(frozen=True)
class CopyPath:
    """One way to copy on ``device_type``; ``bind`` makes its copy function
    over the buffers a job may touch (the torch path needs them)."""

    name: str
    device_type: str
    vllm_swap: Callable[..., None] | None = None  # vllm-batch: vLLM's op

    def bind(self, buffers: Iterable[torch.Tensor]) -> Swap:
        if self.name == TORCH:
            return TorchCopier(buffers).swap
        if self.name == VLLM_BATCH:
            assert self.vllm_swap is not None
            return _coalesced(self.vllm_swap)
        return ops.native_swap(self.device_type, self.name == NATIVE_PER_COPY)

    @property
    def native(self) -> bool:
        return self.name != TORCH


def _coalesced(vllm_swap: Callable[..., None]) -> Swap:
    """vLLM's op on the merged copies. It reads its three host arrays
    asynchronously, so they are returned for the queue to keep until the
    copies have completed, as vLLM's worker keeps them with its transfer."""

    def swap(src_addrs, dst_addrs, sizes):
        src, dst, size, _ = ops.coalesce(src_addrs, dst_addrs, sizes)
        merged = tuple(torch.from_numpy(a.view(np.int64)) for a in (src, dst, size))
        if len(size):
            vllm_swap(*merged)
        return len(size), merged

    return swap


def candidate_paths(
    device_type: str, setting: str = "auto", have: Available | None = None
) -> Sequence[CopyPath]:
    """The paths to try, best first, for the ``copy_path`` setting; ``have``:
    what is available (default: this process, ``Available.here``)."""
    if setting not in SETTINGS:
        raise OffloadConfigError(
            f"{PREFIX}['copy_path']={setting!r} is not supported; use one of "
            f"{', '.join(SETTINGS)}"
        )
    torch_path = [CopyPath(TORCH, device_type)]
    if setting == "torch":
        return torch_path
    have = have or Available.here(device_type)
    # What ``have`` offers on ``device_type``, best first.
    native = []
    if device_type == "cuda" and have.vllm_swap is not None:
        native = [CopyPath(VLLM_BATCH, "cuda", have.vllm_swap)]
    elif device_type == "cpu" and "cpu" in have.native_backends:
        native = [CopyPath(NATIVE_CPU, "cpu")]
    elif device_type != "cuda" and device_type in have.native_backends:
        native = [CopyPath(n, device_type) for n in (NATIVE_BATCH, NATIVE_PER_COPY)]
    if setting == "native" and not native:
        lacks = (
            "this vLLM has no registered swap_blocks_batch op (vllm._custom_ops, "
            "a CUDA build of vLLM); install vLLM's CUDA build"
            if device_type == "cuda"
            else f"the native op has no '{device_type}' backend here (compiled: "
            f"{', '.join(have.native_backends) or 'none'}); build it with "
            "`pip install --no-build-isolation -e .` on this machine"
        )
        raise OffloadConfigError(
            f"{PREFIX}['copy_path']='native', but {lacks}, or set "
            "copy_path='auto' (falls back to the torch path)"
        )
    return native if setting == "native" else native + torch_path
