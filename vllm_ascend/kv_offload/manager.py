"""Scheduler side: vLLM's offloading manager, told about failed transfers.

vLLM's manager (``CPUOffloadingManager``: LRU/ARC, KV events, metrics) does
all the bookkeeping; vLLM's scheduler-side connector drives it and has no
notion of a transfer that failed. ``FailureAwareManager`` wraps it and changes
exactly two answers, from what the connector tells it
(``connector.AscendOffloadingConnector.update_connector_output``):

* a store whose copy failed: vLLM's ``complete_store(keys)`` for that job
  becomes ``complete_store(keys, success=False)``, so its CPU blocks are freed
  instead of being recorded as holding KV they do not hold;
* a request whose load failed: ``lookup`` answers MISS for it from then on,
  so it recomputes instead of loading again (a fault that repeats cannot make
  it retry forever). Forgotten when the request finishes. And where a hit
  would wait longer than recomputing it (``load_wait.LoadWaitBound``, when
  the connector sets ``wait_bound``), MISS from the key where the wait
  starts.

It also adds the CPU pool's capacity, occupancy and evictions, and the
failed stores and loads, to vLLM's offloading stats (``get_stats``,
``pool_metrics.py``), for ``/metrics``, with
the tiering manager as with the plain one (its CPU tier is the pool), and
publishes a CPU ``BlockRemoved`` for every block a cache reset drops
(``reset_cache``: vLLM's managers empty the pool without an event, so a
router's index built from the events would keep them).

Everything else is delegated unchanged, whatever the vLLM release adds to the
manager interface (0.33: ``lock``, ``on_reset_flushed``, ``config_info``).
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Iterable
from typing import Any

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    ReqContext,
)

from vllm_ascend.kv_offload import vllm_compat
from vllm_ascend.kv_offload.load_wait import LoadWaitBound
from vllm_ascend.kv_offload.pool_metrics import (
    PoolCapacity,
    PoolCounts,
    add_pool_stats,
)

# OffloadKey is hashable; the exact type moved between vLLM releases. A
# failed store's keys, as a set to compare with those complete_store gets.
Keys = frozenset


class FailureAwareManager:
    """Delegates to ``inner``; see the module docstring for what it changes."""

    def __init__(self, inner: OffloadingManager, capacity: PoolCapacity | None = None):
        self.inner = inner
        self.capacity = capacity
        # Since the last get_stats: CPU blocks evicted, jobs failed.
        self._evictions = 0
        self._failed_stores = 0
        self._failed_loads = 0
        # store spec handed out by prepare_store -> the keys it stores (the
        # manager's own list, not a copy: hashed only if the store fails);
        # weak, so specs of jobs that were never created do not accumulate.
        self._store_keys: weakref.WeakKeyDictionary[LoadStoreSpec, Collection[Any]] = (
            weakref.WeakKeyDictionary()
        )
        self._failed_store_keys: set[Keys] = set()
        self._failed_load_req_ids: set[str] = set()
        # The CPU pool's manager: vLLM's tiering manager's CPU tier, or inner.
        self._cpu = getattr(inner, "primary_tier", inner)
        if self._cpu is not inner:
            self._count_promotion_evictions()
        # Keys whose CPU BlockStored was published and BlockRemoved was not.
        self._cpu_resident: set[Any] = set()
        self._pending_events: list[OffloadingEvent] = []
        # Set by the connector from max_load_wait_ratio (None: waits unbounded).
        self.wait_bound: LoadWaitBound | None = None

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not defined here.
        return getattr(self.inner, name)

    # -- what the connector tells it ---------------------------------------

    def keys_of_store(self, store_spec: LoadStoreSpec) -> Collection[Any] | None:
        """Keys that ``store_spec`` (from ``prepare_store``) stores."""
        return self._store_keys.get(store_spec)

    def store_failed(self, keys: Collection[Any]) -> None:
        """The store job of ``keys`` failed on some worker."""
        self._failed_store_keys.add(Keys(keys))

    def load_failed(self, req_id: str) -> None:
        """A load job of request ``req_id`` failed (called once per job):
        offer it no more hits."""
        self._failed_load_req_ids.add(req_id)
        self._failed_loads += 1

    # -- the two changed answers -------------------------------------------

    def prepare_store(self, keys: Iterable[Any], req_context: ReqContext):
        output = self.inner.prepare_store(keys, req_context)
        if output is not None:
            self._evictions += len(output.evicted_keys)
        if output is not None and output.keys_to_store:
            self._store_keys[output.store_spec] = output.keys_to_store
        return output

    def complete_store(
        self,
        keys: Collection[Any],
        req_context: ReqContext,
        success: bool = True,
    ) -> None:
        # Hashed only while some store failed: none per store otherwise.
        if self._failed_store_keys:
            key_set = Keys(keys)
            if key_set in self._failed_store_keys:
                self._failed_store_keys.discard(key_set)
                success = False
        if not success:
            self._failed_stores += 1
        self.inner.complete_store(keys, req_context, success=success)

    def lookup(self, key: Any, req_context: ReqContext):
        if req_context.req_id in self._failed_load_req_ids:
            return LookupResult.MISS
        result = self.inner.lookup(key, req_context)
        if self.wait_bound is None:
            return result
        # Key positions: ReqContext.get_offload_key_position, vLLM 0.31+;
        # on vLLM 0.30 (none) the tokens at stake count from the request's
        # computed tokens.
        position = getattr(req_context, "get_offload_key_position", None)
        return self.wait_bound.admit(
            result, req_context.req_id, position(key) if position else None
        )

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._failed_load_req_ids.discard(req_context.req_id)
        if self.wait_bound is not None:
            self.wait_bound.forget(req_context.req_id)
        self.inner.on_request_finished(req_context)

    def _count_promotion_evictions(self) -> None:
        # The tiering manager's promotions (secondary tier -> CPU) reserve
        # CPU blocks through the CPU tier's prepare_write, not prepare_store,
        # and evict to make room just as stores do.
        prepare_write = self._cpu.prepare_write

        def counted(keys: Collection[Any], req_context: ReqContext):
            output = prepare_write(keys, req_context)
            if output is not None:
                self._evictions += len(output.evicted_keys)
            return output

        self._cpu.prepare_write = counted

    def get_stats(self) -> Any:
        """vLLM's stats, plus the pool's series (``pool_metrics.py``)."""
        stats = self.inner.get_stats()
        if stats is not None and self.capacity is not None:
            add_pool_stats(
                stats,
                self.capacity,
                vllm_compat.cpu_blocks_in_use(self._cpu),
                PoolCounts(
                    self._evictions,
                    self._failed_stores,
                    self._failed_loads,
                    self.wait_bound.take_recomputed() if self.wait_bound else 0,
                ),
            )
            self._evictions = self._failed_stores = self._failed_loads = 0
        return stats

    # -- KV events: what a reset drops ---------------------------------------

    def _tracked(self, events: Iterable[OffloadingEvent]):
        for event in events:
            if event.medium == Medium.CPU and event.ownership is None:
                if event.removed:
                    self._cpu_resident.difference_update(event.keys)
                else:
                    self._cpu_resident.update(event.keys)
            yield event

    def take_events(self) -> Iterable[OffloadingEvent]:
        pending, self._pending_events = self._pending_events, []
        yield from pending
        yield from self._tracked(self.inner.take_events())

    def _announce_reset(self) -> None:
        """Queues a CPU removal of every block whose store was published;
        the events the manager queued before come first."""
        self._pending_events.extend(self._tracked(self.inner.take_events()))
        if self._cpu_resident:
            self._pending_events.append(
                OffloadingEvent(
                    keys=list(self._cpu_resident), medium=Medium.CPU, removed=True
                )
            )
            self._cpu_resident.clear()

    def reset_cache(self, *args: Any, **kwargs: Any) -> Any:
        # Jobs issued before a reset never complete through the manager.
        self._failed_store_keys.clear()
        self._announce_reset()
        return self.inner.reset_cache(*args, **kwargs)


# Lets isinstance(manager, OffloadingManager) hold, as for vLLM's managers.
OffloadingManager.register(FailureAwareManager)
