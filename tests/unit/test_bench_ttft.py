"""benchmarks/bench_ttft.py's measuring parts without an engine: the read
bandwidth pass over verified block files, and the summary of trials."""

from __future__ import annotations

import mmap
import os

import pytest

from benchmarks import bench_ttft as bench
from benchmarks.fs_read_bandwidth import read_bandwidth
from vllm_ascend.kv_offload.tiering.block_file import HEADER_BYTES, write_block


def test_read_bandwidth_reads_and_verifies_every_file(tmp_path):
    block = 4 * mmap.PAGESIZE
    payload = mmap.mmap(-1, block)
    for i in range(3):
        payload[:] = bytes([i]) * block
        path = str(tmp_path / "ab" / f"{i}.bin")
        assert write_block(path, memoryview(payload), b"I" * 32, bytes([i]) * 32, 0)
    result = read_bandwidth(str(tmp_path), block)
    assert result["files"] == 3 and result["total_bytes"] == 3 * (HEADER_BYTES + block)
    rows = result["rows"]
    want = {"plain_cold", "plain_warm", "fs_tier_read", "fs_tier_read_buffered_warm"}
    assert set(rows) == want
    assert all(r["gbps"] > 0 for r in rows.values())
    assert rows["plain_cold"]["resident_before"] in (0.0, None)  # dropped
    assert rows["plain_warm"]["resident_before"] in (1.0, None)
    # A damaged file fails the verified read, not silently.
    victim = str(tmp_path / "ab" / "1.bin")
    with open(victim, "r+b") as f:
        f.seek(HEADER_BYTES + 7)
        f.write(b"\xff")
    with pytest.raises(OSError, match="checksum mismatch"):
        read_bandwidth(str(tmp_path), block)
    assert os.path.exists(victim)


def trial(cold: float, device: float, cpu: float, fs: float | None, load: float):
    row = {"length": 1024, "cold": cold, "device": device, "cpu": cpu}
    row |= {"cold_load": load, "device_load": load, "cpu_load": load}
    if fs is not None:
        row |= {"fs": fs, "fs_load": load}
    return row


def test_summary_medians_ratios_and_the_load_beside_each_figure():
    trials = [
        trial(0.2, 0.008, 0.01, 0.04, 1.0),
        trial(0.4, 0.012, 0.02, 0.06, 3.0),
        trial(0.3, 0.010, 0.01, 0.05, 2.0),
    ]
    (row,) = bench.summarize(trials, [1024])
    assert row["n"] == 3
    assert row["fs"]["median"] == pytest.approx(50)
    assert row["cpu"]["median"] == pytest.approx(10)
    assert row["cold_over_cpu"] == pytest.approx(30)
    assert row["cold_over_fs"] == pytest.approx(6)
    assert row["cpu_over_device"] == pytest.approx(1)
    assert row["fs"]["load"] == (1.0, 3.0)


def test_without_the_fs_tier_there_is_no_fs_column():
    (row,) = bench.summarize([trial(0.2, 0.01, 0.02, None, 1.0)], [1024])
    assert "fs" not in row and "cold_over_fs" not in row
    assert row["cold_over_cpu"] == pytest.approx(10)


def test_lengths_must_be_whole_cpu_blocks():
    with pytest.raises(SystemExit):
        bench.parse_args(["--lengths", "1000"])
    assert bench.parse_args(["--quick"]).lengths == [256, 512]
