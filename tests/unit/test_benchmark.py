"""The copy-engine benchmark runs on cpu, verifies its copies and reports rows."""

import argparse
import contextlib
import json
import time

import numpy as np
import pytest

from benchmarks import copy_benchmark as benchmark
from vllm_ascend.kv_offload import ops
from vllm_ascend.kv_offload.copy_bandwidth import scatter_slots

COPY_FIELDS = set(
    "device direction fragment_bytes num_fragments method gbps contiguous_gbps "
    "ratio_to_contiguous verified".split()
)


def run_benchmark(capsys, *extra: str) -> str:
    """Its output on cpu: 16 fragments per row, 2 repeats, no layout jobs."""
    argv = ["--device", "cpu", "--num-fragments", "16", "--repeats", "2"]
    argv += ["--settle-ms", "0", "--layout-blocks", "0"]
    assert benchmark.main(argv + list(extra)) == 0
    return capsys.readouterr().out


def run_json(capsys, *extra: str) -> list[dict]:
    out = run_benchmark(capsys, "--json", *extra)
    return [json.loads(line) for line in out.splitlines()]


def test_cpu_rows_are_complete_and_verified(capsys):
    rows = run_json(
        capsys,
        "--fragment-bytes", "4K", "64K",
        "--descriptor-fragments", "400",
        "--descriptor-tensors", "4",
    )  # fmt: skip
    copy_rows = [r for r in rows if r["kind"] == "copy"]
    # "memcpy" (the plain-memcpy reference) and "op" need the native cpu
    # backend (without it the worker copies on the torch path, as "loop").
    methods = ["contiguous", "torch_copy", "loop"]
    methods += ["memcpy", "op"] if ops.HAS_NATIVE_OP else []
    assert {(r["direction"], r["fragment_bytes"], r["method"]) for r in copy_rows} == {
        (d, f, m) for d in ("d2h", "h2d") for f in (4096, 65536) for m in methods
    }
    for r in copy_rows:
        assert COPY_FIELDS <= r.keys()
        assert r["device"] == "cpu" and r["num_fragments"] == 16
        assert r["verified"] is True
        assert r["gbps"] > 0 and r["contiguous_gbps"] > 0
        assert r["ratio_to_contiguous"] == pytest.approx(
            r["gbps"] / r["contiguous_gbps"]
        )
        if r["method"] == "op":  # the scattered pattern merged nothing
            assert r["copies_per_direction"] == 16

    (desc,) = [r for r in rows if r["kind"] == "descriptor_cost"]
    assert desc["num_fragments"] == 400 and desc["verified"] is True
    assert desc["build_us_per_fragment"] > 0
    assert desc["build_submit_us_per_fragment"] > 0


def test_table_output(capsys):
    out = run_benchmark(
        capsys, "--fragment-bytes", "2K", "--descriptor-fragments", "80"
    )
    assert "contiguous" in out and "us/fragment" in out
    assert "2 KiB" in out


# Without native code there is no op to time (the worker copies on the torch
# path): no "op" rows, no layout jobs.
needs_op = pytest.mark.skipif(not ops.HAS_NATIVE_OP, reason="needs the native op")


def test_one_direction_no_descriptor_section_and_the_ascend_layout_jobs(capsys):
    """Layout jobs are verified, with their fragment sizes (where there is an op)."""
    rows = run_json(
        capsys, "--direction", "h2d", "--fragment-bytes", "1K",
        "--descriptor-fragments", "0", "--layout-blocks", "2",
    )  # fmt: skip
    copy_rows = [r for r in rows if r["kind"] != "layout_job"]
    assert {r["direction"] for r in copy_rows} == {"h2d"}
    assert {r["kind"] for r in copy_rows} == {"copy"}
    if not ops.HAS_NATIVE_OP:
        assert len(copy_rows) == len(rows)
        return
    layouts = {r["layout"]: r for r in rows if r["kind"] == "layout_job"}
    kv, mla = layouts["kv_tuple_28x(8x128)"], layouts["mla_61x(512,64)"]
    # (K, V) of 28 layers: 56 parts of 128 x 8 x 128 bf16, one per block.
    assert kv["num_fragments"] == 56 * 2
    assert kv["mean_fragment_bytes"] == 128 * 8 * 128 * 2
    # MLA: 61 (nope, rope) pairs of 128 KiB and 16 KiB per block.
    assert mla["num_fragments"] == 122 * 2
    assert mla["mean_fragment_bytes"] == (128 * 512 * 2 + 128 * 64 * 2) / 2
    for r in (kv, mla):
        assert r["verified"] is True and r["gbps"] > 0


def test_scatter_slots_leave_nothing_to_merge():
    rng = np.random.default_rng(0)
    for n in (2, 3, 10, 1000):
        src, dst = scatter_slots(n, rng)
        assert sorted(src) == list(range(n)) and sorted(dst) == list(range(n))
        assert not np.any((np.diff(src) == 1) & (np.diff(dst) == 1))


def test_concurrent_needs_a_device():
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--device", "cpu", "--concurrent"])


class _FakeAccelerator:
    """Just enough of torch.cuda / torch.npu for the benchmark's stream and
    event code; the "device" memory is host memory and copies are synchronous."""

    class Event:
        def __init__(self, enable_timing: bool = False):
            self.t = 0.0

        def record(self, stream=None):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end) -> float:
            return (end.t - self.t) * 1e3

    class Stream:
        def wait_event(self, event):
            pass

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()

    @staticmethod
    def synchronize():
        pass


@needs_op
def test_stream_timing_and_concurrent_rows_with_a_fake_accelerator():
    device = benchmark.Device("cpu")
    device.mod = _FakeAccelerator()  # takes the events-on-streams path
    args = argparse.Namespace(
        fragment_bytes=[4096], num_fragments=16, total_bytes=None,
        direction="both", concurrent=True, repeats=2, seed=0,
    )  # fmt: skip
    rows, op_missing = benchmark.run_copies(args, device)
    assert op_missing is None
    by_dir = {}
    for r in rows:
        by_dir.setdefault(r["direction"], []).append(r)
    assert set(by_dir) == {"d2h", "h2d", "d2h+h2d"}
    both = by_dir["d2h+h2d"]
    assert all(r["total_bytes"] == 2 * 16 * 4096 and r["verified"] for r in both)
    assert all(r["gbps"] > 0 for r in rows)
