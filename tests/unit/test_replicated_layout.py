"""MLA under tensor parallelism with the guide's spec: every rank holds the
same KV, which vLLM flags as a replicated layout
(``OffloadingConfig.replicated_layout``); the workers of the host then share
one copy, a region in ``/dev/shm`` (``region_worker.py``), which rank 0
alone writes and every rank loads from. Without the flag each worker keeps
its private pool, as before.

The two ranks of a TP=2 engine run here as two threads of one process, each
with its own spec, KV cache and mapping of the region; vLLM's barrier of
all workers is a ``threading.Barrier`` of the two.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from tests.unit.conftest import new_engine_id
from tests.unit.kv_helpers import make_config, make_kv_caches
from tests.unit.tier_helpers import refusal
from vllm_ascend.kv_offload import host_guard, host_ledger, vllm_compat
from vllm_ascend.kv_offload.host_memory import BORROWED
from vllm_ascend.kv_offload.npu import NPUOffloadingSpec
from vllm_ascend.kv_offload.pool_metrics import PoolCapacity
from vllm_ascend.kv_offload.region import mark_path, region_path
from vllm_ascend.kv_offload.region_worker import taking_turns

PAGE = 65536  # one device block of one tensor, one worker: make_config's
BLOCKS = 8  # CPU blocks asked for (num_cpu_blocks)
TP = 2


def spec_of(rank: int, engine_id: str, replicated: bool = True) -> NPUOffloadingSpec:
    return NPUOffloadingSpec(
        make_config(
            {"num_cpu_blocks": BLOCKS},
            worker_kv_bytes_per_block=PAGE,
            world_size=TP,
            rank=rank,
            replicated_layout=replicated,
            engine_id=engine_id,
        )
    )


# The host's ledger of CPU pools, the test's own: no other pool.
pytestmark = pytest.mark.usefixtures("host_ledger_dir")


@pytest.fixture
def engine_id() -> str:
    engine = new_engine_id("unit-mla")
    yield engine
    # Nothing of the engine is left in /dev/shm, whatever the test did.
    assert not os.path.exists(region_path(engine))
    assert not os.path.exists(mark_path(engine))


@pytest.fixture
def all_workers_barrier(monkeypatch) -> threading.Barrier:
    """vLLM's barrier of all workers, for TP threads of this process."""
    barrier = threading.Barrier(TP, timeout=60)
    monkeypatch.setattr(vllm_compat, "all_workers_barrier", barrier.wait)
    return barrier


def on_every_rank(engine_id: str, start=None, held=None) -> tuple[list, list]:
    """Each rank's KV cache and what ``start(rank, kv)`` returned (default:
    the rank's worker), run for each rank at once (as vLLM's workers
    start); none of them done while ``held`` (a context) is held."""
    kv = [make_kv_caches(4, [PAGE], seed=rank) for rank in range(TP)]
    start = start or (lambda rank, kv: spec_of(rank, engine_id).get_worker(kv[rank]))
    with ThreadPoolExecutor(TP) as pool:
        with held or contextlib.nullcontext():
            futures = [pool.submit(start, rank, kv) for rank in range(TP)]
            assert held is None or not wait(futures, timeout=0.5).done
        return kv, [f.result(timeout=120) for f in futures]


def test_a_replicated_layout_is_sized_as_one_copy_for_all_workers(engine_id):
    """Without the flag each worker keeps a private pool of its own memory."""
    shared = spec_of(0, engine_id, replicated=True)
    private = spec_of(1, engine_id, replicated=False)
    assert shared.replicated_layout and not private.replicated_layout
    assert shared.pool_capacity() == PoolCapacity(BLOCKS, BLOCKS * PAGE)
    assert private.pool_capacity() == PoolCapacity(BLOCKS, BLOCKS * TP * PAGE)
    worker = private.get_worker(make_kv_caches(4, [PAGE]))
    try:
        assert not hasattr(worker, "region")
        assert worker.pool.memory.kind != BORROWED
        assert worker.pool.nbytes == BLOCKS * PAGE
    finally:
        worker.shutdown()


