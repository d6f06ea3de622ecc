"""The start-up self-check: a copy path serves only after scratch KV went
device -> pool -> device byte-exact through it; a path that raises, fails
or moves a wrong byte gives way to the next one; with none left, offloading
is refused at start-up, naming each failure.

Faults are injected here, in the tests: ``FaultyPath`` wraps a real path and
corrupts or fails its copies (the runtime package has no such hook).
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib

import pytest
import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from tests.unit.kv_helpers import make_kv_caches, make_worker, running
from vllm_ascend.kv_offload import ops, self_check
from vllm_ascend.kv_offload.config import OffloadConfigError
from vllm_ascend.kv_offload.copy_paths import (
    TORCH,
    VLLM_BATCH,
    Available,
    CopyPath,
    candidate_paths,
)
from vllm_ascend.kv_offload.self_check import SelfCheckFailed, run_self_check

PAGES = [256, 768]


@dataclasses.dataclass(frozen=True)
class FaultyPath(CopyPath):
    """A real path (``copies_like``, default its name) whose copies go
    wrong: ``fault`` is "byte" (one wrong byte in the destination after the
    copy), "raise" (the copy raises) or "" (none)."""

    fault: str = ""
    copies_like: str = ""

    def bind(self, buffers):
        real = CopyPath(self.copies_like or self.name, self.device_type).bind(buffers)

        def swap(src, dst, sizes):
            if self.fault == "raise":
                raise RuntimeError(f"injected copy error on {self.name}")
            result = real(src, dst, sizes)
            if self.fault == "byte":
                # One byte of one fragment's destination (host memory on
                # the CPU backend, both sides).
                cell = ctypes.c_uint8.from_address(int(dst[len(dst) // 2]) + 5)
                cell.value ^= 0x40
            return result

        return swap


# Three CPU paths to try in order: two that copy as the CPU's best
# candidate does, then the torch path.
PATH_NAMES = ["first", "second", TORCH]


def faulty(faults: dict[str, str]) -> list[CopyPath]:
    """``PATH_NAMES``' paths, each with the fault named for it."""
    best = candidate_paths("cpu")[0].name
    return [
        FaultyPath(
            n, "cpu", fault=faults.get(n, ""), copies_like="" if n == TORCH else best
        )
        for n in PATH_NAMES
    ]


@pytest.fixture
def warnings(monkeypatch) -> list[str]:
    """What the self-check logs as warnings, formatted."""
    seen: list[str] = []
    monkeypatch.setattr(
        self_check.logger, "warning", lambda msg, *a: seen.append(msg % a)
    )
    return seen


def names(paths) -> list[str]:
    return [p.name for p in paths]


def vllm_op_stand_in(calls: list | None = None):
    """What vLLM's swap_blocks_batch does, on host memory: copies entry i,
    sizes[i] bytes, from src_ptrs[i] to dst_ptrs[i]; records its arguments."""

    def swap_blocks_batch(src_ptrs, dst_ptrs, sizes, is_src_access_order_any=False):
        if calls is not None:
            calls.append((src_ptrs, dst_ptrs, sizes))
        cols = (src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist())
        for s, d, n in zip(*cols, strict=True):
            ctypes.memmove(d, s, n)

    return swap_blocks_batch


NO_OP = Available(native_backends=())  # a build without native code
CPU_OP_ONLY = Available(native_backends=("cpu",))  # no npu backend, no vLLM op
NPU_OP = Available(native_backends=("cpu", "npu"))
VLLM_OP = Available(native_backends=("cpu",), vllm_swap=vllm_op_stand_in())


