"""The "cuda" backend of swap_blocks_batch (csrc/kv_offload/cuda/swap_blocks_cuda.cu).

Needs a build with the cuda backend (``'cuda' in ops.native_backends()``):
the validation tests run on any such build, the copy tests also need a GPU.
Without them everything here is skipped; on a machine with a GPU run
``scripts/device_check_cuda.sh`` (docs/cuda_backend.md).

Copies run on a side stream (the batch API refuses the legacy default
stream) unless a test says otherwise; ``VLLM_ASCEND_CUDA_COPY_METHOD`` picks
the method for each test.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from vllm_ascend.kv_offload import ops

KiB, MiB = 1 << 10, 1 << 20
POISON = -7  # every destination byte holds this until a copy writes it
METHOD_ENV = "VLLM_ASCEND_CUDA_COPY_METHOD"

HAS_BACKEND = "cuda" in ops.native_backends()
HAS_GPU = HAS_BACKEND and torch.cuda.is_available()
needs_backend = pytest.mark.skipif(
    not HAS_BACKEND,
    reason="this build has no 'cuda' backend (native backends: "
    f"{ops.native_backends() or 'none'}); it needs a CUDA torch and nvcc",
)
needs_gpu = pytest.mark.skipif(
    not HAS_GPU, reason="needs the 'cuda' backend and a visible CUDA GPU"
)


def descriptors(
    frags: list[tuple[int, int, int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[(src_addr, dst_addr, size), ...] -> the op's three descriptor tensors."""
    cols = list(zip(*frags, strict=True)) if frags else [(), (), ()]
    return tuple(torch.tensor(c, dtype=torch.int64) for c in cols)  # type: ignore[return-value]


# Workspaces of the jobs a test enqueued: their copies may read them until they
# have completed (csrc/kv_offload/ops.h), so they live until the test is over.
_workspaces: list[torch.Tensor] = []


@pytest.fixture(autouse=True)
def _keep_workspaces_until_the_copies_are_done() -> Iterator[None]:
    yield
    if HAS_GPU:
        torch.cuda.synchronize()
    _workspaces.clear()


def swap(frags: list[tuple[int, int, int]]) -> int:
    """The copy count; the workspace is kept until the end of the test."""
    copies, workspace = ops.swap_blocks_batch(*descriptors(frags), "cuda")
    _workspaces.append(workspace)
    return copies


@pytest.fixture
def method(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(METHOD_ENV, request.param)
    return request.param


def with_method(*names: str) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("method", names, indirect=True)


@pytest.fixture
def side_stream() -> Iterator[torch.cuda.Stream]:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        yield stream
    stream.synchronize()


def buffer(nbytes: int, where: str) -> torch.Tensor:
    """int8 buffer on "device", "pinned" or "pageable" memory."""
    if where == "device":
        return torch.empty(nbytes, dtype=torch.int8, device="cuda")
    return torch.empty(nbytes, dtype=torch.int8, pin_memory=where == "pinned")


def random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (n,), dtype=torch.int8, generator=g)


def merged_count(frags: list[tuple[int, int, int]]) -> int:
    """Copies left after the op's coalescing (csrc/kv_offload/ops.h)."""
    pairs = zip(frags, frags[1:], strict=False)
    return 1 + sum(
        not (s + n == s2 and d + n == d2) for (s, d, n), (s2, d2, _) in pairs
    )


def check_copy(
    src_where: str,
    dst_where: str,
    frags: list[tuple[int, int, int]],
    seed: int = 0,
) -> None:
    """Copies (src_offset, dst_offset, size) fragments between two fresh
    buffers and checks the destination byte for byte, untouched bytes too."""
    src_bytes = max(s + n for s, _, n in frags) + 64
    dst_bytes = max(d + n for _, d, n in frags) + 64
    data = random_bytes(src_bytes, seed)
    src, dst = buffer(src_bytes, src_where), buffer(dst_bytes, dst_where)
    src.copy_(data)
    dst.fill_(POISON)
    expected = torch.full((dst_bytes,), POISON, dtype=torch.int8)
    for s, d, n in frags:
        expected[d : d + n] = data[s : s + n]
    stream = torch.cuda.current_stream()
    stream.synchronize()  # the fills above are done before the copy starts

    copies = swap([(src.data_ptr() + s, dst.data_ptr() + d, n) for s, d, n in frags])
    stream.synchronize()

    assert copies == merged_count(frags)
    assert torch.equal(dst.cpu(), expected)


