"""Behaviour of swap_blocks_batch that both implementations share (contract:
csrc/kv_offload/ops.h): copying, coalescing, validation.

Every test runs against both implementations -- the native op
torch.ops._C_ascend.kv_offload_swap_blocks and the torch path
(copy_paths.TorchCopier, what a build without native code copies with) --
which must behave the same on device "cpu": each returns (copies,
workspace), the workspace empty on "cpu" (None on the torch path, which has
none). What only the native op has: test_swap_blocks_native.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.unit.swap_helpers import (
    BUFFERS,
    NATIVE,
    NOT_COMPILED,
    NPU_LACKING,
    POISON,
    MiB,
    Swap,
    descriptors,
    needs_native,
    poisoned,
    random_bytes,
    run_copy,
    scattered_case,
    torch_path_swap,
)


@pytest.fixture(params=[pytest.param("native", marks=needs_native), "torch"])
def swap(request: pytest.FixtureRequest) -> Swap:
    BUFFERS.clear()
    return NATIVE if request.param == "native" else torch_path_swap


# --- copying ---------------------------------------------------------------


def test_copies_scattered_fragments_of_mixed_sizes_byte_exact(swap: Swap) -> None:
    rng = random.Random(1)
    sizes = [rng.choice([1, 3, 64, 511, 4096, 65536, 300_000]) for _ in range(200)]
    src, dst, frags = scattered_case(sizes, rng, max_gap=100)
    # byte-exact, and the poisoned bytes between the fragments unchanged
    run_copy(swap, src, dst, frags)


@pytest.mark.parametrize(
    "n, size, stride",
    [
        # 64 MiB in 256 fragments; destination slots permuted (stride 97) so
        # that no two consecutive fragments are adjacent and nothing merges.
        (256, 64 * MiB // 256, 97),
        # One fragment, not divisible by the thread count: the native op
        # splits by bytes, so this one copy is also parallelised.
        (1, 64 * MiB + 3, 1),
    ],
    ids=["many-fragments", "one-huge-fragment"],
)
def test_large_batch_is_copied_correctly_by_several_threads(
    swap: Swap, n: int, size: int, stride: int
) -> None:
    src, dst = random_bytes(n * size, seed=n), poisoned(n * size + 1)
    frags = [(i * size, (i * stride % n) * size, size) for i in range(n)]

    assert run_copy(swap, src, dst, frags) == n
    assert dst[n * size] == POISON


# --- coalescing ------------------------------------------------------------


@pytest.mark.parametrize(
    "frags, copies",
    [
        # contiguous on both sides: one copy
        ([(i * 512, 512 + i * 512, 512) for i in range(8)], 1),
        # source contiguous, destinations in reverse order: not merged
        ([(i * 64, (7 - i) * 64, 64) for i in range(8)], 8),
        # destination contiguous, sources spaced apart: not merged
        ([(i * 128, i * 64, 64) for i in range(8)], 8),
        # interleaved (each fragment continues the one before the previous)
        ([(i % 2 * 4096 + i // 2 * 64, i * 64 + i % 2 * 4096, 64) for i in range(8)],
         8),
        # runs of 3, 1 and 2 adjacent fragments: one copy each
        ([(0, 0, 10), (10, 10, 20), (30, 30, 5), (100, 200, 7), (300, 400, 1),
          (301, 401, 9)], 3),
        # an empty batch copies nothing and returns zero
        ([], 0),
    ],
    ids=["both-sides", "dst-reversed", "src-gapped", "interleaved", "runs-3-1-2",
         "empty"],
)  # fmt: skip
def test_only_fragments_adjacent_on_both_sides_merge_into_one_copy(
    swap: Swap, frags: list[tuple[int, int, int]], copies: int
) -> None:
    src, dst = random_bytes(8192), poisoned(8192)

    assert run_copy(swap, src, dst, frags) == copies


# --- validation ------------------------------------------------------------


def _bad_descriptors(
    case: str, src: torch.Tensor, dst: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s, d = src.data_ptr(), dst.data_ptr()
    # A valid first fragment: a failing batch must not copy even that one.
    ok = [(s, d, 16)]
    srcs, dsts, sizes = descriptors(ok + [(s + 100, d + 100, 16)])
    huge = 2**63 - 1
    return {
        "dtype": (srcs.to(torch.int32), dsts, sizes),
        "device": (srcs, dsts, sizes.to("meta")),
        "dim": (srcs, dsts.view(1, 2), sizes),
        "contiguity": (srcs, dsts, torch.tensor([16, 0, 16, 0])[::2]),
        "length": (srcs, dsts[:1], sizes),
        "zero-size": descriptors(ok + [(s + 100, d + 100, 0)]),
        "negative-size": descriptors(ok + [(s + 100, d + 100, -5)]),
        "null-src": descriptors(ok + [(0, d + 100, 16)]),
        "null-dst": descriptors(ok + [(s + 100, 0, 16)]),
        "wraps": descriptors(ok + [(s + 100, -8, 16)]),
        "overlap": descriptors(ok + [(s + 100, s + 108, 16)]),
        # Each fragment alone is valid (no wrap, source and destination
        # disjoint), but the batch adds up to 2^64 + 14 bytes.
        "sizes-overflow": descriptors(ok + [(1, -(2**63), huge), (1, -(2**63), huge)]),
        # each fragment alone is disjoint, but the merged copy is not
        "overlap-after-merge": descriptors(
            ok + [(s + 100, s + 110, 10), (s + 110, s + 120, 10)]
        ),
    }[case]


@pytest.mark.parametrize(
    "case, message",
    [
        ("dtype", r"src_addrs must be an int64 tensor"),
        ("device", r"sizes must be a CPU tensor"),
        ("dim", r"dst_addrs must be 1-D"),
        ("contiguity", r"sizes must be contiguous"),
        ("length", r"must have the same length \(got 2, 1, 2\)"),
        ("zero-size", r"sizes\[1\] = 0 but every size must be > 0"),
        ("negative-size", r"sizes\[1\] = -5 but every size must be > 0"),
        ("null-src", r"src_addrs\[1\] is a null address"),
        ("null-dst", r"dst_addrs\[1\] is a null address"),
        ("wraps", r"fragment 1 wraps around the end of the address space"),
        ("sizes-overflow", r"sizes add up to more than 2\^64 - 1 bytes at fragment 2"),
        ("overlap", r"fragment 1 \(after merging adjacent fragments\) overlap"),
        ("overlap-after-merge", r"fragment 1 \(after merging .*\) overlap"),
    ],
)
def test_invalid_batch_raises_naming_the_problem_and_copies_nothing(
    swap: Swap, buffers: tuple[torch.Tensor, torch.Tensor], case: str, message: str
) -> None:
    src, dst = buffers
    before = (src.clone(), dst.clone())

    with pytest.raises(RuntimeError, match=message):
        swap(*_bad_descriptors(case, src, dst), "cpu")

    assert torch.equal(src, before[0]) and torch.equal(dst, before[1])


WITHOUT_NPU = [needs_native, NPU_LACKING]  # the native op built without npu
UNKNOWN = r"unknown device 'tpu'; expected one of"
NO_DESCRIPTORS = descriptors([])


@pytest.mark.parametrize(
    "call, message",
    [
        pytest.param(lambda: NATIVE(*NO_DESCRIPTORS, "tpu"), UNKNOWN,
                     marks=needs_native, id="native-unknown"),
        pytest.param(lambda: torch_path_swap(*NO_DESCRIPTORS, "tpu"), UNKNOWN,
                     id="torch-unknown"),
        # cuda is not a device of this op but of vLLM's own
        pytest.param(lambda: NATIVE(*NO_DESCRIPTORS, "cuda"),
                     "unknown device 'cuda'.*vLLM's own", marks=needs_native,
                     id="native-cuda"),
        pytest.param(lambda: NATIVE(*NO_DESCRIPTORS, "npu"), NOT_COMPILED,
                     marks=WITHOUT_NPU, id="native-built-without-npu"),
    ],
)  # fmt: skip
def test_a_device_an_op_cannot_serve_raises(call, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        call()
