"""Behaviour of swap_blocks_batch (contract: csrc/kv_offload/ops.h).

Every test runs against both implementations -- the native op
torch.ops._C_ascend.kv_offload_swap_blocks and the torch path
(copy_paths.TorchCopier, what a build without native code copies with) --
which must behave the same on device "cpu": each returns (copies,
workspace), the workspace empty on "cpu" (None on the torch path, which has
none).
"""

from __future__ import annotations

import functools
import importlib
import os
import random
import threading
import time
from collections.abc import Callable

import pytest
import torch

from vllm_ascend.kv_offload import ops
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
_BUFFERS: list[torch.Tensor] = []


def torch_path_swap(src, dst, sizes, device):
    """The torch path over every buffer this test made, with the workspace
    shaped as the op's on "cpu" (it has none)."""
    copies, _ = TorchCopier(_BUFFERS).swap(src, dst, sizes, device)
    return copies, torch.empty(0, dtype=torch.uint8)


@pytest.fixture(params=[pytest.param("native", marks=needs_native), "torch"])
def swap(request: pytest.FixtureRequest) -> Swap:
    _BUFFERS.clear()
    return NATIVE if request.param == "native" else torch_path_swap


def descriptors(
    fragments: list[tuple[int, int, int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[(src_addr, dst_addr, size), ...] -> (src_addrs, dst_addrs, sizes)."""
    cols = list(zip(*fragments, strict=True)) if fragments else [(), (), ()]
    return tuple(torch.tensor(c, dtype=torch.int64) for c in cols)  # type: ignore[return-value]


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-128, 128, (n,), dtype=torch.int8, generator=g)
    _BUFFERS.append(t)
    return t


def poisoned(n: int) -> torch.Tensor:
    t = torch.full((n,), POISON, dtype=torch.int8)
    _BUFFERS.append(t)
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


@pytest.fixture
def buffers() -> tuple[torch.Tensor, torch.Tensor]:
    return random_bytes(4096), poisoned(4096)


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


NPU_LACKING = pytest.mark.skipif(
    "npu" in NATIVE_BACKENDS, reason="this build includes the npu backend"
)
WITHOUT_NPU = [needs_native, NPU_LACKING]  # the native op built without npu
NOT_COMPILED = "backend 'npu' was not compiled into this build"
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


HOST_OPS = {
    "register": lambda device: ops.host_register(4096, 4096, device),
    "unregister": lambda device: ops.host_unregister(4096, device),
    "alloc": lambda device: ops.host_alloc(4096, device),
    "free": lambda device: ops.host_free(4096, device),
}
NOT_SUPPORTED = "is not supported; only 'npu' is implemented"


@pytest.mark.skipif(not ops.HAS_NATIVE_OP, reason="needs the native op in use")
@pytest.mark.parametrize("op", HOST_OPS)
@pytest.mark.parametrize(
    "device, message",
    [
        # npu needs the npu backend ...
        pytest.param("npu", NOT_COMPILED, marks=NPU_LACKING),
        # ... the others need no host-memory op; every op says so alike.
        ("cuda", f"device 'cuda' {NOT_SUPPORTED}"),
        ("cpu", f"device 'cpu' {NOT_SUPPORTED}"),
        ("tpu", "unknown device 'tpu'; expected 'npu'"),
    ],
)
def test_the_host_memory_ops_serve_npu_only(op: str, device: str, message: str):
    with pytest.raises(RuntimeError, match=f"kv_offload_host_{op}: .*{message}"):
        HOST_OPS[op](device)


@needs_native
def test_per_copy_is_an_argument_of_the_call_not_a_switch() -> None:
    per_copy = functools.partial(NATIVE, per_copy=True)
    src, dst = random_bytes(64), poisoned(64)
    assert run_copy(per_copy, src, dst, [(0, 0, 64)]) == 1  # cpu: one code path
    assert not hasattr(torch.ops._C_ascend, "kv_offload_set_per_copy")


# --- copy routines of the native cpu backend -------------------------------
#
# Large jobs use non-temporal (streaming) stores on AVX2 CPUs, small ones
# memcpy; VLLM_ASCEND_CPU_COPY_METHOD forces one. Every routine must copy the
# same bytes whatever the alignment of source and destination.

COPY_METHOD_ENV = "VLLM_ASCEND_CPU_COPY_METHOD"


@needs_native
@pytest.mark.parametrize("method", ["auto", "memcpy", "stream"])
def test_every_copy_routine_is_byte_exact_at_any_alignment(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(COPY_METHOD_ENV, method)
    rng = random.Random(5)
    # Sizes around the streaming loop's steps (32 B stores, 128 B iterations,
    # 1 KiB minimum piece) plus three large ones, so the job is > 8 MiB and
    # "auto" streams it too; gaps of 0-63 bytes misalign both sides.
    sizes = [1, 31, 32, 33, 127, 129, 1023, 1024, 1025, 4095, 65_553, 300_001]
    sizes = sizes * 4 + [3 * MiB + 5] * 3
    src, dst, frags = scattered_case(sizes, rng, max_gap=63)

    assert run_copy(NATIVE, src, dst, frags) == len(frags)


@needs_native
def test_unknown_copy_method_raises_naming_the_variable_and_copies_nothing(
    buffers: tuple[torch.Tensor, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(COPY_METHOD_ENV, "fast")
    src, dst = buffers
    with pytest.raises(
        RuntimeError, match=rf"{COPY_METHOD_ENV}='fast' is not one of 'auto'"
    ):
        run_copy(NATIVE, src, dst, [(0, 0, 4096)])
    assert (dst == POISON).all()


@needs_native
def test_copies_from_a_thread_bound_to_one_cpu() -> None:
    # vLLM binds its CPU worker threads to cores; the op sizes its fan-out by
    # the calling thread's affinity and must copy everything all the same.
    n = 32 * MiB + 7
    src, dst = random_bytes(n, seed=6), poisoned(n)
    result: list[object] = []

    def bound() -> None:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        result.append(run_copy(NATIVE, src, dst, [(0, 0, n)]))

    t = threading.Thread(target=bound)
    t.start()
    t.join()

    assert result == [1]  # one copy, byte-exact (checked in the thread)


# --- torch.library.opcheck ------------------------------------------------
#
# Which of opcheck's test_utils apply to an op whose effect is on raw memory
# that its arguments only name by address:
#   test_schema     YES. Runs the op under SchemaCheckMode on copies of the
#                   descriptor tensors: the schema matches what the kernel
#                   returns, the descriptors are not mutated, and the
#                   workspace aliases no input. The copy itself happens for
#                   real (the copied descriptors hold the same addresses), so
#                   it is checked below too; running it again copies the same
#                   bytes, so opcheck's repeated runs are harmless.
#   test_autograd_registration  SKIPPED: int64 descriptors cannot require
#                   grad, so opcheck would return without checking anything.
#   test_faketensor, test_aot_dispatch_static, test_aot_dispatch_dynamic
#                   SKIPPED: the op is not traceable, by design. Under fake
#                   tensors there are no addresses to read (the kernel refuses
#                   the meta descriptors), the copy count depends on their
#                   values, and the memory written is invisible to the schema,
#                   so a compiler could neither shape nor order it; the op is
#                   called eagerly by the copy engine, never inside a graph.


@needs_native
@pytest.mark.parametrize(
    "frags, copies",
    [
        # three runs: 4 + 1 + 3 adjacent fragments
        ([(i * 64, 2048 + i * 64, 64) for i in range(4)] + [(1000, 10, 7)]
         + [(3000 + i * 32, 100 + i * 32, 32) for i in range(3)], 3),
        ([], 0),
    ],
    ids=["three-runs", "empty"],
)  # fmt: skip
def test_opcheck_schema_of_the_native_op(frags, copies: int) -> None:
    src, dst = random_bytes(4096, seed=9), poisoned(4096)
    expected, args = after(src, dst, frags)
    torch.library.opcheck(NATIVE, args, test_utils="test_schema")
    assert torch.equal(dst, expected)  # it ran, for real
    assert run_copy(NATIVE, src, dst, frags) == copies


@needs_native
def test_opcheck_schema_of_the_backends_op() -> None:
    op = torch.ops._C_ascend.kv_offload_backends.default
    torch.library.opcheck(op, (), test_utils="test_schema")


# --- threading and loading -------------------------------------------------


@needs_native
def test_native_op_does_not_hold_the_gil_while_copying() -> None:
    # ~1 GiB of copying from 4 MiB of memory: the same buffer 256 times (the
    # fragments are not adjacent, so they do not merge; the concurrent
    # writes to dst all carry the same bytes).
    src, dst = random_bytes(4 * MiB), poisoned(4 * MiB)
    frags = [(src.data_ptr(), dst.data_ptr(), 4 * MiB)] * 256
    stamps: list[float] = []
    stop = threading.Event()

    def ticker() -> None:  # can only run while nobody holds the GIL
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.001)

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.02)
    t0 = time.perf_counter()
    NATIVE(*descriptors(frags), "cpu")
    t1 = time.perf_counter()
    stop.set()
    thread.join()

    window = [t0, *(t for t in stamps if t0 < t < t1), t1]
    longest_stall = max(b - a for a, b in zip(window, window[1:], strict=False))
    assert longest_stall < 0.5 * (t1 - t0), (
        f"other Python threads stalled {longest_stall * 1e3:.0f} ms of a "
        f"{(t1 - t0) * 1e3:.0f} ms copy: the GIL was held"
    )
    assert torch.equal(dst, src)


def test_entry_point_uses_the_native_op_when_built() -> None:
    enabled = NATIVE is not None and os.environ.get("VLLM_ASCEND_NATIVE_OP") != "0"
    assert ops.HAS_NATIVE_OP == enabled
    assert ops.native_backends() == (NATIVE_BACKENDS if enabled else ())
    src, dst = random_bytes(64), poisoned(64)
    if not enabled:  # the worker copies on the torch path instead
        with pytest.raises(RuntimeError, match="the native op is not in use"):
            run_copy(ops.swap_blocks_batch, src, dst, [(0, 0, 64)])
        return
    assert "cpu" in ops.native_backends()

    assert run_copy(ops.swap_blocks_batch, src, dst, [(0, 0, 64)]) == 1


def test_native_op_can_be_disabled_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ASCEND_NATIVE_OP", "0")
    try:
        importlib.reload(ops)
        assert not ops.HAS_NATIVE_OP
        assert ops.native_backends() == ()
        assert ops.fallback_reason() == "VLLM_ASCEND_NATIVE_OP=0 is set"
        for device in ("cpu", "npu"):
            with pytest.raises(
                RuntimeError,
                match=r"not in use \(VLLM_ASCEND_NATIVE_OP=0 is set\).*torch path",
            ):
                ops.swap_blocks_batch(*descriptors([]), device)
    finally:
        monkeypatch.undo()
        importlib.reload(ops)
