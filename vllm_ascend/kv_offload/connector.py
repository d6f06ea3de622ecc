"""``OffloadingConnector`` for Ascend, registered by plugin.

vLLM's connector, with four changes:

* layouts: vLLM turns each layer's cache into one block view and fails on
  vllm-ascend's tuples (``(k, v)``, MLA's ``(nope, rope)``, Mamba state
  lists). This variant hands such layouts to ``kv_layout.canonicalize`` and
  leaves single-tensor layouts to vLLM.
* configuration: ``kv_role`` and ``block_size`` are checked before vLLM
  derives the chunk size from them (``npu.validate_connector_config``), so a
  bad value fails at start-up with the key and the fix.
* failed transfers: vLLM 0.32's connector worker asserts that every transfer
  succeeded, so one failed copy would bring the engine down. Here:

  - a failed load reports its device blocks through
    ``get_block_ids_with_load_errors`` in the same step as its request
    finishes receiving (the contract of ``KVConnectorBase_V1``); vLLM then
    recomputes them (``kv_load_failure_policy="recompute"``) or fails only
    that request (``"fail"``, vLLM's default). With several KV cache groups,
    whose block ids vLLM cannot map back to requests, the request is
    reported in ``KVConnectorTransferResults.failed_recving`` instead.
  - a request whose load failed is not offered CPU hits again: it
    recomputes, so a fault that repeats cannot make it retry forever.
  - a failed store is reported to the scheduler in
    ``AscendOffloadingWorkerMetadata.failed_jobs`` (vLLM's metadata only says
    "completed"), and the scheduler side drops its CPU blocks with
    ``complete_store(success=False)`` instead of recording them as stored.

* idle steps: while every request waits for its KV, vLLM steps its engine
  again as soon as a step returns, each step polling the transfers once. The
  scheduler side marks such steps (nothing scheduled) in the metadata, and the
  worker side then waits, at most ``IDLE_STEP_WAIT_S``, for a transfer to
  finish before polling: on the CPU backend the busy loop took CPU from the
  very copy it waited for (docs/e2e_benchmark.md).

The ``vllm.general_plugins`` entry point (``plugin.register``) puts this class
under the name ``OffloadingConnector``, so the guide's
``kv_connector="OffloadingConnector"`` selects it with no extra setting. A
config whose spec is not ours gets the class that had the name before
(vLLM's, or upstream vllm-ascend's): see ``__new__`` and ``plugin.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    ReqId,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    get_offloading_group_ids,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import GPULoadStoreSpec, TransferResult
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from vllm_ascend.kv_offload.kv_layout import KVCacheParts, canonicalize
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.npu import validate_connector_config
from vllm_ascend.kv_offload.plugin import fallback_connector_class, names_our_spec

logger = init_logger(__name__)

# Longest a step with nothing to compute waits for a transfer to finish. It
# returns as soon as one does, so this only bounds how late the engine sees a
# request that arrives meanwhile.
IDLE_STEP_WAIT_S = 0.02


@dataclass
class AscendOffloadingConnectorMetadata(OffloadingConnectorMetadata):
    """vLLM's scheduler -> worker metadata, plus whether the step computes
    nothing (the worker may then wait for transfers instead of returning)."""

    idle_step: bool = False


@dataclass
class AscendOffloadingWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker -> scheduler metadata, plus the jobs that failed.

    A failed job is also in ``completed_jobs``, so vLLM's bookkeeping (one
    count per worker) is unchanged; ``failed_jobs`` only tells the scheduler
    side not to record a failed store's blocks as stored.
    """

    failed_jobs: set[int] = field(default_factory=set)

    def mark_failed(self, job_id: int) -> None:
        self.failed_jobs.add(job_id)
        self.mark_completed(job_id)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        return AscendOffloadingWorkerMetadata(
            completed_jobs=merged.completed_jobs,
            transfer_stats=merged.transfer_stats,
            failed_jobs=self.failed_jobs | getattr(other, "failed_jobs", set()),
        )


