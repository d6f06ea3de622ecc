"""benchmarks/bench_tiering.py's measuring parts without an engine: the read
bandwidth pass over verified block files, and the summary of trials."""

from __future__ import annotations

import mmap
import os

import pytest

from benchmarks import bench_tiering as bench
from vllm_ascend.kv_offload.tiering.block_file import HEADER_BYTES, write_block


def test_read_bandwidth_reads_and_verifies_every_file(tmp_path):
    block = 4 * mmap.PAGESIZE
    payload = mmap.mmap(-1, block)
    for i in range(3):
        payload[:] = bytes([i]) * block
        path = str(tmp_path / "ab" / f"{i}.bin")
        assert write_block(path, memoryview(payload), b"I" * 32, bytes([i]) * 32, 0)
    result = bench.read_bandwidth(str(tmp_path), block)
    assert result["files"] == 3 and result["total_bytes"] == 3 * (HEADER_BYTES + block)
    rows = result["rows"]
    assert set(rows) == {
        "plain_cold",
        "plain_warm",
        "fs_tier_read",
        "fs_tier_read_buffered_warm",
    }
    assert all(r["gbps"] > 0 for r in rows.values())
    assert rows["plain_cold"]["resident_before"] in (0.0, None)  # dropped
    assert rows["plain_warm"]["resident_before"] in (1.0, None)
    # A damaged file fails the verified read, not silently.
    victim = str(tmp_path / "ab" / "1.bin")
    with open(victim, "r+b") as f:
        f.seek(HEADER_BYTES + 7)
        f.write(b"\xff")
    with pytest.raises(OSError, match="checksum mismatch"):
        bench.read_bandwidth(str(tmp_path), block)
    assert os.path.exists(victim)


def test_summary_medians_and_ratios():
    trials = [
        {"length": 1024, "fs_s": f, "cpu_s": c, "recompute_s": r,
         "one_token_s": 0.01, "fs_tier_read_bytes": 8e6, "fs_tier_read_s": 0.01,
         "loadavg": 1.0}
        for f, c, r in [(0.04, 0.01, 0.2), (0.06, 0.02, 0.4), (0.05, 0.01, 0.3)]
    ]  # fmt: skip
    (row,) = bench.summarize(trials, [1024])
    assert row["fs_ms"]["median"] == pytest.approx(50)
    assert row["fs_over_cpu"] == pytest.approx(5)
    assert row["recompute_over_fs"] == pytest.approx(6)
    assert row["engine_tier_read_gbps"] == pytest.approx(0.8)
