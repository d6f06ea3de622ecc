"""One host-memory budget for all workers of a host: a worker checks its
pool next to the pools the host's other workers recorded in the host's
ledger, and records its own in the same step (``host_ledger``), so that
workers starting together cannot take more than the guard allows between
them. A pool is counted once whether or not it is allocated yet; a dead
worker's record is removed by the next check.

Workers are specs of this package in separate processes (the real check,
``NPUOffloadingSpec.reserve_host_memory``); each test has a ledger of its
own, except the one that checks /dev/shm is left clean.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from types import SimpleNamespace

import pytest

from tests.unit.kv_helpers import make_config, make_kv_caches
from tests.unit.tier_helpers import refusal
from vllm_ascend.kv_offload import host_guard, host_ledger
from vllm_ascend.kv_offload.host_guard import HOST_BUDGET_ENV, HostBudget, Reserved
from vllm_ascend.kv_offload.npu import NPUOffloadingSpec, OffloadConfigError

GiB, MiB = 2**30, 2**20
BLOCK = 65536  # one CPU block of make_config's worker: one 64 KiB page
FORK = multiprocessing.get_context("fork")


def spec(num_cpu_blocks: int, world_size: int = 1) -> NPUOffloadingSpec:
    return NPUOffloadingSpec(
        make_config({"num_cpu_blocks": num_cpu_blocks}, world_size=world_size)
    )


def kv():
    return make_kv_caches(4, [BLOCK])


def ledger_files(directory: str) -> list[str]:
    return sorted(
        name
        for name in os.listdir(directory)
        if name.startswith(host_ledger.PREFIX) and name.endswith(host_ledger.SUFFIX)
    )


def test_two_workers_whose_pools_fit_alone_but_not_together(host_ledger_dir, available):
    """Tensor-parallel ranks of one engine, each checking its own pool: the
    second sees the first's, is refused naming the total, and is told the
    num_cpu_blocks both ranks fit with."""
    available(GiB)  # 90 % of it: 14745 blocks of 64 KiB in all
    first = spec(10_000, world_size=2).reserve_host_memory(kv())
    message = refusal(lambda: spec(10_000, world_size=2).reserve_host_memory(kv()))
    assert "['num_cpu_blocks']=10000 asks for a CPU pool of 625.00 MiB" in message
    assert "with the 1 other CPU pool of this host (625.00 MiB" in message
    assert "the pools would take 1.22 GiB, more than 90% of the 1.00 GiB" in message
    # Both ranks shrink: 2 x 7372 blocks of 64 KiB fit in 90 % of 1 GiB.
    assert "lower num_cpu_blocks to 7372 (this engine's 2 workers" in message
    assert len(ledger_files(host_ledger_dir)) == 1  # the refused one left none
    first.release()
    assert ledger_files(host_ledger_dir) == []
    spec(10_000, world_size=2).reserve_host_memory(kv()).release()


def test_a_pool_is_counted_once_whether_allocated_or_being_allocated():
    """An allocated pool is gone from MemAvailable already: its bytes are
    given back to the budget and counted among the pools; one still being
    allocated is only counted among the pools."""
    allocated = Reserved(4 * GiB, allocated=True, engine_id="other", pid=1)
    pending = Reserved(4 * GiB, allocated=False, engine_id="other", pid=1)
    # 10 GiB available now next to an allocated 4 GiB pool: 90 % of 14 GiB.
    assert HostBudget(10 * GiB, [allocated]).limit == int(14 * GiB * 0.9)
    assert HostBudget(10 * GiB, [pending]).limit == int(10 * GiB * 0.9)
    request = host_guard.PoolRequest(
        num_blocks=8 * GiB // BLOCK,
        row_bytes=BLOCK,
        key="num_cpu_blocks",
        setting="num_cpu_blocks=131072",
        all_workers_block_bytes=BLOCK,
        blocks_per_chunk=1,
        chunk_key="block_size",
        device_block_tokens=128,
    )
    # 4 + 8 GiB: within 12.6 GiB, over 9 GiB; what the other leaves of
    # 9 GiB: 5 GiB, 81920 blocks of 64 KiB.
    assert host_guard.check_pool(request, HostBudget(10 * GiB, [allocated])) is None
    assert "lower num_cpu_blocks to 81920" in host_guard.check_pool(
        request, HostBudget(10 * GiB, [pending])
    )


def test_the_host_budget_setting_caps_all_pools_and_names_its_fix(
    host_ledger_dir, monkeypatch
):
    monkeypatch.setenv(HOST_BUDGET_ENV, "100MiB")
    first = spec(1000).reserve_host_memory(kv())  # 62.5 MiB
    message = refusal(lambda: spec(1000).reserve_host_memory(kv()))
    assert "the pools would take 125.00 MiB, more than the host budget" in message
    assert f"{HOST_BUDGET_ENV}=100.00 MiB" in message
    assert "lower num_cpu_blocks to 800 (this engine's 2 workers" in message
    assert f"raise {HOST_BUDGET_ENV} to at least {125 * MiB}" in message
    first.release()


def test_a_host_budget_that_is_not_a_size_is_refused_naming_it(
    host_ledger_dir, monkeypatch
):
    monkeypatch.setenv(HOST_BUDGET_ENV, "lots")
    with pytest.raises(OffloadConfigError, match=f"{HOST_BUDGET_ENV}='lots'"):
        spec(10).reserve_host_memory(kv())
    assert ledger_files(host_ledger_dir) == []


def test_a_ledger_directory_that_does_not_exist_is_refused_naming_it(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(host_ledger.LEDGER_DIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(OffloadConfigError, match=f"{host_ledger.LEDGER_DIR_ENV}="):
        spec(10).reserve_host_memory(kv())


def _reserve_and_hold(ledger: str, budget: str, go, results, done) -> None:
    """A worker process: checks and records a pool of 16 blocks (1 MiB)
    when ``go`` is set, reports, and holds its record until ``done``."""
    os.environ[host_ledger.LEDGER_DIR_ENV] = ledger
    os.environ[HOST_BUDGET_ENV] = budget
    # Reading host memory takes a while (as on a loaded host): without one
    # lock around check + record, every worker would check before any
    # recorded its pool.
    host_guard.host_available_bytes = lambda: time.sleep(0.05) or 64 * GiB
    worker_spec = spec(16)
    go.wait()
    try:
        reservation = worker_spec.reserve_host_memory(kv())
        results.put("fit")
    except OffloadConfigError:
        reservation = None
        results.put("refused")
    done.wait()
    del reservation  # held until here


def test_workers_checking_at_once_never_take_more_than_the_budget(host_ledger_dir):
    """Eight workers start at the same moment; a budget of 3.5 pools lets
    exactly three of them have one."""
    go, done, results = FORK.Event(), FORK.Event(), FORK.Queue()
    workers = [
        FORK.Process(
            target=_reserve_and_hold,
            args=(host_ledger_dir, str(7 * MiB // 2), go, results, done),
        )
        for _ in range(8)
    ]
    for w in workers:
        w.start()
    go.set()
    outcomes = sorted(results.get(timeout=120) for _ in workers)
    try:
        assert outcomes == ["fit"] * 3 + ["refused"] * 5
        assert sum(p.nbytes for p in host_ledger.live_pools()) == 3 * MiB
    finally:
        done.set()
        for w in workers:
            w.join(timeout=60)
    assert host_ledger.live_pools() == []  # the next check removes their records
    assert ledger_files(host_ledger_dir) == []


def _reserve_and_wait(ledger: str, ready) -> None:
    os.environ[host_ledger.LEDGER_DIR_ENV] = ledger
    reservation = spec(16).reserve_host_memory(kv())
    ready.set()
    signal.pause()
    del reservation  # held until killed


def hold_a_pool_in_a_process(ledger: str) -> multiprocessing.Process:
    ready = FORK.Event()
    holder = FORK.Process(target=_reserve_and_wait, args=(ledger, ready))
    holder.start()
    assert ready.wait(timeout=120)
    return holder


def test_a_killed_workers_pool_is_swept_by_the_next_check(host_ledger_dir):
    holder = hold_a_pool_in_a_process(host_ledger_dir)
    assert [p.pid for p in host_ledger.live_pools()] == [holder.pid]
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(timeout=60)
    assert len(ledger_files(host_ledger_dir)) == 1  # SIGKILL cleans nothing up
    assert host_ledger.live_pools() == []
    assert ledger_files(host_ledger_dir) == []


def test_nothing_is_left_in_dev_shm(monkeypatch):
    """On the real ledger: a pool released, one whose process exited, one
    whose process was killed; after the next check none of them is there."""
    monkeypatch.delenv(host_ledger.LEDGER_DIR_ENV, raising=False)
    assert host_ledger.ledger_dir() == "/dev/shm"
    spec(16).reserve_host_memory(kv()).release()
    exited = FORK.Process(target=_reserve_and_hold_briefly)
    exited.start()
    exited.join(timeout=120)
    killed = hold_a_pool_in_a_process("/dev/shm")
    os.kill(killed.pid, signal.SIGKILL)
    killed.join(timeout=60)
    host_ledger.live_pools()
    ours = {os.getpid(), exited.pid, killed.pid}
    left = [n for n in ledger_files("/dev/shm") if int(n.split("_")[4]) in ours]
    assert left == []


def _reserve_and_hold_briefly() -> None:
    reservation = spec(16).reserve_host_memory(kv())
    os._exit(0)  # as a worker process ends: no clean-up of ours runs
    del reservation


def test_a_released_pool_leaves_the_ledger_and_a_failed_allocation_too(
    host_ledger_dir, monkeypatch
):
    worker = spec(16).get_worker(kv())
    (entry,) = host_ledger.live_pools()
    assert entry == Reserved(
        MiB, allocated=True, engine_id="test-engine", pid=os.getpid()
    )
    worker.shutdown()
    assert ledger_files(host_ledger_dir) == []

    def no_memory(self, kv_caches):
        raise MemoryError("mmap: Cannot allocate memory")

    monkeypatch.setattr(NPUOffloadingSpec, "allocate_pool", no_memory)
    with pytest.raises(MemoryError):
        spec(16).get_worker(kv())
    assert ledger_files(host_ledger_dir) == []


def test_the_doctors_fit_leaves_room_for_the_hosts_live_pools():
    """What the doctor says fits is what the worker's check accepts next to
    the pools already on the host."""
    from vllm_ascend.kv_offload.host_fit import fit_host_memory

    sizing = SimpleNamespace(
        worker_bytes_per_cpu_block=BLOCK,
        bytes_per_cpu_block=BLOCK,
        tensor_parallel_size=1,
        stored_copies=1,
    )
    others = [Reserved(300 * MiB, allocated=True, engine_id="other", pid=1)]
    fit = fit_host_memory(sizing, available_bytes=GiB, other_pools=others)
    # 90 % of (1 GiB + 300 MiB) less 300 MiB: 14,265 blocks of 64 KiB.
    assert fit.max_num_cpu_blocks == (int(1324 * MiB * 0.9) - 300 * MiB) // BLOCK
    assert fit.max_num_cpu_blocks == 14_265
    assert fit.other_pools_bytes == 300 * MiB
