"""The connector's scheduler-side additions to vLLM's ``OffloadingConnector``.

``connector.AscendOffloadingConnector`` calls these from vLLM's scheduler
hooks, around vLLM's own code:

* failed transfers (the worker side's report: ``failures.py``): the manager
  told (``FailureRouter``), and the device blocks of a sync load kept out of
  reach of other requests until it is known to have succeeded
  (``SyncLoadQuarantine``);
* a bounded wait for CPU hits (``load_wait.LoadWaitBound``,
  ``max_load_wait_ratio``): fed with the figures the workers report, the
  manager recomputes a hit that would wait longer than recomputing it.

What a failed job means there: what ``manager.FailureAwareManager`` makes
of it (``FailureRouter``). A store of a request whose synchronous load failed
copies KV computed from that load's garbage: it is failed too, as is a store
of device blocks any connector failed to load (``invalidate_blocks``).

``SyncLoadQuarantine``: a synchronous load (vLLM >= 0.33,
``sync_load_budget_bytes``) fills device blocks that vLLM's scheduler has
already put in its device prefix cache (they are hashed at allocation).
Until the load is known to have succeeded, no other request may reach them:
a request that would hit them waits (its lookup answers "not yet"), and if
the load failed, they leave the prefix cache before vLLM schedules again.
vLLM's own recovery (``Scheduler._handle_invalid_blocks`` with
``kv_load_failure_policy="recompute"``) leaves them there, for the failed
request to recompute in place; until it does (and it may be preempted
first, which frees them with their hashes) any request hitting them reads
garbage with no failure reported for it (docs/robustness.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    ReqId,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from vllm_ascend.kv_offload.config import float_setting
from vllm_ascend.kv_offload.load_wait import LoadWaitBound
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.manager import FailureAwareManager

logger = init_logger(__name__)

# max_load_wait_ratio when not set: a CPU hit waits at most as long as
# recomputing its tokens would take (docs/user_guide.md).
DEFAULT_MAX_LOAD_WAIT_RATIO = 1.0


@dataclass(frozen=True)
class _Quarantined:
    hashes: frozenset[Any]
    block_ids: tuple[int, ...]


class SyncLoadQuarantine:
    """Device blocks of synchronous loads whose outcome is not known yet.

    Fed by the connector's scheduler-side hooks in vLLM's order: ``on_lookup``
    (the request's connector lookup), ``on_alloc`` (its blocks), ``on_metadata``
    (the step's load jobs), then ``release`` once its workers reported the job.
    """

    def __init__(self, block_size: int, group_idx: int = 0):
        self.block_size = block_size
        self.group_idx = group_idx
        self._kv_cache_manager: Any = None
        # Sync hits looked up this step: request -> its local prefix tokens.
        self._looked_up: dict[ReqId, int] = {}
        # Allocated this step, job id not known yet; then per load job.
        self._by_request: dict[ReqId, _Quarantined] = {}
        self._by_job: dict[int, _Quarantined] = {}

    def bind(self, kv_cache_manager: Any) -> None:
        """vLLM's ``KVCacheManager`` (``bind_kv_cache_manager``)."""
        self._kv_cache_manager = kv_cache_manager

    def must_wait(self, request: Any) -> bool:
        """Whether ``request`` would reach a quarantined block through the
        device prefix cache. Block hashes chain, so sharing one hash means
        sharing the whole prefix up to that block."""
        if not self._by_job and not self._by_request:
            return False
        entries = [*self._by_job.values(), *self._by_request.values()]
        return any(not e.hashes.isdisjoint(request.block_hashes) for e in entries)

    def on_lookup(
        self, request: Any, num_local_tokens: int, result: tuple[int | None, bool]
    ) -> None:
        num_tokens, load_async = result
        if num_tokens and not load_async:  # a hit loaded within the step
            self._looked_up[request.request_id] = num_local_tokens
        else:
            self._looked_up.pop(request.request_id, None)

    def on_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        num_local_tokens = self._looked_up.pop(request.request_id, None)
        if num_local_tokens is None or not num_external_tokens:
            return
        first = num_local_tokens // self.block_size
        hashes = request.block_hashes
        if len(hashes) != request.num_tokens // self.block_size:
            first = 0  # hashes at another granularity: quarantine them all
        block_ids = blocks.get_block_ids()[self.group_idx]
        # Everything from the first loaded block on: the loaded blocks, and
        # those this step computes from them (also hashed at allocation).
        self._by_request[request.request_id] = _Quarantined(
            frozenset(hashes[first:]), tuple(block_ids[first:])
        )

    def on_metadata(self, meta: OffloadingConnectorMetadata) -> None:
        for job_id, entry in meta.load_jobs.items():
            quarantined = self._by_request.pop(entry.req_id, None)
            if quarantined is not None and getattr(entry, "sync", False):
                self._by_job[job_id] = quarantined
        # Allocated but loading nothing synchronously after all.
        self._by_request.clear()
        self._looked_up.clear()

    def release(self, job_id: int, failed: bool) -> None:
        quarantined = self._by_job.pop(job_id, None)
        if quarantined is None or not failed:
            return
        if self._kv_cache_manager is None:
            logger.error(
                "KV offload: sync load job %d failed and vLLM bound no KV cache "
                "manager to the connector: its device blocks stay in the prefix "
                "cache",
                job_id,
            )
            return
        # Removed from the prefix cache only: the failed request (vLLM
        # recomputes or fails it) keeps them.
        self._kv_cache_manager.evict_blocks(set(quarantined.block_ids))


class FailureRouter:
    """Turns the failed jobs the workers report into ``FailureAwareManager``
    calls; releases quarantined sync loads once every worker reported them."""

    def __init__(
        self,
        manager: FailureAwareManager,
        num_workers: int,
        quarantine: SyncLoadQuarantine | None = None,
    ):
        self.manager = manager
        self.num_workers = num_workers
        self.quarantine = quarantine
        # Per job: what a failure means (store -> its keys, load -> its
        # request) and how many workers have yet to report it.
        self._failure_target: dict[int, tuple[bool, object]] = {}
        self._reports_due: dict[int, int] = {}
        # Failed jobs already routed: each worker may report the same one.
        self._routed: set[int] = set()
        # Unresolved sync load per request, and the stores issued meanwhile.
        self._sync_load_of: dict[ReqId, int] = {}
        self._dependent_stores: dict[int, list[int]] = {}
        # Device block ids each pending store job copies (the spec's own
        # array: compared only when a load failed, not per block per step).
        self._store_blocks: dict[int, Any] = {}

    def expect(self, meta: OffloadingConnectorMetadata) -> None:
        """The jobs of the step's metadata (``build_connector_meta``)."""
        for job_id, entry in meta.load_jobs.items():
            self._failure_target[job_id] = (False, entry.req_id)
            self._reports_due[job_id] = self.num_workers
            if getattr(entry, "sync", False):
                self._sync_load_of[entry.req_id] = job_id
                self._dependent_stores[job_id] = []
        for job_id, entry in meta.store_jobs.items():
            keys = self.manager.keys_of_store(entry.dst_spec)
            self._failure_target[job_id] = (True, keys)
            self._reports_due[job_id] = self.num_workers
            self._store_blocks[job_id] = entry.src_spec.block_ids
            load_job = self._sync_load_of.get(entry.req_id)
            if load_job is not None:
                self._dependent_stores[load_job].append(job_id)
        if self.quarantine is not None:
            self.quarantine.on_metadata(meta)

    def invalidate_blocks(self, block_ids: set[int]) -> None:
        """Device blocks a load failed to fill, as vLLM's scheduler gets them
        (``KVConnectorOutput.invalid_block_ids``): in a ``MultiConnector``
        also those of a P/D connector beside us. vLLM recomputes them, but a
        store issued in the step of the failed load copies them as the load
        left them: such a store is failed, its keys then hold nothing."""
        if not block_ids:
            return
        invalid = np.fromiter(block_ids, dtype=np.int64, count=len(block_ids))
        for job_id, blocks in self._store_blocks.items():
            _, keys = self._failure_target.get(job_id, (None, None))
            if keys is not None and np.isin(blocks, invalid).any():
                self.manager.store_failed(keys)

    def route(self, meta: Any) -> None:
        """The workers' metadata of a step (``update_connector_output``),
        before vLLM completes its jobs: ``complete_store`` must already know
        that a failed store's keys hold nothing."""
        for job_id in getattr(meta, "failed_jobs", ()):
            is_store, target = self._failure_target.get(job_id, (None, None))
            if target is None or job_id in self._routed:
                continue  # stale, unknown, or reported by another worker
            self._routed.add(job_id)
            if is_store:
                self.manager.store_failed(target)
                continue
            self.manager.load_failed(target)
            for store_job in self._dependent_stores.get(job_id, ()):
                _, keys = self._failure_target.get(store_job, (None, None))
                if keys is not None:
                    self.manager.store_failed(keys)
            if self.quarantine is not None:
                self.quarantine.release(job_id, failed=True)
        if not isinstance(meta, OffloadingWorkerMetadata):
            return
        for job_id, count in meta.completed_jobs.items():
            due = self._reports_due.get(job_id)
            if due is None:
                continue
            if due - count > 0:
                self._reports_due[job_id] = due - count
                continue
            del self._reports_due[job_id]
            self._routed.discard(job_id)
            is_store, target = self._failure_target.pop(job_id, (None, None))
            self._store_blocks.pop(job_id, None)
            if job_id in self._dependent_stores:
                del self._dependent_stores[job_id]
                if self._sync_load_of.get(target) == job_id:  # type: ignore[arg-type]
                    del self._sync_load_of[target]  # type: ignore[arg-type]
            if self.quarantine is not None:
                self.quarantine.release(job_id, failed=False)


class SchedulerSide:
    """Failure routing, the sync-load quarantine and the hits' wait bound."""

    def __init__(
        self,
        manager: Any,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        quarantine_group: int | None,
        worker_bytes_per_token: float,
    ):
        """``manager``: vLLM's connector scheduler's (ours, the spec's
        ``FailureAwareManager``). ``quarantine_group``: the offloaded group
        whose sync loads are quarantined (None: failed sync loads cannot be
        reported by block, so there are none: ``connector.py``).
        ``worker_bytes_per_token``: what a load of one token copies on one
        worker."""
        if not isinstance(manager, FailureAwareManager):
            raise TypeError(
                "AscendOffloadingConnector needs NPUOffloadingSpec's manager "
                f"(FailureAwareManager), got {type(manager).__name__}"
            )
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None
        self._quarantine: SyncLoadQuarantine | None = None
        if quarantine_group is not None:
            group = kv_cache_config.kv_cache_groups[quarantine_group]
            self._quarantine = SyncLoadQuarantine(
                group.kv_cache_spec.block_size, group_idx=quarantine_group
            )
        self._failure_router = FailureRouter(
            manager, vllm_config.parallel_config.world_size, self._quarantine
        )
        extra = transfer_config.kv_connector_extra_config
        ratio = float_setting(extra, "max_load_wait_ratio")
        ratio = DEFAULT_MAX_LOAD_WAIT_RATIO if ratio is None else ratio
        self._wait_bound: LoadWaitBound | None = None
        if ratio > 0:
            self._wait_bound = LoadWaitBound(ratio, worker_bytes_per_token)
        manager.wait_bound = self._wait_bound
        policy = getattr(transfer_config, "kv_load_failure_policy", "fail")
        if policy != "recompute":
            logger.info(
                "KV offload: kv_load_failure_policy=%r: a request whose "
                "CPU->device load fails will fail; 'recompute' recomputes "
                "its blocks instead",
                policy,
            )

    def bind(self, kv_cache_manager: Any) -> None:
        """vLLM's device KV cache manager, once the scheduler has one."""
        if self._quarantine is not None:
            self._quarantine.bind(kv_cache_manager)

    def lookup(
        self,
        request: Request,
        num_computed_tokens: int,
        vllm_lookup: Callable[[Request, int], tuple[int | None, bool]],
    ) -> tuple[int | None, bool]:
        """vLLM's lookup of ``request`` in the CPU pool (``vllm_lookup``);
        "not yet" while its prefix is in device blocks a sync load is filling."""
        quarantine = self._quarantine
        if quarantine is not None and quarantine.must_wait(request):
            return None, False
        if self._wait_bound is not None:
            self._wait_bound.begin_lookup(
                request.request_id, num_computed_tokens, request.num_prompt_tokens
            )
        result = vllm_lookup(request, num_computed_tokens)
        if quarantine is not None:
            quarantine.on_lookup(request, num_computed_tokens, result)
        return result

    def on_alloc(self, request: Request, blocks: Any, num_external_tokens: int):
        """vLLM allocated ``request``'s device blocks (``blocks``)."""
        if self._quarantine is not None:
            self._quarantine.on_alloc(request, blocks, num_external_tokens)

    def on_metadata(self, meta: OffloadingConnectorMetadata) -> None:
        """The step's jobs, as vLLM's connector hands them to the workers."""
        self._failure_router.expect(meta)

    def on_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' output; before vLLM completes the jobs: complete_store
        must already know that a failed store's keys hold nothing."""
        self._failure_router.invalidate_blocks(connector_output.invalid_block_ids)
        self._failure_router.route(connector_output.kv_connector_worker_meta)
        if self._wait_bound is not None:
            self._wait_bound.observe(connector_output.kv_connector_worker_meta)
