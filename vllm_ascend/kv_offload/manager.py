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
  it retry forever). Forgotten when the request finishes.

It also adds the CPU pool's capacity, occupancy and evictions to vLLM's
offloading stats (``get_stats``, ``pool_metrics.py``), for ``/metrics``.

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
    OffloadingManager,
    ReqContext,
)

from vllm_ascend.kv_offload import vllm_compat
from vllm_ascend.kv_offload.pool_metrics import PoolCapacity, add_pool_stats

# OffloadKey is hashable; the exact type moved between vLLM releases.
Keys = frozenset


class FailureAwareManager:
    """Delegates to ``inner``; see the module docstring for what it changes."""

    def __init__(self, inner: OffloadingManager, capacity: PoolCapacity | None = None):
        self.inner = inner
        self.capacity = capacity
        self._evictions = 0  # CPU blocks evicted since the last get_stats
        # store spec handed out by prepare_store -> the keys it stores; weak,
        # so specs of jobs that were never created do not accumulate.
        self._store_keys: weakref.WeakKeyDictionary[LoadStoreSpec, Keys] = (
            weakref.WeakKeyDictionary()
        )
        self._failed_store_keys: set[Keys] = set()
        self._failed_load_req_ids: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not defined here.
        return getattr(self.inner, name)

    # -- what the connector tells it ---------------------------------------

    def keys_of_store(self, store_spec: LoadStoreSpec) -> Keys | None:
        """Keys that ``store_spec`` (from ``prepare_store``) stores."""
        return self._store_keys.get(store_spec)

    def store_failed(self, keys: Keys) -> None:
        """The store job of ``keys`` failed on some worker."""
        self._failed_store_keys.add(keys)

    def load_failed(self, req_id: str) -> None:
        """A load of request ``req_id`` failed: offer it no more hits."""
        self._failed_load_req_ids.add(req_id)

    # -- the two changed answers -------------------------------------------

    def prepare_store(self, keys: Iterable[Any], req_context: ReqContext):
        output = self.inner.prepare_store(keys, req_context)
        if output is not None:
            self._evictions += len(output.evicted_keys)
        if output is not None and output.keys_to_store:
            self._store_keys[output.store_spec] = Keys(output.keys_to_store)
        return output

    def complete_store(
        self,
        keys: Collection[Any],
        req_context: ReqContext,
        success: bool = True,
    ) -> None:
        key_set = Keys(keys)
        if key_set in self._failed_store_keys:
            self._failed_store_keys.discard(key_set)
            success = False
        self.inner.complete_store(keys, req_context, success=success)

    def lookup(self, key: Any, req_context: ReqContext):
        if req_context.req_id in self._failed_load_req_ids:
            return LookupResult.MISS
        return self.inner.lookup(key, req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._failed_load_req_ids.discard(req_context.req_id)
        self.inner.on_request_finished(req_context)

    def get_stats(self) -> Any:
        """vLLM's stats, plus the pool's series (``pool_metrics.py``)."""
        stats = self.inner.get_stats()
        if stats is not None and self.capacity is not None:
            add_pool_stats(
                stats,
                self.capacity,
                vllm_compat.cpu_blocks_in_use(self.inner),
                self._evictions,
            )
            self._evictions = 0
        return stats

    def reset_cache(self, *args: Any, **kwargs: Any) -> Any:
        # Jobs issued before a reset never complete through the manager.
        self._failed_store_keys.clear()
        return self.inner.reset_cache(*args, **kwargs)


# Lets isinstance(manager, OffloadingManager) hold, as for vLLM's managers.
OffloadingManager.register(FailureAwareManager)
