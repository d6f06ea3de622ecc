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
its unpadded and padded page size), and within a KV cache group no two views
may share a byte unless they are the same view (layers sharing one cache),
which is copied once. A layer whose parts are each several runs per block
(C8-MXFP's kernel packets [K | K scale | V | V scale] inside a larger
scheduler block) is copied as the block they tile together, if they cover
it exactly. Two overlaps are layouts upstream vllm-ascend builds:

* a layer may hand a full-page view beside the component views of the same
  bytes (the DeepSeek-V4 indexer's ``(k, scale, full)``): a part holding every
  other part's bytes, block by block, is copied alone;
* the groups of a hybrid model overlay one allocation (vLLM's planner; a block
  id belongs to one group at a time), so an attention layer's ``(k, v)`` and a
  Mamba layer's states share pages: views of different groups that alias page
  for page (same block stride, all inside one stride-long window per block)
  become one view of that window, of which each group copies the prefix that
  holds its own parts.
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
    # torch ignores the (arbitrary) strides of size-1 dims here.
    if not blocks[0].is_contiguous():
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
    return _pages(part, num_blocks, page_bytes, block_stride)


def _pages(of: torch.Tensor, n: int, page: int, stride: int, start=None):
    """An int8 ``[n, page]`` view of ``of``'s storage, a block every
    ``stride`` bytes from byte ``start`` (default: where ``of`` starts)."""
    if start is None:
        start = of.storage_offset() * of.element_size()
    return torch.tensor([], dtype=torch.int8, device=of.device).set_(
        of.untyped_storage(), start, (n, page), (stride, 1)
    )


def _tiled_page(parts: list[torch.Tensor], num_blocks: int) -> torch.Tensor | None:
    """The view of the page ``parts`` tile together in each block (every
    byte of one contiguous range once), if they do."""
    storage = parts[0].untyped_storage()
    offsets, strides = [], set()
    for part in parts:
        if (
            part.untyped_storage().data_ptr() != storage.data_ptr()
            or part.dim() < 1
            or part.shape[0] % num_blocks
        ):
            return None
        blocks = part.unflatten(0, (num_blocks, -1))
        elem = part.element_size()
        strides.add(blocks.stride(0) * elem if num_blocks > 1 else None)
        # Byte offsets of block 0, from its shape and strides (no copy).
        idx = torch.tensor(part.storage_offset() * elem, dtype=torch.int64)
        for size, stride in zip(blocks.shape[1:], blocks.stride()[1:], strict=True):
            idx = idx.unsqueeze(-1) + torch.arange(size) * (stride * elem)
        offsets.append((idx.reshape(-1, 1) + torch.arange(elem)).reshape(-1))
    block = torch.cat(offsets).sort().values
    lo, size = int(block[0]), block.numel()
    if len(strides) != 1 or not torch.equal(block, torch.arange(lo, lo + size)):
        return None
    stride = strides.pop() or size
    if stride < size:
        return None
    return _pages(parts[0], num_blocks, size, stride, start=lo)


def _layer_views(
    layer: str, parts: list[torch.Tensor], num_blocks: int
) -> list[torch.Tensor]:
    """One block view per part; or, where the parts are several runs per
    block (C8-MXFP's kernel packets [K | K scale | V | V scale] inside a
    larger scheduler block), the one page they tile together."""
    try:
        return [
            block_view(part, num_blocks, f"{layer}[{i}]")
            for i, part in enumerate(parts)
        ]
    except KVLayoutError:
        page = _tiled_page(parts, num_blocks)
        if page is None:
            raise
        return [page]


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


def _window(view: torch.Tensor) -> tuple[int, int]:
    """Addresses [start, end) of a view's block 0."""
    return view.data_ptr(), view.data_ptr() + view.shape[1]


def _same_blocks(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.device, a.shape[0], a.stride(0)) == (b.device, b.shape[0], b.stride(0))


def _full_view(views: list[torch.Tensor]) -> int | None:
    """Index of the part whose bytes hold every other part's in each block
    (a full-page view beside its components), if there is one."""
    if len(views) < 2:
        return None
    for i, full in enumerate(views):
        lo, hi = _window(full)
        if all(
            _same_blocks(full, v) and lo <= _window(v)[0] and _window(v)[1] <= hi
            for v in views
        ):
            return i
    return None


def _extent(view: torch.Tensor) -> tuple[int, int]:
    """Addresses [start, end) from block 0's first byte to the last block's last."""
    n, page = view.shape
    return view.data_ptr(), view.data_ptr() + (n - 1) * view.stride(0) + page


def _overlay_windows(
    tensors: list[CanonicalKVCacheTensor], names: list[str], groups: list[set[int]]
) -> tuple[list[CanonicalKVCacheTensor], dict[int, tuple[int, int]]]:
    """Merges views of different groups that overlay the same pages.

    Returns the new tensors and, for each old tensor index, its new index and
    the offset of its block 0 in the new tensor's page.
    """
    order = sorted(range(len(tensors)), key=lambda i: _extent(tensors[i].tensor))
    clusters: list[list[int]] = []  # views whose address ranges overlap
    reach = -1
    for i in order:
        start, end = _extent(tensors[i].tensor)
        device = tensors[i].tensor.device
        if start < reach and device == tensors[clusters[-1][0]].tensor.device:
            clusters[-1].append(i)
        else:
            clusters.append([i])
        reach = max(reach, end) if len(clusters[-1]) > 1 else end
    window_of: dict[int, list[int]] = {}  # first member -> members
    for members in clusters:
        if len(members) > 1 and len(set().union(*(groups[i] for i in members))) > 1:
            _check_overlay(tensors, names, groups, members)
            window_of[min(members)] = sorted(members)
    merged = {i for members in window_of.values() for i in members}
    out: list[CanonicalKVCacheTensor] = []
    where: dict[int, tuple[int, int]] = {}
    for i, t in enumerate(tensors):
        if i not in merged:
            where[i] = (len(out), 0)
            out.append(t)
        elif i in window_of:
            views = [tensors[m].tensor for m in window_of[i]]
            lo = min(_window(v)[0] for v in views)
            hi = max(_window(v)[1] for v in views)
            first = min(views, key=lambda v: v.data_ptr())
            window = _pages(first, first.shape[0], hi - lo, first.stride(0))
            for m in window_of[i]:
                where[m] = (len(out), tensors[m].tensor.data_ptr() - lo)
            out.append(CanonicalKVCacheTensor(window, hi - lo))
    return out, where


def _check_overlay(
    tensors: list[CanonicalKVCacheTensor],
    names: list[str],
    groups: list[set[int]],
    members: list[int],
) -> None:
    """Views of different groups may share bytes only page for page."""
    views = [tensors[m].tensor for m in members]
    lo = min(_window(v)[0] for v in views)
    hi = max(_window(v)[1] for v in views)
    first = views[0]
    same_storage = {v.untyped_storage().data_ptr() for v in views}
    if (
        all(_same_blocks(first, v) for v in views)
        and hi - lo <= first.stride(0)
        and len(same_storage) == 1
    ):
        return
    a = members[0]
    b = next((m for m in members if not groups[m] & groups[a]), members[1])
    raise KVLayoutError(
        f"KV cache parts {names[a]} and {names[b]} of different KV cache groups "
        "overlap in memory, but not page for page (the same block stride, with "
        "block b of one inside block b's window of the other); offloading one "
        "group's blocks would overwrite another group's. The caches of a "
        "hybrid model must overlay each other page by page, as vLLM's planner "
        "lays them out"
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
    groups: list[set[int]] = []  # the groups that copy each tensor
    index: dict[tuple, int] = {}
    group_refs: list[list[int]] = []
    for g, layer_names in enumerate(group_layer_names):
        refs: list[int] = []
        for layer in layer_names:
            cache = kv_caches[layer]
            parts = [cache] if isinstance(cache, torch.Tensor) else list(cache)
            if not parts:
                raise KVLayoutError(f"KV cache of layer {layer} has no tensors")
            views = _layer_views(layer, parts, num_blocks)
            full = _full_view(views)
            copied = list(enumerate(views)) if full is None else [(full, views[full])]
            if page_bytes is not None and layer in page_bytes:
                _check_page_bytes(
                    layer, parts, [v for _, v in copied], page_bytes[layer]
                )
            for i, view in copied:
                key = (view.device, view.data_ptr(), view.stride(0), view.shape[1])
                if key not in index:
                    index[key] = len(tensors)
                    tensors.append(CanonicalKVCacheTensor(view, view.shape[1]))
                    names.append(f"{layer}[{i}]")
                    groups.append(set())
                groups[index[key]].add(g)
                refs.append(index[key])
        group_refs.append(refs)
    for refs in group_refs:
        for device in {tensors[i].tensor.device for i in refs}:
            same = sorted({i for i in refs if tensors[i].tensor.device == device})
            _check_disjoint([tensors[i] for i in same], [names[i] for i in same])
    merged, where = _overlay_windows(tensors, names, groups)
    group_data_refs = []
    for refs in group_refs:
        # A group copies the prefix of a merged page that holds its parts.
        copy: dict[int, int] = {}
        for i in refs:
            new, offset = where[i]
            copy[new] = max(copy.get(new, 0), offset + tensors[i].page_size_bytes)
        group_data_refs.append(
            [CanonicalKVCacheRef(where[i][0], copy[where[i][0]]) for i in refs]
        )
    return CanonicalKVCaches(tensors=merged, group_data_refs=group_data_refs)