@pytest.mark.parametrize(
    "device, setting, have, expected",
    [
        # cpu: the op, then torch; without native code, torch only.
        ("cpu", "auto", CPU_OP_ONLY, ["native", "torch"]),
        ("cpu", "torch", CPU_OP_ONLY, ["torch"]),
        ("cpu", "native", CPU_OP_ONLY, ["native"]),
        ("cpu", "auto", NO_OP, ["torch"]),
        ("cpu", "native", NO_OP, r"copy_path'\]='native'.*no 'cpu'.*compiled: none"),
        # npu without the native op: the torch path; 'native' says what lacks.
        ("npu", "auto", CPU_OP_ONLY, ["torch"]),
        ("npu", "native", CPU_OP_ONLY, r"copy_path'\]='native'.*no 'npu'"),
        # npu with it: batch, then per copy, then torch.
        ("npu", "auto", NPU_OP, ["native-batch", "native-per-copy", "torch"]),
        # cuda: vLLM's op where this vLLM registers it, else the torch path.
        ("cuda", "auto", VLLM_OP, [VLLM_BATCH, "torch"]),
        ("cuda", "native", VLLM_OP, [VLLM_BATCH]),
        ("cuda", "auto", CPU_OP_ONLY, ["torch"]),
        ("cuda", "native", CPU_OP_ONLY, "no registered swap_blocks_batch"),
    ],
)
def test_the_candidate_paths_of_each_device_best_first(device, setting, have, expected):
    if isinstance(expected, str):
        with pytest.raises(OffloadConfigError, match=expected):
            candidate_paths(device, setting, have=have)
    else:
        assert names(candidate_paths(device, setting, have=have)) == expected


def test_vllms_cpu_build_offers_no_cuda_op_and_cpu_never_asks_for_it():
    # This venv's vLLM is its CPU build: the op is not registered there.
    assert Available.here("cuda").vllm_swap is None
    assert Available.here("cpu").vllm_swap is None


def test_the_vllm_path_hands_vllms_op_the_merged_copies_and_keeps_them():
    calls: list = []
    swap = CopyPath(VLLM_BATCH, "cuda", vllm_op_stand_in(calls)).bind([])
    src = torch.arange(256, dtype=torch.uint8)
    dst = torch.zeros(256, dtype=torch.uint8)
    # Fragments 0 and 1 are adjacent on both sides, fragment 2 is not.
    s0, d0 = src.data_ptr(), dst.data_ptr()
    frags = [(s0, d0 + 128, 16), (s0 + 16, d0 + 144, 16), (s0 + 64, d0, 8)]
    desc = [torch.tensor(c, dtype=torch.int64) for c in zip(*frags, strict=True)]
    copies, keep = swap(*desc)
    assert copies == 2
    ((s, d, n),) = calls
    assert n.tolist() == [32, 8] and s.dtype == d.dtype == n.dtype == torch.int64
    # The op reads these host arrays asynchronously: the queue keeps them.
    assert all(a is b for a, b in zip(keep, (s, d, n), strict=True))
    assert torch.equal(dst[128:160], src[:32]) and torch.equal(dst[:8], src[64:72])
    # A bad batch is refused with the op's own words before vLLM sees it.
    bad = [torch.tensor([0]), torch.tensor([d0]), torch.tensor([8])]
    with pytest.raises(RuntimeError, match=r"src_addrs\[0\] is a null address"):
        swap(*bad)
    assert len(calls) == 1


def test_the_self_check_verifies_the_vllm_path_like_any_other(warnings):
    good = CopyPath(VLLM_BATCH, "cpu", vllm_op_stand_in())
    result = run_self_check("cpu", PAGES, paths=[good])
    assert result.passed and result.path == VLLM_BATCH and result.swap is not None

    def off_by_one(src_ptrs, dst_ptrs, sizes, is_src_access_order_any=False):
        vllm_op_stand_in()(src_ptrs, dst_ptrs, sizes - 1)

    bad = CopyPath(VLLM_BATCH, "cpu", off_by_one)
    result = run_self_check("cpu", PAGES, paths=[bad])
    assert not result.passed and result.swap is None
    assert f"{VLLM_BATCH}: " in result.failure and "wrong bytes" in result.failure


def test_self_check_passes_on_the_best_path_and_reports_it():
    result = run_self_check("cpu", PAGES)
    best = candidate_paths("cpu")[0].name
    assert result.passed and result.path == best and result.failure is None
    assert result.bytes_per_direction == self_check.SCRATCH_BLOCKS * sum(PAGES)
    assert result.bandwidth_gbps > 0
    assert [a.path for a in result.attempts] == [best]
    assert result.swap is not None
    assert result.memory_kind == "pageable mmap"