class AscendOffloadingConnectorWorker(OffloadingConnectorWorker):
    """vLLM's connector worker, reporting failed transfers instead of asserting.

    A job fails either when the offloading worker refuses it (``submit_*``
    returns False) or when it finishes with ``success=False``; both end in
    ``_finish_failed`` during ``get_finished``.
    """

    def __init__(self, spec, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
        super().__init__(spec, vllm_config, kv_cache_config)
        self._connector_worker_meta = AscendOffloadingWorkerMetadata()
        # job_id -> device blocks of an in-flight load, to report if it fails.
        self._load_dst_specs: dict[int, GPULoadStoreSpec] = {}
        # Jobs the offloading worker refused; they finish (failed) next poll.
        self._refused_jobs: list[int] = []
        self._load_error_block_ids: set[int] = set()
        self._failed_recving: set[ReqId] = set()
        # vLLM maps failed block ids back to requests only with one KV cache
        # group (Scheduler._handle_invalid_blocks); else report per request.
        self._report_block_ids = len(kv_cache_config.kv_cache_groups) == 1

    def _submit_deferred_stores(self) -> None:
        assert self.worker is not None
        for job_id, src_spec, dst_spec in self._unsubmitted_store_jobs:
            assert isinstance(src_spec, GPULoadStoreSpec)
            if not self.worker.submit_store(job_id, src_spec, dst_spec):
                self._refused_jobs.append(job_id)
        self._unsubmitted_store_jobs.clear()

    def handle_preemptions(self, kv_connector_metadata: OffloadingConnectorMetadata):
        # vLLM's, with refused stores reported instead of asserted.
        assert self.worker is not None
        jobs_to_flush = kv_connector_metadata.jobs_to_flush
        # Stores of this step that must land before their blocks are reused
        # go out now, ahead of the rest of the step's stores.
        for job_id in jobs_to_flush or ():
            entry = kv_connector_metadata.store_jobs.pop(job_id, None)
            if entry is None:
                continue
            if not self._is_store_writer:
                self._connector_worker_meta.mark_completed(job_id)
                continue
            assert isinstance(entry.src_spec, GPULoadStoreSpec)
            self._unsubmitted_store_jobs.append(
                (job_id, entry.src_spec, entry.dst_spec)
            )
        self._submit_deferred_stores()
        if jobs_to_flush:
            self.worker.wait(jobs_to_flush)

    def start_kv_transfers(self, metadata: OffloadingConnectorMetadata):
        # vLLM's, with refused jobs reported instead of asserted.
        assert self.worker is not None
        self._submit_deferred_stores()
        for job_id, entry in metadata.load_jobs.items():
            assert isinstance(entry.dst_spec, GPULoadStoreSpec)
            self._load_jobs[job_id] = entry.req_id
            self._load_dst_specs[job_id] = entry.dst_spec
            if not self.worker.submit_load(job_id, entry.src_spec, entry.dst_spec):
                self._refused_jobs.append(job_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Like vLLM's: loads report ``finished_recving``, stores only
        ``completed_jobs``; failed jobs are finished too, and flagged."""
        assert self.worker is not None
        refused = [TransferResult(j, success=False) for j in self._refused_jobs]
        self._refused_jobs.clear()
        results = self.worker.get_finished() + refused

        meta = self._connector_worker_meta
        finished_recving: set[str] = set()
        for result in results:
            job_id = result.job_id
            req_id = self._load_jobs.pop(job_id, None)
            dst_spec = self._load_dst_specs.pop(job_id, None)
            if not result.success:
                self._finish_failed(job_id, req_id, dst_spec)
                meta.mark_failed(job_id)
                # Failed jobs moved no useful bytes: no transfer stats.
            elif result.transfer_time is not None and result.transfer_size:
                stats = meta.transfer_stats
                direction = stats.load if req_id is not None else stats.store
                direction.record(result.transfer_size, result.transfer_time)
                meta.mark_completed(job_id)
            else:
                meta.mark_completed(job_id)
            if req_id is not None:
                # Failed or not, the request stops waiting for this load.
                finished_recving.add(req_id)
        return set(), finished_recving

    def _finish_failed(
        self, job_id: int, req_id: ReqId | None, dst_spec: GPULoadStoreSpec | None
    ) -> None:
        if req_id is None:
            logger.warning(
                "KV offload: store job %d failed; its blocks are not kept in the "
                "CPU cache",
                job_id,
            )
            return
        assert dst_spec is not None
        # The job may have written some of its blocks, or garbage: all of
        # them must be recomputed before anything reads them.
        block_ids = np.asarray(dst_spec.block_ids, dtype=np.int64).tolist()
        if self._report_block_ids:
            self._load_error_block_ids.update(block_ids)
        else:
            self._failed_recving.add(req_id)
        logger.warning(
            "KV offload: load job %d of request %s failed; its %d device blocks "
            "are reported as not loaded (kv_load_failure_policy decides: "
            "recompute them, or fail the request)",
            job_id,
            req_id,
            len(block_ids),
        )

    def take_load_error_block_ids(self) -> set[int]:
        block_ids, self._load_error_block_ids = self._load_error_block_ids, set()
        return block_ids

    def take_failed_recving(self) -> set[ReqId]:
        req_ids, self._failed_recving = self._failed_recving, set()
        return req_ids

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        if not self._connector_worker_meta.completed_jobs:
            return None
        meta = self._connector_worker_meta
        self._connector_worker_meta = AscendOffloadingWorkerMetadata()
        return meta

    def shutdown(self) -> None:
        super().shutdown()
        self._connector_worker_meta = AscendOffloadingWorkerMetadata()
        self._load_dst_specs.clear()
        self._refused_jobs.clear()


def _device_block_sizes(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> list[int]:
    """Tokens per device block of each offloaded group, as vLLM derives them."""
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    return [
        resolve_dcp_kv_block_size(kv_cache_config.kv_cache_groups[g].kv_cache_spec, dcp)
        for g in get_offloading_group_ids(kv_cache_config)
    ]


class AscendOffloadingConnector(OffloadingConnector):
    """vLLM's offloading connector, plus tuple layouts and failure handling."""

    def __new__(
        cls,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        # Registered under vLLM's name, this class also receives configs for
        # other specs (vLLM's CPUOffloadingSpec, upstream vllm-ascend's): those
        # get the connector that served the name before us, untouched. The
        # class methods vLLM calls on the connector class are vLLM's
        # OffloadingConnector's for every one of them.
        transfer_config = vllm_config.kv_transfer_config
        if cls is AscendOffloadingConnector and transfer_config is not None:
            extra = transfer_config.kv_connector_extra_config
            if not names_our_spec(extra):
                other = fallback_connector_class() or OffloadingConnector
                return other(vllm_config, role, kv_cache_config)
        return super().__new__(cls)

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None
        validate_connector_config(
            transfer_config.kv_role,
            transfer_config.kv_connector_extra_config,
            _device_block_sizes(vllm_config, kv_cache_config),
        )
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_worker is not None:
            # Nothing is allocated before register_kv_caches, so replacing
            # vLLM's connector worker with ours costs nothing.
            self.connector_worker = AscendOffloadingConnectorWorker(
                self.connector_worker.spec, vllm_config, kv_cache_config
            )
        # Scheduler side: failed store jobs whose completion is still to come
        # from some worker, and requests that had a load fail.
        self._failed_store_jobs: set[int] = set()
        self._load_failed_req_ids: set[str] = set()
        policy = getattr(transfer_config, "kv_load_failure_policy", "fail")
        if role == KVConnectorRole.SCHEDULER and policy != "recompute":
            logger.info(
                "KV offload: kv_load_failure_policy=%r: a request whose CPU->device "
                "load fails will fail; 'recompute' recomputes its blocks instead",
                policy,
            )

    # -- worker side -------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, KVCacheParts]) -> None:
        worker = self.connector_worker
        assert worker is not None
        if all(isinstance(c, torch.Tensor) for c in kv_caches.values()):
            worker.register_kv_caches(kv_caches)
            return
        config = worker.kv_cache_config
        groups = [
            config.kv_cache_groups[g].layer_names
            for g in get_offloading_group_ids(config)
        ]
        canonical = canonicalize(kv_caches, groups, config.num_blocks)
        logger.info(
            "KV offload: %d layers in %d groups as %d per-part block views",
            sum(len(g) for g in groups),
            len(groups),
            len(canonical.tensors),
        )
        worker._init_worker(canonical)

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        worker = self.connector_worker
        assert isinstance(worker, AscendOffloadingConnectorWorker)
        results.failed_recving |= worker.take_failed_recving()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Called after get_transfer_results in the same step, so a failed
        # load's blocks arrive with its request's finished_recving.
        worker = self.connector_worker
        assert isinstance(worker, AscendOffloadingConnectorWorker)
        return worker.take_load_error_block_ids()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        meta = self._connector_metadata
        wait = getattr(self.connector_worker.worker, "wait_for_progress", None)
        if getattr(meta, "idle_step", False) and wait is not None:
            wait(IDLE_STEP_WAIT_S)
        return super().get_finished(finished_req_ids)

    # -- scheduler side ----------------------------------------------------

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> AscendOffloadingConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        # Every field of vLLM's metadata, whatever its version has.
        values = {f.name: getattr(meta, f.name) for f in fields(meta)}
        return AscendOffloadingConnectorMetadata(
            **values, idle_step=scheduler_output.total_num_scheduled_tokens == 0
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        hits, load_async = super().get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        if not hits or request.request_id not in self._load_failed_req_ids:
            return hits, load_async
        # This request's load failed before: recompute instead of loading
        # again. The lookup above still ran for its bookkeeping; undo the
        # part that assumed a load.
        req_status = self.scheduler._req_status[request.request_id]
        req_status.update_num_hit_chunks(num_computed_tokens)
        req_status.partial_tail_boundary = None
        return 0, False

    def update_connector_output(self, connector_output: KVConnectorOutput):
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, AscendOffloadingWorkerMetadata) and meta.failed_jobs:
            for job_id in meta.failed_jobs:
                job = self.scheduler._jobs.get(job_id)
                if job is None:
                    continue  # stale: issued before a cache reset
                if job.is_store:
                    self._failed_store_jobs.add(job_id)
                    continue
                # Under "fail" the request is already finished by now.
                req_status = self.scheduler._req_status.get(job.req_id)
                if req_status is not None and not req_status.req.is_finished():
                    self._load_failed_req_ids.add(job.req_id)
        if self._failed_store_jobs and meta is not None:
            self._drop_failed_stores(meta)
        super().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]):
        self._load_failed_req_ids.discard(request.request_id)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ):
        self._load_failed_req_ids.discard(request.request_id)
        return super().request_finished_all_groups(request, block_ids)

    def _drop_failed_stores(self, meta: OffloadingWorkerMetadata) -> None:
        """Un-records the CPU blocks of failed stores that complete now.

        vLLM then calls ``complete_store`` (success) on the same keys, which
        skips keys that are no longer pending: the blocks stay unrecorded and
        their CPU space is free for the next store.
        """
        scheduler = self.scheduler
        for job_id, count in meta.completed_jobs.items():
            if job_id not in self._failed_store_jobs:
                continue
            job = scheduler._jobs.get(job_id)
            if job is None or job.pending_count > count:
                # Stale (cache reset), or other workers are still copying:
                # the blocks must stay reserved until the last one is done.
                if job is None:
                    self._failed_store_jobs.discard(job_id)
                continue
            self._failed_store_jobs.discard(job_id)
            req_context = scheduler._req_status[job.req_id].req_context
            scheduler.manager.complete_store(job.keys, req_context, success=False)
