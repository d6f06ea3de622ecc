"""The verified fs tier over the CPU tier's shared region, from a lookup to
shutdown: a file removed between a lookup and its load (the size bound,
another engine) is a plain miss; shutting the tiers down unmaps the region
without an error."""

from __future__ import annotations

import logging
import mmap
import os
import time

import pytest
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

from tests.unit.conftest import FS_JOB_TIMEOUT_S, finished_job, fs_job
from tests.unit.tier_helpers import fs_tier
from vllm_ascend.kv_offload.region import close_region
from vllm_ascend.kv_offload.tiering.fs import tier_dir_usable
from vllm_ascend.kv_offload.tiering.fs_budget import FsTierBudget


def test_shutting_the_tiers_down_unmaps_the_region_without_an_error(
    shared_region, fs_tier_spec, tmp_path, caplog
):
    # The scheduler side of an engine: vLLM's CPU tier on the region, our fs
    # tier on the CPU tier's view of it.
    page = mmap.PAGESIZE
    region, mark = shared_region(4, kv_bytes_per_chunk=page, cpu_page_size=page)
    primary = CPUPrimaryTierOffloadingManager(num_chunks=4, mmap_region=region)
    spec = fs_tier_spec()
    root = str(tmp_path / "kv")
    assert tier_dir_usable({"root_dir": root}, spec)
    fs = fs_tier(spec, root, primary.get_kv_memoryview())
    mapping = region.mmap_obj
    TieringOffloadingManager(primary, [fs]).shutdown()
    assert "Failed to close" not in caplog.text
    assert "BufferError" not in caplog.text
    assert mapping.closed
    # The region's name is ours to remove (region.py), not vLLM's cleanup.
    close_region(region, None, mark)
    assert not os.path.exists(region.mmap_path)


def stored(tier, job_id: int, key) -> str:
    """Stores row 0 under ``key``; the block file's path."""
    tier.submit_store(fs_job(job_id, key, False))
    assert finished_job(tier, job_id).success
    return tier.file_mapper.get_file_name(key)


def looked_up(tier, key) -> LookupResult:
    """The tier's answer for ``key`` once its asynchronous lookup resolved
    (the scheduler ends steps meanwhile, which posts the lookups)."""
    ctx = ReqContext("r")
    deadline = time.monotonic() + FS_JOB_TIMEOUT_S
    while (result := tier.lookup(key, ctx)) is LookupResult.RETRY:
        assert time.monotonic() < deadline, "the lookup never resolved"
        tier.on_schedule_end(ScheduleEndContext((), ()))
        time.sleep(0.01)
    return result


@pytest.mark.parametrize("gone", [True, False], ids=["evicted", "damaged"])
def test_a_file_evicted_between_its_lookup_and_its_load_is_a_plain_miss(
    tier, caplog, gone
):
    """Not loaded, not offered again, and not logged; other load failures
    (a damaged file) still are, and the file is removed."""
    key = make_offload_key(b"\x01" * 32, 0)
    path = stored(tier, 1, key)
    for i in range(4):
        stored(tier, 2 + i, make_offload_key(bytes([2 + i]) * 32, 0))
    assert looked_up(tier, key) is LookupResult.HIT
    if gone:  # the size bound makes room before the load runs, and the
        # looked-up file is the least recently used one
        old = time.time() - 3600
        os.utime(path, (old, old))
        file_bytes = os.path.getsize(path)
        FsTierBudget(tier.root_dir, 4 * file_bytes, file_bytes).scan()
        assert not os.path.exists(path)
    else:
        os.truncate(path, 100)  # damaged, not gone
    caplog.clear()
    caplog.set_level(logging.INFO)
    tier.submit_load(fs_job(9, key, True))
    result = finished_job(tier, 9)
    assert result is not None and not result.success  # recomputed, not loaded
    assert tier.files.vanished_blocks == int(gone)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not lines if gone else any("block I/O failed" in m for m in lines), lines
    assert not os.path.exists(path)  # gone, or failed verification: removed
    assert looked_up(tier, key) is LookupResult.MISS  # not offered again