@pytest.mark.parametrize("fault", ["byte", "raise"])
@pytest.mark.parametrize("level", [0, 1])
def test_a_faulty_path_gives_way_to_the_next(fault, level, warnings):
    paths = faulty({n: fault for n in PATH_NAMES[: level + 1]})
    result = run_self_check("cpu", PAGES, paths=paths)
    assert result.passed
    assert result.path == paths[level + 1].name
    failed = result.attempts[: level + 1]
    assert [a.passed for a in failed] == [False] * (level + 1)
    what = "wrong bytes" if fault == "byte" else "injected copy error"
    for attempt, message in zip(failed, warnings, strict=True):
        assert what in attempt.failure
        assert f"copy path {attempt.path} is NOT byte-exact" in message


def test_no_byte_exact_path_refuses_offloading_naming_each_failure(warnings):
    paths = faulty({n: "byte" for n in PATH_NAMES})
    result = run_self_check("cpu", PAGES, paths=paths)
    assert not result.passed and result.path is None
    for p in paths:
        assert f"{p.name}: 1 wrong bytes" in result.failure
    error = self_check.refusal(result)
    assert "Offloading is refused so that no wrong KV is ever used" in str(error)
    assert "vllm_ascend.kv_offload.doctor" in str(error)


def assert_stores_byte_exact(w, kv) -> None:
    """Device blocks 2 and 5 stored to CPU blocks 0 and 3, byte for byte."""
    spec = GPULoadStoreSpec([2, 5], group_sizes=[2], block_indices=[0])
    assert w.submit_store(1, spec, CPULoadStoreSpec([0, 3]))
    w.wait({1})
    assert [r.success for r in w.get_finished()] == [True]
    rows = w.pool.tensor[[0, 3]]
    assert torch.equal(rows[:, : PAGES[0]], kv.tensors[0].tensor[[2, 5]])


def test_the_worker_serves_on_the_path_the_check_chose(monkeypatch):
    paths = faulty({PATH_NAMES[0]: "byte"})
    monkeypatch.setattr(self_check, "candidate_paths", lambda device, setting: paths)
    logged: list[str] = []
    monkeypatch.setattr(
        self_check.logger, "info", lambda msg, *a: logged.append(msg % a)
    )
    kv = make_kv_caches(8, PAGES)
    before = [t.tensor.clone() for t in kv.tensors]
    with running(make_worker(kv, 1, 4)) as w:
        # The check (a path that failed it included) never touched the live KV.
        for t, b in zip(kv.tensors, before, strict=True):
            assert torch.equal(t.tensor, b)
        assert w.copy_path == paths[1].name == w.self_check.path
        # It copies with the very function the check verified, not a rebind.
        assert w.engine.swap is w.self_check.swap
        # One INFO line names the choice, with the check's figures.
        chosen = [m for m in logged if f" {paths[1].name} " in m]
        assert len(chosen) == 1, logged
        assert f"copy path {paths[1].name} on cpu (self-check: " in chosen[0]
        assert "host memory" in chosen[0]
        # And it moves KV on that path, byte-exact.
        assert_stores_byte_exact(w, kv)


def test_a_worker_with_no_byte_exact_path_is_refused_at_start_up(monkeypatch):
    paths = faulty({n: "raise" for n in PATH_NAMES})
    monkeypatch.setattr(self_check, "candidate_paths", lambda device, setting: paths)
    with pytest.raises(SelfCheckFailed, match="start-up self-check failed on cpu"):
        make_worker(make_kv_caches(8, PAGES), 1, 4)


@pytest.fixture
def no_native_op(monkeypatch):
    """This process as a build without native code: the op not loaded."""
    monkeypatch.setenv("VLLM_ASCEND_NATIVE_OP", "0")
    importlib.reload(ops)
    yield
    monkeypatch.undo()
    importlib.reload(ops)


def test_without_native_code_a_cpu_worker_offloads_on_the_torch_path(
    no_native_op, warnings
):
    assert names(candidate_paths("cpu")) == [TORCH]
    kv = make_kv_caches(8, PAGES)
    with running(make_worker(kv, 1, 4)) as w:
        assert w.copy_path == TORCH == w.self_check.path
        assert_stores_byte_exact(w, kv)
    # Said once, with the reason, as on a device without the op.
    (warning,) = [m for m in warnings if "no native copy op" in m]
    assert "for cpu here (VLLM_ASCEND_NATIVE_OP=0 is set)" in warning
    assert "copies use the torch path" in warning
