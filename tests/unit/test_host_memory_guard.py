"""The host-memory guard. A worker checks its CPU block pool once, right
before it allocates it, against the host memory available then (after
vLLM's own allocations: on its CPU backend the KV cache is host memory
too); the scheduler side allocates nothing and checks nothing.

One budget for all workers of a host: a worker checks its pool next to the
pools the host's other workers recorded in the host's ledger, and records
its own in the same step (``host_ledger``), so that workers starting
together cannot take more than the guard allows between them. A pool is
counted once whether or not it is allocated yet; a dead worker's record is
removed by the next check.

Host memory is faked (``host_guard.host_available_bytes``) where a test
says so; ``RecordingSpec`` records the pools it is asked for, so those
tests allocate none. Other workers are specs of this package in separate
processes (the real check, ``NPUOffloadingSpec.reserve_host_memory``).
Each test has a ledger of its own (``host_ledger_dir``), empty: no other
worker on the host; except the one that checks /dev/shm is left clean.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)

from tests.unit.kv_helpers import make_config, make_kv_caches
from tests.unit.tier_helpers import FORK, forked, refusal
from vllm_ascend.kv_offload import cpu_pool, host_guard, host_ledger
from vllm_ascend.kv_offload.host_guard import HOST_BUDGET_ENV, HostBudget
from vllm_ascend.kv_offload.host_ledger import LEDGER_DIR_ENV, Reserved
from vllm_ascend.kv_offload.npu import NPUOffloadingSpec, OffloadConfigError

GiB, MiB = 2**30, 2**20
BLOCK = 65536  # one CPU block of make_config's worker: one 64 KiB page


def spec(num_cpu_blocks: int, world_size: int = 1) -> NPUOffloadingSpec:
    return NPUOffloadingSpec(
        make_config({"num_cpu_blocks": num_cpu_blocks}, world_size=world_size)
    )


def kv() -> CanonicalKVCaches:
    """A small KV cache in host memory (as on vLLM's CPU backend)."""
    return make_kv_caches(4, [BLOCK])


def reserve(num_cpu_blocks: int = 16, world_size: int = 1) -> host_ledger.Reservation:
    """The real check of a worker's pool, recorded in the host's ledger."""
    return spec(num_cpu_blocks, world_size).reserve_host_memory(kv())


class RecordingSpec(NPUOffloadingSpec):
    """Allocates nothing: records the pools it was asked for (their number
    of blocks); its pool is the layout the spec asked for, its worker that
    pool."""

    allocated: list[int] = []
    worker_cls = staticmethod(lambda kv_caches, pool, copy_path: pool)

    def allocate_pool(self, kv_caches):
        RecordingSpec.allocated.append(self.num_chunks)
        return SimpleNamespace(release=lambda: None, on_release=lambda cb: None)


@pytest.fixture(autouse=True)
def no_pools_yet(host_ledger_dir):
    RecordingSpec.allocated = []


def unwritten_kv(blocks: int, page: int, device: str = "cpu") -> CanonicalKVCaches:
    """A KV cache of one ``[blocks, page]`` tensor never written (no memory
    used for it on "cpu"; "meta": not host memory, as on an NPU or GPU)."""
    tensor = torch.empty((blocks, page), dtype=torch.int8, device=device)
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=tensor, page_size_bytes=page)],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=page)]],
    )


def test_the_scheduler_side_checks_no_memory_and_a_worker_checks_once(available):
    """The scheduler side, built after the workers allocated their pools,
    must not count them (it used to, and refused pools that had been
    allocated fine); the largest pool that fits is allocated."""
    available(0)
    spec = RecordingSpec(make_config({"num_cpu_blocks": 14745}))
    assert spec.num_chunks == 14745
    spec.get_manager()
    available(GiB)  # 90 % of it holds 14745 blocks of 64 KiB
    worker = spec.get_worker(kv())
    assert RecordingSpec.allocated == [14745]
    available(0)  # checked once: the worker exists now
    assert spec.get_worker(kv()) is worker


def ledger_files(directory: str) -> list[str]:
    return sorted(
        name
        for name in os.listdir(directory)
        if name.startswith(host_ledger.PREFIX) and name.endswith(host_ledger.SUFFIX)
    )


def refused(
    available, extra, says, kv_cache=kv, not_says=(), env=(), beside=0, *, id, **config
):
    """Case ``id``: a pool of ``extra`` (``config``: more of ``make_config``)
    on ``kv_cache()``, refused with ``available`` bytes of host memory left
    (``env``: set) and ``beside`` pools of the same already on the host;
    the message says each of ``says`` and none of ``not_says``."""
    case = dict(available=available, extra=extra, kv_cache=kv_cache, env=dict(env))
    case.update(config=config, says=says, not_says=not_says, beside=beside)
    return pytest.param(SimpleNamespace(**case), id=id)


