"""How a failed transfer reaches vLLM, through its public connector hooks:
the scheduler side.

The workers report failed job ids in their metadata
(test_failure_reporting_worker.py); ``FailureRouter`` turns them into calls
of ``FailureAwareManager``, which frees a failed store's CPU blocks
(``complete_store(success=False)``) and offers a request whose load failed
no more hits. ``SyncLoadQuarantine`` keeps the device blocks of a
synchronous load out of reach until it succeeded, and evicts them from the
device prefix cache when it failed.
"""

from __future__ import annotations

from types import SimpleNamespace

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob
from vllm.v1.kv_offload.base import LookupResult, PrepareStoreOutput, ReqContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from tests.unit.kv_helpers import gpu, load, metadata, worker_report
from vllm_ascend.kv_offload.manager import FailureAwareManager
from vllm_ascend.kv_offload.scheduler_side import FailureRouter, SyncLoadQuarantine

# -- scheduler side -------------------------------------------------------------


def ctx(req_id: str) -> ReqContext:
    return ReqContext(req_id=req_id)


def manager() -> FailureAwareManager:
    return FailureAwareManager(CPUOffloadingManager(num_chunks=4))


def keys(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def test_a_failed_store_frees_its_cpu_blocks_instead_of_recording_them():
    m = manager()
    out = m.prepare_store(keys("k1", "k2"), ctx("a"))
    assert set(m.keys_of_store(out.store_spec)) == set(keys("k1", "k2"))
    m.store_failed(m.keys_of_store(out.store_spec))
    m.complete_store(list(out.keys_to_store), ctx("a"))  # what vLLM calls
    assert m.lookup(b"k1", ctx("b")) == LookupResult.MISS
    # The space is free again: four new blocks fit.
    assert m.prepare_store(keys("n1", "n2", "n3", "n4"), ctx("b")) is not None


class CountedKey:
    """A key that counts how often it is hashed."""

    hashed = 0

    def __hash__(self) -> int:
        CountedKey.hashed += 1
        return id(self)


class KeepingEverything:
    """vLLM's manager, reduced to what a store calls."""

    def prepare_store(self, keys, req_context):
        return PrepareStoreOutput(list(keys), CPULoadStoreSpec([0]), [])

    def complete_store(self, keys, req_context, success=True):
        self.completed = success


def test_stores_that_do_not_fail_cost_no_work_per_key():
    """The scheduler stores every request's new blocks every step; while no
    store failed, our manager adds nothing per key to vLLM's bookkeeping."""
    m = FailureAwareManager(KeepingEverything())
    stored = [CountedKey() for _ in range(64)]
    CountedKey.hashed = 0
    out = m.prepare_store(stored, ctx("a"))
    m.complete_store(out.keys_to_store, ctx("a"))
    assert CountedKey.hashed == 0 and m.inner.completed is True
    # A failure is still matched by its keys.
    failed = m.prepare_store(stored, ctx("b"))
    m.store_failed(m.keys_of_store(failed.store_spec))
    m.complete_store(list(failed.keys_to_store), ctx("b"))
    assert m.inner.completed is False


def test_a_request_whose_load_failed_gets_no_more_hits_until_it_finishes():
    m = manager()
    out = m.prepare_store(keys("k1"), ctx("a"))
    m.complete_store(list(out.keys_to_store), ctx("a"))
    assert m.lookup(b"k1", ctx("b")) == LookupResult.HIT  # a good store: kept
    m.load_failed("b")
    assert m.lookup(b"k1", ctx("b")) == LookupResult.MISS
    assert m.lookup(b"k1", ctx("c")) == LookupResult.HIT  # others unaffected
    m.on_request_finished(ctx("b"))
    assert m.lookup(b"k1", ctx("b")) == LookupResult.HIT


def test_the_router_turns_reported_failures_into_manager_calls():
    m = manager()
    router = FailureRouter(m, num_workers=2)
    store_out = m.prepare_store(keys("k1"), ctx("a"))
    router.expect(
        metadata(
            load_jobs={8: load("b", 3)},
            store_jobs={7: TransferJob("a", gpu(1), store_out.store_spec)},
        )
    )
    router.route(worker_report({7: 1, 8: 1}, failed={7, 8}))  # worker 0: both failed
    assert m.lookup(b"k1", ctx("b")) == LookupResult.MISS  # load failure: b
    router.route(worker_report({7: 1, 8: 1}))  # worker 1: both done
    # vLLM's own completion of job 7 now frees the keys (success=False).
    m.complete_store(list(store_out.keys_to_store), ctx("a"))
    assert m.lookup(b"k1", ctx("c")) == LookupResult.MISS


def test_a_store_issued_while_its_requests_sync_load_failed_is_not_kept():
    """Its blocks were computed from what the failed load left behind."""
    m = manager()
    router = FailureRouter(m, num_workers=1)
    store_out = m.prepare_store(keys("k1"), ctx("a"))
    store_job = TransferJob("a", gpu(4), store_out.store_spec)
    router.expect(metadata(load_jobs={1: sync_load("a", 3)}, store_jobs={2: store_job}))
    router.route(worker_report({1: 1}, failed={1}))  # the store will succeed
    router.route(worker_report({2: 1}))
    m.complete_store(list(store_out.keys_to_store), ctx("a"))
    assert m.lookup(b"k1", ctx("c")) == LookupResult.MISS


def test_a_store_of_blocks_another_connector_failed_to_load_is_not_kept():
    """Beside a P/D connector in vLLM's MultiConnector: a synchronous load of
    that connector fails, vLLM gets its device blocks in
    ``KVConnectorOutput.invalid_block_ids`` and recomputes them, but our
    store of the same step already copies them as the failed load left them
    (tests/e2e/test_pd_multi_connector.py served those bytes back as CPU
    hits, with wrong outputs)."""
    m = manager()
    router = FailureRouter(m, num_workers=1)
    bad = m.prepare_store(keys("k1"), ctx("a"))
    good = m.prepare_store(keys("k2"), ctx("b"))
    router.expect(
        metadata(
            store_jobs={
                1: TransferJob("a", gpu(3, 4), bad.store_spec),
                2: TransferJob("b", gpu(5), good.store_spec),
            }
        )
    )
    router.invalidate_blocks({4})  # the other connector's failed load
    router.route(worker_report({1: 1, 2: 1}))  # both copies "succeeded"
    m.complete_store(list(bad.keys_to_store), ctx("a"))
    m.complete_store(list(good.keys_to_store), ctx("b"))
    assert m.lookup(b"k1", ctx("c")) == LookupResult.MISS
    assert m.lookup(b"k2", ctx("c")) == LookupResult.HIT


# -- sync loads: their device blocks out of reach until they succeeded ---------

BLOCK = 16


def request(req_id: str, *hashes: str) -> SimpleNamespace:
    """A request of len(hashes) full blocks whose block hashes are ``hashes``."""
    return SimpleNamespace(
        request_id=req_id,
        block_hashes=[h.encode() for h in hashes],
        num_tokens=BLOCK * len(hashes),
    )


def blocks(*ids: int) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def sync_load(req_id: str, *block_ids: int) -> SimpleNamespace:
    """vLLM 0.33's TransferJob of a synchronous load (0.32's has no sync)."""
    return SimpleNamespace(
        req_id=req_id,
        src_spec=CPULoadStoreSpec(list(block_ids)),
        dst_spec=gpu(*block_ids),
        sync=True,
    )


def quarantined_sync_load(q: SyncLoadQuarantine, loader) -> None:
    """``loader`` hits its first block on the device and syncs-loads the two
    after it into device blocks 11 and 12 (job 1), as vLLM schedules it."""
    q.on_lookup(loader, BLOCK, (2 * BLOCK, False))
    q.on_alloc(loader, blocks(10, 11, 12), 2 * BLOCK)


def test_no_request_reaches_the_blocks_of_a_sync_load_in_flight():
    q = SyncLoadQuarantine(BLOCK)
    quarantined_sync_load(q, request("a", "d0", "d1", "d2"))
    # Same step, before the metadata is built: prefixes through d1 wait ...
    assert q.must_wait(request("b", "d0", "d1", "x2"))
    # ... a prefix that shares only the block "a" did not load does not.
    assert not q.must_wait(request("c", "d0", "y1"))
    q.on_metadata(metadata(load_jobs={1: sync_load("a", 11, 12)}))
    assert q.must_wait(request("b", "d0", "d1", "x2"))  # until it is reported
    q.release(1, failed=False)
    assert not q.must_wait(request("b", "d0", "d1", "x2"))


def test_a_failed_sync_load_leaves_the_device_prefix_cache():
    q = SyncLoadQuarantine(BLOCK)
    evicted: list[set[int]] = []
    q.bind(SimpleNamespace(evict_blocks=evicted.append))  # vLLM's KV cache manager
    quarantined_sync_load(q, request("a", "d0", "d1", "d2"))
    q.on_metadata(metadata(load_jobs={1: sync_load("a", 11, 12)}))
    q.release(1, failed=True)
    assert evicted == [{11, 12}]  # not block 10, a good device hit
    assert not q.must_wait(request("b", "d0", "d1"))


def test_an_async_hit_is_not_quarantined():
    q = SyncLoadQuarantine(BLOCK)
    loader = request("a", "d0", "d1")
    q.on_lookup(loader, 0, (2 * BLOCK, True))  # loaded before it is scheduled
    q.on_alloc(loader, blocks(3, 4), 2 * BLOCK)
    assert not q.must_wait(request("b", "d0", "d1"))