def scattered(frag: int, n: int, seed: int) -> list[tuple[int, int, int]]:
    """n fragments of `frag` bytes at random slots of 2n-slot pools."""
    rng = np.random.default_rng(seed)
    src_slots = rng.permutation(2 * n)[:n]
    dst_slots = rng.permutation(2 * n)[:n]
    return [
        (int(s) * frag, int(d) * frag, frag)
        for s, d in zip(src_slots, dst_slots, strict=True)
    ]


DIRECTIONS = {"d2h": ("device", "pinned"), "h2d": ("pinned", "device")}


# --- copying (GPU) ----------------------------------------------------------


@needs_gpu
@with_method("kernel", "dma", "auto")
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
@pytest.mark.parametrize("frag", [16 * KiB, 64 * KiB, 256 * KiB, MiB])
def test_scattered_fragments_are_copied_byte_exact(
    method: str, direction: str, frag: int, side_stream: torch.cuda.Stream
) -> None:
    src_where, dst_where = DIRECTIONS.get(direction, ("device", "device"))
    n = max(8, 16 * MiB // frag)
    check_copy(src_where, dst_where, scattered(frag, n, seed=frag + len(direction)))


@needs_gpu
@with_method("kernel", "dma")
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_unaligned_addresses_and_sizes(
    method: str, direction: str, side_stream: torch.cuda.Stream
) -> None:
    # Every alignment class of the kernel (16, 8, 4, 2, 1 bytes) with sizes
    # that leave a tail, plus copies larger than one kernel work item.
    rng = random.Random(3)
    sizes = [1, 3, 17, 255, 4095, 16 * KiB + 3, 64 * KiB + 1, 200 * KiB + 7]
    frags, s_cur, d_cur = [], 0, 0
    for i in range(64):
        size = sizes[i % len(sizes)]
        s_cur += 16 + rng.choice([0, 1, 2, 4, 8])
        d_cur += 32 + rng.choice([0, 1, 2, 4, 8])
        frags.append((s_cur, d_cur, size))
        s_cur, d_cur = s_cur + size, d_cur + size
    rng.shuffle(frags)
    check_copy(*DIRECTIONS[direction], frags, seed=4)


@needs_gpu
@with_method("kernel", "auto")
def test_one_huge_merged_copy_among_small_ones(
    method: str, side_stream: torch.cuda.Stream
) -> None:
    # 2048 adjacent 16 KiB fragments merge into one 32 MiB copy; with 512
    # scattered ones the mean stays under the kernel threshold, so the kernel
    # must split the big copy into work items to spread it over its CTAs.
    small = [(s + 32 * MiB, d + 32 * MiB, n) for s, d, n in scattered(16 * KiB, 512, 5)]
    big = [(i * 16 * KiB, i * 16 * KiB, 16 * KiB) for i in range(2048)]
    check_copy("device", "pinned", small[:256] + big + small[256:], seed=6)


@needs_gpu
@with_method("kernel", "dma", "auto")
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_pageable_host_memory_falls_back_to_dma_and_is_correct(
    method: str, direction: str, side_stream: torch.cuda.Stream
) -> None:
    src_where, dst_where = DIRECTIONS[direction]
    src_where = "pageable" if src_where == "pinned" else src_where
    dst_where = "pageable" if dst_where == "pinned" else dst_where
    check_copy(src_where, dst_where, scattered(16 * KiB, 64, seed=7))


@needs_gpu
@with_method("kernel", "dma")
def test_default_stream(method: str) -> None:
    # The legacy default stream: no batch API there, the per-copy loop runs.
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    check_copy("device", "pinned", scattered(64 * KiB, 64, seed=8))


@needs_gpu
@with_method("kernel", "dma")
def test_copies_are_ordered_after_earlier_work_on_the_stream(
    method: str, side_stream: torch.cuda.Stream
) -> None:
    frag, n = 64 * KiB, 128
    dev, host = buffer(2 * n * frag, "device"), buffer(2 * n * frag, "pinned")
    dev.fill_(1)
    host.fill_(POISON)
    frags = scattered(frag, n, seed=9)
    side_stream.synchronize()
    torch.cuda._sleep(50_000_000)  # ~25 ms on the GPU, then a late write
    dev.fill_(5)
    swap([(dev.data_ptr() + s, host.data_ptr() + d, k) for s, d, k in frags])
    side_stream.synchronize()
    for _, d, k in frags:
        assert (host[d : d + k] == 5).all()


@needs_gpu
@with_method("kernel")
def test_many_jobs_on_two_streams_reuse_staging_buffers_safely(method: str) -> None:
    # More jobs in flight than staging slots (8), tables of growing size,
    # alternating between two streams while the first is held up.
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    frag, jobs = 4 * KiB, 24
    data = random_bytes(jobs * 512 * frag, seed=10)
    src = buffer(data.numel(), "device")
    src.copy_(data)
    dst = buffer(data.numel(), "pinned")
    dst.fill_(POISON)
    torch.cuda.synchronize()
    with torch.cuda.stream(streams[0]):
        torch.cuda._sleep(50_000_000)
    offset, expected_frags = 0, []
    for j in range(jobs):
        n = 16 * (j + 1)  # growing tables force staging buffers to grow
        frags = [
            (offset + 2 * i * frag, offset + (2 * n - 1 - 2 * i) * frag, frag)
            for i in range(n)
        ]
        offset += 2 * n * frag
        with torch.cuda.stream(streams[j % 2]):
            swap([(src.data_ptr() + s, dst.data_ptr() + d, k) for s, d, k in frags])
        expected_frags += frags
    torch.cuda.synchronize()
    expected = torch.full_like(data, POISON)
    for s, d, k in expected_frags:
        expected[d : d + k] = data[s : s + k]
    assert torch.equal(dst, expected)


@needs_gpu
@pytest.mark.parametrize(
    "method,frag,dst_where,expect_kernel",
    [
        ("kernel", MiB, "pinned", True),
        ("dma", 16 * KiB, "pinned", False),
        ("auto", 16 * KiB, "pinned", True),
        ("auto", 255 * KiB, "pinned", True),
        ("auto", 256 * KiB, "pinned", False),
        ("auto", MiB, "pinned", False),
        ("auto", 16 * KiB, "device", False),  # device to device: dma
        ("kernel", 16 * KiB, "device", True),
    ],
    indirect=["method"],
)
def test_method_switch_and_threshold_pick_the_copy_kernel_or_dma(
    method: str,
    frag: int,
    dst_where: str,
    expect_kernel: bool,
    side_stream: torch.cuda.Stream,
) -> None:
    from torch.profiler import ProfilerActivity, profile

    frags = scattered(frag, 16, seed=11)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        check_copy("device", dst_where, frags)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    if not names:
        pytest.skip("the profiler recorded no CUDA activity here")
    ran_kernel = any("copy_items_kernel" in name for name in names)
    assert ran_kernel == expect_kernel, sorted(set(names))


# --- validation (any build with the cuda backend) ---------------------------


@needs_backend
@with_method("kernel", "dma", "auto")
def test_empty_batch_returns_zero(method: str) -> None:
    assert swap([]) == 0


@needs_backend
@with_method("sideways")
def test_unknown_method_raises_naming_the_variable(method: str) -> None:
    buf = torch.zeros(64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match=f"{METHOD_ENV}='sideways' is not one of"):
        swap([(buf.data_ptr(), buf.data_ptr() + 32, 16)])


@needs_backend
def test_overlapping_source_and_destination_raise() -> None:
    buf = torch.zeros(64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="fragment 1 .*overlap"):
        swap(
            [
                (buf.data_ptr(), buf.data_ptr() + 32, 8),
                (buf.data_ptr() + 8, buf.data_ptr() + 12, 8),
            ]
        )


@pytest.mark.skipif(
    not HAS_BACKEND or torch.cuda.is_available(),
    reason="needs the 'cuda' backend on a machine without a visible GPU",
)
def test_without_a_gpu_the_backend_raises_clearly() -> None:
    buf = torch.zeros(64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="no CUDA device is visible"):
        swap([(buf.data_ptr(), buf.data_ptr() + 32, 16)])
