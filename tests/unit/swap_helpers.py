"""Shared helpers of the swap_blocks_batch tests (test_swap_blocks_op.py,
test_swap_blocks_native.py): the native op as this build has it, and int8
buffers with the op's descriptors of the copies between them."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from vllm_ascend.kv_offload.copy_paths import TorchCopier

Swap = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, str], tuple[int, torch.Tensor]
]
POISON = -7  # what every destination byte holds until something is copied there
MiB = 1 << 20


def _load_native() -> tuple[Swap | None, tuple[str, ...], str]:
    try:
        from vllm_ascend.kv_offload import _C_kv_offload  # noqa: F401
    except ImportError as e:
        return None, (), str(e)
    return (
        torch.ops._C_ascend.kv_offload_swap_blocks.default,
        tuple(torch.ops._C_ascend.kv_offload_backends.default()),
        "",
    )


NATIVE, NATIVE_BACKENDS, NATIVE_ERROR = _load_native()
needs_native = pytest.mark.skipif(
    NATIVE is None,
    reason="native extension vllm_ascend.kv_offload._C_kv_offload is not built "
    f"({NATIVE_ERROR}); build it with `pip install --no-build-isolation -e .`",
)


# Every buffer random_bytes / poisoned made: what the torch path copies
# between (it copies views of tensors, not raw addresses).
BUFFERS: list[torch.Tensor] = []


def torch_path_swap(src, dst, sizes, device):
    """The torch path over every buffer this test made, with the workspace
    shaped as the op's on "cpu" (it has none)."""
    copies, _ = TorchCopier(BUFFERS).swap(src, dst, sizes, device)
    return copies, torch.empty(0, dtype=torch.uint8)


def descriptors(
    fragments: list[tuple[int, int, int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[(src_addr, dst_addr, size), ...] -> (src_addrs, dst_addrs, sizes)."""
    cols = list(zip(*fragments, strict=True)) if fragments else [(), (), ()]
    return tuple(torch.tensor(c, dtype=torch.int64) for c in cols)  # type: ignore[return-value]


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-128, 128, (n,), dtype=torch.int8, generator=g)
    BUFFERS.append(t)
    return t


def poisoned(n: int) -> torch.Tensor:
    t = torch.full((n,), POISON, dtype=torch.int8)
    BUFFERS.append(t)
    return t


def scattered_case(
    sizes: list[int], rng: random.Random, max_gap: int
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    """Random source, poisoned destination (with ``max_gap`` spare bytes at
    the end) and (src_offset, dst_offset, size) fragments of ``sizes``,
    disjoint, placed on each side in shuffled order with random gaps."""
    ends, sides = [], []
    for _ in "src", "dst":
        order = list(range(len(sizes)))
        rng.shuffle(order)
        offsets, cursor = [0] * len(sizes), 0
        for i in order:
            cursor += rng.randrange(max_gap + 1)
            offsets[i] = cursor
            cursor += sizes[i]
        ends.append(cursor)
        sides.append(offsets)
    src, dst = random_bytes(ends[0]), poisoned(ends[1] + max_gap)
    return src, dst, list(zip(*sides, sizes, strict=True))


def run_copy(
    swap: Swap, src: torch.Tensor, dst: torch.Tensor, frags: list[tuple[int, int, int]]
) -> int:
    """Copies (src_offset, dst_offset, size) fragments between two int8
    tensors; checks that dst then holds exactly what the fragments put there
    and that the op's workspace is empty (the "cpu" backend is synchronous:
    nothing outlives the call, ops.h); returns the op's copy count."""
    expected, args = after(src, dst, frags)
    copies, workspace = swap(*args)
    assert isinstance(workspace, torch.Tensor)
    assert workspace.device.type == "cpu" and workspace.dtype == torch.uint8
    assert workspace.shape == (0,)
    assert torch.equal(dst, expected)
    return copies


def after(src: torch.Tensor, dst: torch.Tensor, frags: list[tuple[int, int, int]]):
    """What dst holds once the (src_offset, dst_offset, size) fragments are
    copied, and the op's arguments that copy them on "cpu"."""
    expected = dst.clone()
    for s, d, n in frags:
        expected[d : d + n] = src[s : s + n]
    abs_frags = [(src.data_ptr() + s, dst.data_ptr() + d, n) for s, d, n in frags]
    return expected, (*descriptors(abs_frags), "cpu")


# The native op as built without the npu backend, and what it says of npu then.
NPU_LACKING = pytest.mark.skipif(
    "npu" in NATIVE_BACKENDS, reason="this build includes the npu backend"
)
NOT_COMPILED = "backend 'npu' was not compiled into this build"