@pytest.mark.parametrize(
    "case",
    [
        # 90 % of 1 GiB holds 14745 blocks of 64 KiB: one block more.
        refused(GiB, {"num_cpu_blocks": 14746}, [
            "['num_cpu_blocks']=14746", "lower num_cpu_blocks to 14745",
            "1.00 GiB of host memory available",
        ], id="one-block-more"),
        # cpu_bytes_to_use is checked in its own terms.
        refused(GiB, {"cpu_bytes_to_use": 2 * GiB}, [
            f"['cpu_bytes_to_use']={2 * GiB}",
            f"lower cpu_bytes_to_use to {14745 * BLOCK}",
        ], id="cpu-bytes-to-use"),
        # vLLM's CPU backend allocates its KV cache (64 MiB of host memory)
        # after the spec is built and before the pool: the pool (150 MiB)
        # must fit in what is left, and the error says which of the two to
        # lower, and to what. 90 % of 136 MiB: 1958 blocks; 150 MiB fit in
        # 90 % of 136 + 30.67 MiB: the KV cache may keep 33.33 MiB.
        refused(136 * MiB, {"num_cpu_blocks": 2400}, [
            "lower num_cpu_blocks to 1958", "takes 64.00 MiB of host memory",
            "set kv_cache_memory_bytes to at most 34952533",
        ], lambda: make_kv_caches(1024, [BLOCK]), id="kv-cache-after-start-up"),
        # VLLM_CPU_KVCACHE_SPACE counts whole GiB: the fix says which value.
        # 90 % of 12 GiB: 172 blocks of 64 MiB; 15 GiB fit in 90 % of 12 +
        # 4.67 GiB: 3 of the 8 GiB of KV cache may stay.
        refused(12 * GiB, {"num_cpu_blocks": 240}, [
            "lower num_cpu_blocks to 172", "lower VLLM_CPU_KVCACHE_SPACE from 8 to 3",
        ], lambda: unwritten_kv(128, 64 * MiB), env={"VLLM_CPU_KVCACHE_SPACE": "8"},
            worker_kv_bytes_per_block=64 * MiB, id="vllm-cpu-kvcache-space"),
        # A KV cache outside host memory is not offered as the fix.
        refused(GiB, {"num_cpu_blocks": 20000}, ["lower num_cpu_blocks to 14745"],
                lambda: unwritten_kv(4, BLOCK, "meta"), ["VLLM_CPU_KVCACHE_SPACE"],
                id="kv-cache-not-on-host"),
        # One block larger than the limit: what makes blocks smaller.
        refused(BLOCK, {"num_cpu_blocks": 1}, [
            f"one CPU block ({BLOCK} bytes)", "one device block (128 tokens) already",
        ], not_says=["num_cpu_blocks to 0"], id="one-device-block"),
        refused(2 * BLOCK, {"num_cpu_blocks": 1, "block_size": 256}, [
            f"one CPU block ({2 * BLOCK} bytes)", "lower block_size from 256 to 128",
        ], not_says=["num_cpu_blocks to 0"], blocks_per_chunk=2, id="block-size"),
        refused(2 * BLOCK, {"num_cpu_blocks": 1, "blocks_per_chunk": 2}, [
            f"one CPU block ({2 * BLOCK} bytes)", "lower blocks_per_chunk from 2 to 1",
        ], not_says=["num_cpu_blocks to 0"], blocks_per_chunk=2, id="blocks-per-chunk"),
        # Tensor-parallel ranks of one engine, each checking its own pool:
        # the second sees the first's, is refused naming the total, and is
        # told the num_cpu_blocks both ranks fit with: 2 x 7372 blocks of
        # 64 KiB fit in 90 % of 1 GiB.
        refused(GiB, {"num_cpu_blocks": 10_000}, [
            "['num_cpu_blocks']=10000 asks for a CPU pool of 625.00 MiB",
            "with the 1 other CPU pool of this host (625.00 MiB",
            "the pools would take 1.22 GiB, more than 90% of the 1.00 GiB",
            "lower num_cpu_blocks to 7372 (this engine's 2 workers",
        ], beside=1, world_size=2, id="two-ranks"),
        # The host budget setting caps all pools (two of 62.5 MiB here).
        refused(64 * GiB, {"num_cpu_blocks": 1000}, [
            "the pools would take 125.00 MiB, more than the host budget",
            f"{HOST_BUDGET_ENV}=100.00 MiB",
            "lower num_cpu_blocks to 800 (this engine's 2 workers",
            f"raise {HOST_BUDGET_ENV} to at least {125 * MiB}",
        ], env={HOST_BUDGET_ENV: "100MiB"}, beside=1, id="host-budget"),
        # A host budget that is not a size, a ledger directory that does not
        # exist.
        refused(GiB, {"num_cpu_blocks": 10}, [f"{HOST_BUDGET_ENV}='lots'"],
                env={HOST_BUDGET_ENV: "lots"}, id="bad-host-budget"),
        refused(GiB, {"num_cpu_blocks": 10}, [f"{LEDGER_DIR_ENV}='/missing' is not"],
                env={LEDGER_DIR_ENV: "/missing"}, id="no-ledger-directory"),
    ],
)  # fmt: skip
def test_a_pool_that_does_not_fit_is_refused_naming_the_fix(
    available, monkeypatch, host_ledger_dir, case
):
    """Checked when the worker is built, against the host memory available
    then (none when the spec was built) and the pools of the host's other
    workers, before anything is allocated or recorded."""
    available(0)
    spec = RecordingSpec(make_config(case.extra, **case.config))
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    available(case.available)
    others = [spec.reserve_host_memory(kv()) for _ in range(case.beside)]
    message = refusal(lambda: spec.get_worker(case.kv_cache()))
    assert [s for s in case.says if s not in message] == [], message
    assert [s for s in case.not_says if s in message] == [], message
    assert RecordingSpec.allocated == []
    assert len(ledger_files(host_ledger_dir)) == case.beside  # none of the refused
    for other in others:
        other.release()
    assert ledger_files(host_ledger_dir) == []
    if others:  # it fits alone
        spec.reserve_host_memory(kv()).release()


