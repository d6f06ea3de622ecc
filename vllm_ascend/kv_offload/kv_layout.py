"""Ascend KV-cache layouts as the per-part block views the worker copies.

vLLM's offloading connector expects one tensor per layer. vllm-ascend holds
each attention layer's cache as a tuple of separate allocations: ``(k, v)``
for standard attention, ``(nope, rope)`` with different last dimensions for
MLA, a 1-tuple for some sparse variants, and a list of state tensors for
Mamba layers. Every such part is ``[num_blocks, ...]`` and contiguous within a
block, so each becomes a zero-copy int8 ``[num_blocks, page_bytes]`` view over
its existing allocation, and a layer contributes one ref per part.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def canonicalize(
    kv_caches: dict[str, KVCacheParts],
    group_layer_names: Sequence[Sequence[str]],
    num_blocks: int,
) -> CanonicalKVCaches:
    """Per-part block views for the layers of each offloaded KV cache group.

    Parts that alias the same bytes (layers sharing a cache) become one
    tensor, so they are transferred once.
    """
    tensors: list[CanonicalKVCacheTensor] = []
    index: dict[tuple[int, int, int], int] = {}
    group_refs: list[list[CanonicalKVCacheRef]] = []
    for layer_names in group_layer_names:
        refs: list[CanonicalKVCacheRef] = []
        for layer in layer_names:
            cache = kv_caches[layer]
            parts = [cache] if isinstance(cache, torch.Tensor) else list(cache)
            if not parts:
                raise KVLayoutError(f"KV cache of layer {layer} has no tensors")
            for i, part in enumerate(parts):
                view = block_view(part, num_blocks, f"{layer}[{i}]")
                key = (view.data_ptr(), view.stride(0), view.shape[1])
                if key not in index:
                    index[key] = len(tensors)
                    tensors.append(CanonicalKVCacheTensor(view, view.shape[1]))
                refs.append(CanonicalKVCacheRef(index[key], view.shape[1]))
        group_refs.append(refs)
    return CanonicalKVCaches(tensors=tensors, group_data_refs=group_refs)
