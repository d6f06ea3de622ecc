"""What only the native op of swap_blocks_batch has (contract:
csrc/kv_offload/ops.h): its host-memory ops and per_copy argument, the copy
routines of its cpu backend, its schemas under torch.library.opcheck, copying
without holding the GIL, and how ops.py loads it (or, disabled, does not).

What it shares with the torch path: test_swap_blocks_op.py. The tests that
call the native extension are skipped where it is not built.
"""

from __future__ import annotations

import functools
import importlib
import os
import random
import threading
import time

import pytest
import torch

from tests.unit.swap_helpers import (
    NATIVE,
    NATIVE_BACKENDS,
    NOT_COMPILED,
    NPU_LACKING,
    POISON,
    MiB,
    after,
    descriptors,
    needs_native,
    poisoned,
    random_bytes,
    run_copy,
    scattered_case,
)
from vllm_ascend.kv_offload import ops

# --- the native op's other calls ---------------------------------------------


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
