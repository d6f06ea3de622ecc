"""The tiering spec's shared ``/dev/shm`` region: this rank's pool on it, and
its lifetime (``region.py``): the name released once every process
has mapped it, our mark beside it, the sweep of dead regions at every
opening, and files that are not ours left alone."""

from __future__ import annotations

import fcntl
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from tests.unit.conftest import new_engine_id
from tests.unit.tier_helpers import forked, tiering_spec
from vllm_ascend.kv_offload.config import OffloadConfigError
from vllm_ascend.kv_offload.region import (
    close_region,
    mark_path,
    region_path,
    slot_pool,
)

PAGE = mmap.PAGESIZE


def leftovers(engine_id: str) -> list[str]:
    """What is left in /dev/shm of ``engine_id``'s region: region, mark."""
    paths = [region_path(engine_id), mark_path(engine_id)]
    return [p for p in paths if os.path.exists(p)]


def write_leftovers(engine_id: str, with_mark: bool = True) -> None:
    """A region as a run that died before its name was released leaves it
    (``with_mark``), or as vLLM on CUDA leaves one (no mark)."""
    with open(region_path(engine_id), "wb") as f:
        f.write(b"\x07" * PAGE)
    if with_mark:
        Path(mark_path(engine_id)).touch()


@pytest.fixture
def engine_ids():
    """Fresh engine ids; whatever a test leaves of them is removed."""
    ids: list[str] = []

    def make() -> str:
        ids.append(new_engine_id())
        return ids[-1]

    yield make
    for engine_id in ids:
        for path in (region_path(engine_id), mark_path(engine_id)):
            if os.path.exists(path):
                os.unlink(path)


def test_region_pool_addresses_this_ranks_slot_of_each_row(shared_region):
    region, mark = shared_region(
        3, kv_bytes_per_chunk=4 * PAGE, cpu_page_size=2 * PAGE, rank=1
    )
    # Pages; blocks per chunk; slot offset, capacity; row stride.
    pool = slot_pool(region, [PAGE // 2] * 2 + [PAGE], 1, 2 * PAGE, 2 * PAGE, 4 * PAGE)
    assert pool.row_bytes == 4 * PAGE  # the stride CopyEngine uses
    assert pool.slot_bytes == 2 * PAGE
    assert pool.nbytes == 3 * 2 * PAGE
    assert list(pool.tensor_offsets) == [2 * PAGE, 2 * PAGE + PAGE // 2, 3 * PAGE]
    assert pool.base == region.base_tensor.data_ptr()
    with pytest.raises(OffloadConfigError, match="more than its slot"):
        slot_pool(region, [3 * PAGE], 1, 0, 2 * PAGE, 4 * PAGE)
    pool.release()
    assert region.base_tensor is not None  # the pool frees nothing
    assert np.all(region.base_tensor.numpy() == 0)


def test_a_worker_alone_removes_region_and_mark_when_it_closes(shared_region):
    engine_id = new_engine_id()
    region, mark = shared_region(2, PAGE, PAGE, engine_id=engine_id)
    assert leftovers(engine_id) == [region_path(engine_id), mark_path(engine_id)]
    close_region(region, None, mark)
    assert region.mmap_obj is None and leftovers(engine_id) == []


def test_the_specs_manager_releases_the_name_its_workers_mapped(shared_region, caplog):
    """The order of an engine: the worker creates the region (as
    ``get_worker`` does), the scheduler's manager (``get_manager``) joins it
    last and then releases the name; both mappings stay one memory, and the
    worker's close has nothing left to remove."""
    engine_id = new_engine_id()
    spec = tiering_spec(engine_id, PAGE, 2)
    region, mark = shared_region(
        spec.num_chunks,
        spec.kv_bytes_per_chunk,
        spec.cpu_page_size_per_worker,
        engine_id=engine_id,
    )
    manager = spec.get_manager()
    assert leftovers(engine_id) == []
    region.base_tensor[PAGE + 3] = 42
    view = manager.inner.primary_tier.get_kv_memoryview()
    assert view[1, 3] == 42
    manager.shutdown()
    close_region(region, None, mark)
    assert "Failed to unlink" not in caplog.text


def test_a_scheduler_that_created_the_region_leaves_nothing_at_shutdown():
    """No worker of the engine mapped the region before the scheduler's
    manager (a scheduler on a host without its workers): the manager's
    shutdown removes the region and our mark, not only the next start."""
    engine_id = new_engine_id()
    manager = tiering_spec(engine_id, PAGE, 2).get_manager()
    assert leftovers(engine_id) != []  # the workers still have to join
    manager.shutdown()
    assert leftovers(engine_id) == []


def test_a_live_region_is_kept_until_its_holder_dies(engine_ids, shared_region):
    live = engine_ids()
    write_leftovers(live)
    # The holder's descriptor (never closed) holds the lock until it dies.
    holder = forked(lambda: fcntl.flock(os.open(mark_path(live), 0), fcntl.LOCK_SH))
    try:
        shared_region(2, PAGE, PAGE)
        assert len(leftovers(live)) == 2
    finally:
        holder.kill()
        holder.join()
    shared_region(2, PAGE, PAGE)
    assert leftovers(live) == []


def test_a_region_that_is_not_ours_is_never_touched(engine_ids, shared_region):
    """No mark beside it (vLLM on CUDA names regions the same way), or a
    mark of another user's: the sweep leaves it, and opening a region under
    its engine id is refused with what to do."""
    foreign, others = engine_ids(), engine_ids()
    write_leftovers(foreign, with_mark=False)
    write_leftovers(others)
    for path in (region_path(others), mark_path(others)):
        os.chown(path, 65534, 65534)
    shared_region(2, PAGE, PAGE)
    assert Path(region_path(foreign)).read_bytes() == b"\x07" * PAGE
    assert len(leftovers(others)) == 2
    with pytest.raises(OffloadConfigError, match="engine_id") as info:
        shared_region(2, PAGE, PAGE, engine_id=foreign)
    assert "is not a region of this package" in str(info.value)
    assert Path(region_path(foreign)).read_bytes() == b"\x07" * PAGE
    assert not os.path.exists(mark_path(foreign))


def test_a_killed_processs_region_is_gone_after_the_next_opening(
    engine_ids, shared_region, caplog
):
    """Whatever its engine id: the next opening of any region sweeps it."""
    killed = engine_ids()
    proc = forked(lambda: shared_region(2, PAGE, PAGE, engine_id=killed))
    assert len(leftovers(killed)) == 2
    proc.kill()  # SIGKILL
    proc.join()
    assert len(leftovers(killed)) == 2  # nobody removed them at the kill
    shared_region(2, PAGE, PAGE)
    assert leftovers(killed) == []
    assert f"removed {region_path(killed)}" in caplog.text
