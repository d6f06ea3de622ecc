"""A bounded wait for CPU hits (``load_wait.py``, ``max_load_wait_ratio``).

A CPU hit whose copies (the stores queued ahead of its blocks, the loads
queued ahead of it, its own load) would take longer than recomputing its
tokens is recomputed from the key where the wait starts; with fast copies
nothing changes. The figures come from the workers (bytes queued, forward
time per step) and from vLLM's transfer stats (copy bandwidth).
"""

from __future__ import annotations

import time

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    DirectionalTransferStats,
    TransferStats,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from tests.fault_injection import FaultInjectingWorker
from tests.unit.conftest import make_connector
from tests.unit.kv_helpers import OUR_SPEC, make_kv_caches, make_worker
from vllm_ascend.kv_offload import pool_metrics
from vllm_ascend.kv_offload.connector import AscendOffloadingConnectorMetadata
from vllm_ascend.kv_offload.failures import AscendOffloadingWorkerMetadata
from vllm_ascend.kv_offload.load_wait import (
    PREFILL_STEP_MIN_TOKENS,
    LoadWaitBound,
    WorkerFigures,
    hit_wait_s,
    recompute_instead,
)
from vllm_ascend.kv_offload.manager import FailureAwareManager
from vllm_ascend.kv_offload.pool_metrics import PoolCapacity
from vllm_ascend.kv_offload.scheduler_side import DEFAULT_MAX_LOAD_WAIT_RATIO

MiB = 1 << 20
TOKENS_PER_KEY = 128
BYTES_PER_TOKEN = 1024  # per worker: a key's load is 128 KiB
PROMPT_TOKENS = 4 * TOKENS_PER_KEY
# The engine's measured prefill in the WorkerFigures below: 2048 tokens in
# 0.5 s = 4096 tokens/s, so the 512-token prompt recomputes in 0.125 s.


# -- the estimator ------------------------------------------------------------


def test_the_wait_is_the_bytes_ahead_over_each_directions_bandwidth():
    assert hit_wait_s(100 * MiB, 50 * MiB, 10 * MiB, 100 * MiB) == pytest.approx(2.1)
    # A ready block waits for no store: no store bandwidth needed.
    assert hit_wait_s(0, None, 10 * MiB, 100 * MiB) == pytest.approx(0.1)
    assert hit_wait_s(0, None, 0, None) == 0.0


def test_a_direction_without_a_measured_bandwidth_adds_no_wait():
    """A lower bound: an unmeasured copy cannot justify dropping a hit."""
    assert hit_wait_s(MiB, None, 10 * MiB, 100 * MiB) == pytest.approx(0.1)
    assert hit_wait_s(0, None, MiB, None) == 0.0


@pytest.mark.parametrize(
    "wait_s, tokens, tokens_per_s, ratio, expected",
    [
        (2.0, 1024, 1000.0, 1.0, True),  # 2 s wait > 1.024 s prefill
        (1.0, 1024, 1000.0, 1.0, False),  # 1 s wait < 1.024 s prefill
        (2.0, 1024, 1000.0, 2.0, False),  # allowed up to 2.048 s
        (2.0, 1024, 1000.0, 0.0, False),  # 0: the bound is off
        (2.0, 1024, None, 1.0, False),  # prefill rate not measured yet
        (2.0, 0, 1000.0, 1.0, False),  # nothing to recompute
    ],
)
def test_a_hit_is_recomputed_only_when_its_wait_exceeds_ratio_times_its_prefill(
    wait_s, tokens, tokens_per_s, ratio, expected
):
    assert recompute_instead(wait_s, tokens, tokens_per_s, ratio) is expected


# -- the manager's answers ------------------------------------------------------


def bounded_manager(ratio: float = 1.0) -> FailureAwareManager:
    m = FailureAwareManager(CPUOffloadingManager(num_chunks=16), PoolCapacity(16, 16))
    m.wait_bound = LoadWaitBound(ratio, BYTES_PER_TOKEN)
    return m


def stats(store_bytes_per_s: float = 0, load_bytes_per_s: float = 0):
    """vLLM's transfer stats of one second of copies at these bandwidths."""

    def second(rate: float) -> DirectionalTransferStats:
        return DirectionalTransferStats(int(rate), 1.0 if rate else 0.0)

    return TransferStats(load=second(load_bytes_per_s), store=second(store_bytes_per_s))


def keys(n: int) -> list[bytes]:
    return [f"k{i}".encode() for i in range(n)]


def store(m: FailureAwareManager, names: list[bytes], complete: bool) -> None:
    ctx = ReqContext(req_id="writer")
    out = m.prepare_store(names, ctx)
    if complete:
        m.complete_store(list(out.keys_to_store), ctx)


def look_up(m: FailureAwareManager, req_id: str = "reader") -> list[LookupResult]:
    """vLLM's maximal-prefix lookup of a 4-key prompt: stops at a MISS."""
    ctx = ReqContext(req_id=req_id)
    m.wait_bound.begin_lookup(req_id, 0, PROMPT_TOKENS)
    results = []
    for i, key in enumerate(keys(4)):
        ctx.set_offload_key_position(key, (i + 1) * TOKENS_PER_KEY)
        results.append(m.lookup(key, ctx))
        if results[-1] is LookupResult.MISS:
            break
    return results