# -- one budget for the workers of a host ----------------------------------


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


def test_nothing_is_left_in_dev_shm(monkeypatch):
    """On the real ledger: a pool released, one whose process exited, one
    whose process was killed (SIGKILL cleans nothing up: its record stays
    until the next check); after the next check none of them is there."""
    monkeypatch.delenv(host_ledger.LEDGER_DIR_ENV, raising=False)
    assert host_ledger.ledger_dir() == "/dev/shm"

    def left(*pids: int) -> list[str]:
        return [n for n in ledger_files("/dev/shm") if int(n.split("_")[4]) in pids]

    reserve().release()
    # As a worker process ends: no clean-up of ours runs.
    exited = FORK.Process(target=lambda: (reserve(), os._exit(0)))
    exited.start()
    exited.join(timeout=120)
    killed = forked(reserve)  # a worker holding its pool's record
    assert killed.pid in [p.pid for p in host_ledger.live_pools()]
    killed.kill()
    killed.join(timeout=60)
    assert len(left(killed.pid)) == 1
    assert killed.pid not in [p.pid for p in host_ledger.live_pools()]
    assert left(os.getpid(), exited.pid, killed.pid) == []


def test_a_released_pool_leaves_the_ledger_and_a_failed_allocation_too(
    host_ledger_dir, monkeypatch
):
    """What the ledger records is the pool's size, byte for byte; the spec
    passes host_piece_bytes to the pool."""
    extra = {"num_cpu_blocks": 10, "host_piece_bytes": 64 * 2**10}
    config = make_config(extra, worker_kv_bytes_per_block=16384)
    worker = NPUOffloadingSpec(config).get_worker(make_kv_caches(4, [4096, 12288]))
    (entry,) = host_ledger.live_pools()
    pid = os.getpid()
    assert entry == Reserved(
        10 * 16384, allocated=True, engine_id="test-engine", pid=pid
    )
    assert entry.nbytes == worker.pool.memory.nbytes
    assert len(worker.pool.tensors) == 10  # a row a unit: 64 KiB / 16 is less
    worker.shutdown()
    assert ledger_files(host_ledger_dir) == []

    def no_memory(*args, **kwargs):
        raise MemoryError("mmap: Cannot allocate memory")

    # Memory the host refuses: the error names the setting to lower.
    monkeypatch.setattr(cpu_pool, "allocate_host_memory", no_memory)
    with pytest.raises(MemoryError, match="lower num_cpu_blocks"):
        spec(16).get_worker(kv())
    assert ledger_files(host_ledger_dir) == []


def test_the_doctors_fit_leaves_room_for_the_hosts_live_pools():
    """What the doctor says fits is what the worker's check accepts next to
    the pools already on the host."""
    sizing = SimpleNamespace(
        worker_bytes_per_cpu_block=BLOCK,
        bytes_per_cpu_block=BLOCK,
        tensor_parallel_size=1,
        stored_copies=1,
    )
    others = [Reserved(300 * MiB, allocated=True, engine_id="other", pid=1)]
    fit = host_guard.fit_host_memory(sizing, available_bytes=GiB, other_pools=others)
    # 90 % of (1 GiB + 300 MiB) less 300 MiB: 14,265 blocks of 64 KiB.
    assert fit.max_num_cpu_blocks == (int(1324 * MiB * 0.9) - 300 * MiB) // BLOCK
    assert fit.max_num_cpu_blocks == 14_265
    assert fit.other_pools_bytes == 300 * MiB