def test_the_workers_share_one_copy_that_rank_0_writes_and_every_rank_loads(
    engine_id, all_workers_barrier, monkeypatch
):
    """Host memory for one copy, not two: both ranks start, and the guard
    ran once, in rank 0, which created the region."""
    checks = []

    def available() -> int:
        checks.append(threading.current_thread().name)
        return int(BLOCKS * PAGE * 1.5)  # 90 % of it: one copy, not two

    monkeypatch.setattr(host_guard, "host_available_bytes", available)
    kv, workers = on_every_rank(engine_id)
    try:
        assert len(checks) == 1
        # One region of BLOCKS rows of one copy, every rank on slot 0; its
        # name was removed once both had mapped it; the host's ledger holds
        # the one pool.
        for w in workers:
            assert w.region.total_size_bytes == BLOCKS * PAGE
            assert w.pool.tensor_offsets.tolist() == [0]
            assert w.pool.row_bytes == w.pool.slot_bytes == PAGE
        assert not os.path.exists(region_path(engine_id))
        assert [p.nbytes for p in host_ledger.live_pools()] == [BLOCKS * PAGE]

        # Rank 0 stores device blocks 0, 1 into CPU blocks 2, 3.
        writer, reader = workers
        device = GPULoadStoreSpec([0, 1], group_sizes=[2], block_indices=[0])
        assert writer.submit_store(1, device, CPULoadStoreSpec([2, 3]))
        writer.wait({1})
        assert [r.success for r in writer.get_finished()] == [True]
        # Rank 1 loads them into its device blocks 2, 3: rank 0's bytes.
        into = GPULoadStoreSpec([2, 3], group_sizes=[2], block_indices=[0])
        assert not torch.equal(
            kv[1].tensors[0].tensor[2:4], kv[0].tensors[0].tensor[:2]
        )
        assert reader.submit_load(2, CPULoadStoreSpec([2, 3]), into)
        reader.wait({2})
        assert [r.success for r in reader.get_finished()] == [True]
        assert torch.equal(kv[1].tensors[0].tensor[2:4], kv[0].tensors[0].tensor[:2])
    finally:
        for w in workers:
            w.shutdown()
    assert host_ledger.live_pools() == []


@pytest.mark.parametrize("rank, stores", [(0, [7]), (1, [])])
def test_rank_0_alone_stores_and_every_rank_acknowledges(rank, stores):
    """vLLM's connector worker gates stores on the spec's replicated_layout:
    our spec sets it, so rank 1 acknowledges rank 0's store without one."""
    connector_worker = OffloadingConnectorWorker(spec_of(rank, "gate"), None, None)
    stored: list[int] = []  # the job ids of the stores submitted
    connector_worker.worker = SimpleNamespace(
        submit_store=lambda job_id, src, dst: stored.append(job_id) or True
    )
    job = TransferJob(
        "request",
        GPULoadStoreSpec([0], group_sizes=[1], block_indices=[0]),
        CPULoadStoreSpec([0]),
    )
    connector_worker.prepare_store_kv(OffloadingConnectorMetadata({}, {7: job}))
    connector_worker.start_kv_transfers(OffloadingConnectorMetadata({}, {}))
    assert stored == stores
    acked = connector_worker.build_connector_worker_meta()
    assert (acked.completed_jobs if acked else {}) == ({} if stores else {7: 1})


def test_a_copy_the_host_cannot_hold_is_refused_on_every_rank(
    engine_id, all_workers_barrier, monkeypatch
):
    """Rank 0 names the setting and the fix; rank 1 points to rank 0 (and
    waits for it, instead of creating the region itself)."""
    monkeypatch.setattr(host_guard, "host_available_bytes", lambda: BLOCKS * PAGE)

    def start(rank: int, kv) -> str:
        return refusal(lambda: spec_of(rank, engine_id).get_worker(kv[rank]))

    rank_0, rank_1 = on_every_rank(engine_id, start)[1]
    assert f"({BLOCKS} blocks of {PAGE} bytes)" in rank_0
    assert f"lower num_cpu_blocks to {int(BLOCKS * 0.9)}" in rank_0
    assert "rank 0 did not create it" in rank_1


def test_ranks_on_one_slot_take_turns_at_their_self_check(
    engine_id, all_workers_barrier, shared_region
):
    """The self-check round-trips scratch KV through the pool's first rows:
    while one process holds its turn on the region, no rank sharing the
    slot builds its worker."""
    region, _ = shared_region(BLOCKS, PAGE, PAGE, engine_id=engine_id)
    for worker in on_every_rank(engine_id, held=taking_turns(region))[1]:
        worker.shutdown()