def recomputed(m: FailureAwareManager) -> float:
    return m.get_stats().reduce()[pool_metrics.HITS_RECOMPUTED]


HIT, PENDING, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS


@pytest.mark.parametrize(
    "ratio, ready, transfer_stats, figures, looked_up, hits_recomputed",
    [
        # 2 of 4 keys stored, 2 still being copied to the CPU behind 64 MiB of
        # stores queued at 16 MiB/s: 4 s, against 0.06 s of prefill.
        (1.0, 2, stats(store_bytes_per_s=16 * MiB),
         WorkerFigures(64 * MiB, 0, 2048, 0.5), [HIT, HIT, MISS], 1),
        # 1 MiB of stores at 10 GiB/s: 0.1 ms, far below the prefill.
        (1.0, 0, stats(store_bytes_per_s=10 << 30),
         WorkerFigures(MiB, 0, 2048, 0.5), [PENDING] * 4, 0),
        # 32 MiB of loads queued at 8 MiB/s: 4 s.
        (1.0, 4, stats(load_bytes_per_s=8 * MiB),
         WorkerFigures(0, 32 * MiB, 2048, 0.5), [MISS], 1),
        (1.0, 4, stats(load_bytes_per_s=10 << 30),
         WorkerFigures(0, MiB, 2048, 0.5), [HIT] * 4, 0),
        # Decode-sized steps only: no prefill rate yet.
        (1.0, 0, stats(store_bytes_per_s=MiB),
         WorkerFigures(64 * MiB, 0, PREFILL_STEP_MIN_TOKENS - 1, 0.5),
         [PENDING] * 4, 0),
        # 0.5 s of stores: 4 times the prefill, under 100 times.
        (100.0, 0, stats(store_bytes_per_s=16 * MiB),
         WorkerFigures(8 * MiB, 0, 2048, 0.5), [PENDING] * 4, 0),
    ],
    ids=[
        "a-pending-hit-behind-a-slow-store-backlog-keeps-only-its-ready-prefix",
        "a-pending-hit-behind-fast-stores-still-waits-for-them",
        "a-hit-behind-a-deep-load-queue-is-recomputed-whole",
        "a-hit-behind-a-short-load-queue-is-served",
        "nothing-is-recomputed-before-the-engine-has-measured-a-prefill",
        "a-larger-ratio-lets-a-hit-wait-longer",
    ],
)  # fmt: skip
def test_the_manager_answers_a_lookup_by_the_wait_it_estimates(
    ratio, ready, transfer_stats, figures, looked_up, hits_recomputed
):
    """``ready`` of a prompt's 4 keys stored, the others still being stored;
    then one step's figures reach the scheduler and the prompt is looked up."""
    m = bounded_manager(ratio)
    for names, complete in ((keys(4)[:ready], True), (keys(4)[ready:], False)):
        if names:
            store(m, names, complete)
    # One step's aggregated worker metadata reaches the scheduler.
    meta = AscendOffloadingWorkerMetadata(
        transfer_stats=transfer_stats, figures=figures
    )
    m.wait_bound.observe(meta)

    assert look_up(m) == looked_up
    assert recomputed(m) == hits_recomputed
    assert recomputed(m) == 0  # a counter: reported once


# -- where the figures come from -------------------------------------------------


@pytest.mark.parametrize("ratio, bounded", [(None, True), (2.5, True), (0, False)])
def test_the_setting_bounds_the_managers_wait_and_0_turns_it_off(ratio, bounded):
    extra = {"num_cpu_blocks": 8, **OUR_SPEC}
    if ratio is not None:
        extra["max_load_wait_ratio"] = ratio
    c = make_connector("scheduler", extra)
    bound = c.connector_scheduler.manager.wait_bound
    assert (bound is not None) is bounded
    if bounded:
        assert bound.ratio == (DEFAULT_MAX_LOAD_WAIT_RATIO if ratio is None else ratio)


def test_the_worker_reports_the_bytes_queued_behind_a_slow_store():
    kv = make_kv_caches(8, [1 << 12])
    worker = make_worker(kv, 1, 8, worker_cls=FaultInjectingWorker)
    worker.delays = {"store": 0.3}
    spec = GPULoadStoreSpec([0, 1], group_sizes=[2], block_indices=[0])
    assert worker.submit_store(1, spec, CPULoadStoreSpec([0, 1]))
    assert worker.queued_bytes() == (2 << 12, 0)
    worker.wait({1})
    assert [r.job_id for r in worker.get_finished()] == [1]
    assert worker.queued_bytes() == (0, 0)
    worker.shutdown()


def test_the_worker_side_reports_its_steps_forward_time_and_queue():
    c = make_connector("worker")
    c.connector_worker.worker.delays = {"store": 0.3}
    meta = AscendOffloadingConnectorMetadata(
        load_jobs={}, store_jobs={}, num_scheduled_tokens=300
    )
    c.bind_connector_metadata(meta)
    time.sleep(0.05)  # the forward pass
    c.get_finished(set())
    figures = c.build_connector_worker_meta().figures
    assert figures.forward_tokens == 300 and figures.forward_s >= 0.05
    # Reported once: a step with nothing new reports nothing.
    assert c.build_connector_worker_meta() is None
    c.shutdown()
