"""Ascend KV-cache layouts as the per-part block views the worker copies.

vLLM's offloading connector expects one tensor per layer. vllm-ascend holds
each attention layer's cache as a tuple of separate allocations: ``(k, v)``
for standard attention, ``(nope, rope)`` with different last dimensions for
MLA, a 1-tuple for some sparse variants, and a list of state tensors for
Mamba layers. Every such part is ``[num_blocks, ...]`` and contiguous within a
block, so each becomes a zero-copy int8 ``[num_blocks, page_bytes]`` view over
its existing allocation, and a layer contributes one ref per part.

Shapes alone are trusted no further than they can be checked: the parts of a
layer must add up to the page vLLM's KV-cache spec gives that layer (between
its unpadded and padded page size), and no two views may share a byte unless
they are the same view (layers sharing one cache), which is copied once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)

KVCacheParts = torch.Tensor | Sequence[torch.Tensor]


class KVLayoutError(ValueError):
    """A KV cache layout that offloading cannot copy block by block."""


def _is_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Row-major contiguous, ignoring the (arbitrary) strides of size-1 dims."""
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def block_view(part: torch.Tensor, num_blocks: int, name: str) -> torch.Tensor:
    """Zero-copy int8 ``[num_blocks, page_bytes]`` view of one cache part.

    A part may hold several kernel blocks per manager block (its dim 0 is a
    multiple of ``num_blocks``); they must be adjacent, as must the bytes of
    one block, or a block would not be one contiguous fragment.
    """
    if part.dim() < 1 or num_blocks < 1 or part.shape[0] % num_blocks != 0:
        raise KVLayoutError(
            f"KV cache part {name} has shape {tuple(part.shape)}; offloading "
            f"needs a leading block dimension that is a multiple of "
            f"{num_blocks} blocks"
        )
    blocks = part.unflatten(0, (num_blocks, -1))  # a view, never a copy
    if not _is_dense(blocks.shape[1:], blocks.stride()[1:]):
        raise KVLayoutError(
            f"KV cache part {name} with shape {tuple(part.shape)} and strides "
            f"{tuple(part.stride())} is not contiguous within a block; "
            "offloading copies each block as one fragment"
        )
    elem = part.element_size()
    page_bytes = blocks[0].numel() * elem
    block_stride = blocks.stride(0) * elem if num_blocks > 1 else page_bytes
    if block_stride < page_bytes:
        raise KVLayoutError(
            f"KV cache part {name}: blocks of {page_bytes} bytes overlap "
            f"(stride {block_stride} bytes)"
        )
    return torch.tensor([], dtype=torch.int8, device=part.device).set_(
        part.untyped_storage(),
        part.storage_offset() * elem,
        (num_blocks, page_bytes),
        (block_stride, 1),
    )


def _check_page_bytes(
    layer: str, parts: list[torch.Tensor], views: list[torch.Tensor], spec_bytes
) -> None:
    unpadded, padded = spec_bytes
    total = sum(v.shape[1] for v in views)
    if unpadded <= total <= padded:
        return
    shapes = ", ".join(str(tuple(p.shape)) for p in parts)
    want = f"{unpadded}" if unpadded == padded else f"{unpadded}-{padded}"
    raise KVLayoutError(
        f"KV cache of layer {layer} (parts {shapes}) holds {total} bytes per "
        f"block, but vLLM's KV cache spec for it says {want}; offloading would "
        "copy the wrong bytes. The layout does not match the spec (block size, "
        "head count or dtype of the cache as allocated)"
    )


def _check_disjoint(tensors: list[CanonicalKVCacheTensor], names: list[str]) -> None:
    """No block of one view overlaps a block of another (same device)."""
    starts, ends, owner = [], [], []
    for i, t in enumerate(tensors):
        view = t.tensor
        n, page = view.shape
        first = np.arange(n, dtype=np.uint64) * np.uint64(view.stride(0))
        first += np.uint64(view.data_ptr())
        starts.append(first)
        ends.append(first + np.uint64(page))
        owner.append(np.full(n, i, dtype=np.int64))
    if len(tensors) < 2:
        return
    start, end, who = map(np.concatenate, (starts, ends, owner))
    order = np.argsort(start, kind="stable")
    start, end, who = start[order], end[order], who[order]
    # A block overlaps an earlier one iff it starts before the furthest end
    # seen so far (blocks of one view never overlap: block_view checks).
    reach = np.maximum.accumulate(end)[:-1]
    bad = np.flatnonzero(start[1:] < reach)
    if bad.size == 0:
        return
    k = int(bad[0]) + 1
    prior = int(np.flatnonzero(end[:k] > start[k])[0])
    a, b = names[who[prior]], names[who[k]]
    raise KVLayoutError(
        f"KV cache parts {a} and {b} overlap in memory without being the same "
        "view; offloading would copy shared bytes as two different caches. "
        "Layers that share a cache must pass the same tensor (same address, "
        "block stride and page size)"
    )


def canonicalize(
    kv_caches: dict[str, KVCacheParts],
    group_layer_names: Sequence[Sequence[str]],
    num_blocks: int,
    page_bytes: Mapping[str, tuple[int, int]] | None = None,
) -> CanonicalKVCaches:
    """Per-part block views for the layers of each offloaded KV cache group.

    Parts that alias the same bytes (layers sharing a cache) become one
    tensor, so they are transferred once. ``page_bytes``: per layer, the
    (unpadded, padded) page size of vLLM's KV cache spec, checked against
    the sum of the layer's parts.
    """
    tensors: list[CanonicalKVCacheTensor] = []
    names: list[str] = []  # the first layer part of each tensor, for errors
    index: dict[tuple, int] = {}
    group_refs: list[list[CanonicalKVCacheRef]] = []
    for layer_names in group_layer_names:
        refs: list[CanonicalKVCacheRef] = []
        for layer in layer_names:
            cache = kv_caches[layer]
            parts = [cache] if isinstance(cache, torch.Tensor) else list(cache)
            if not parts:
                raise KVLayoutError(f"KV cache of layer {layer} has no tensors")
            views = [
                block_view(part, num_blocks, f"{layer}[{i}]")
                for i, part in enumerate(parts)
            ]
            if page_bytes is not None and layer in page_bytes:
                _check_page_bytes(layer, parts, views, page_bytes[layer])
            for i, view in enumerate(views):
                key = (view.device, view.data_ptr(), view.stride(0), view.shape[1])
                if key not in index:
                    index[key] = len(tensors)
                    tensors.append(CanonicalKVCacheTensor(view, view.shape[1]))
                    names.append(f"{layer}[{i}]")
                refs.append(CanonicalKVCacheRef(index[key], view.shape[1]))
        group_refs.append(refs)
    for device in {t.tensor.device for t in tensors}:
        same = [i for i, t in enumerate(tensors) if t.tensor.device == device]
        _check_disjoint([tensors[i] for i in same], [names[i] for i in same])
    return CanonicalKVCaches(tensors=tensors, group_data_refs=group_refs)
