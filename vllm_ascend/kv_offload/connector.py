"""``OffloadingConnector`` for Ascend, registered by plugin.

vLLM's connector, unchanged in its transfer logic, with four additions made
through its public hooks only (no vLLM method is copied here):

* layouts: vLLM turns each layer's cache into one block view and fails on
  vllm-ascend's tuples (``(k, v)``, MLA's ``(nope, rope)``, Mamba state
  lists). This variant hands such layouts to ``kv_layout.canonicalize`` and
  leaves single-tensor layouts to vLLM.
* configuration: ``kv_role`` and ``block_size`` are checked before vLLM
  derives the chunk size from them (``npu.validate_connector_config``), so a
  bad value fails at start-up with the key and the fix.
* failed transfers: vLLM's connector asserts that every transfer succeeded.
  Our offloading worker diverts failures (``worker.divert_failures``): vLLM
  sees the job finish, and this connector reports the failure:

  - a failed load, async or (vLLM >= 0.33) sync, reports its device blocks
    through ``get_block_ids_with_load_errors`` in the same step as vLLM sees
    the job finish (the contract of ``KVConnectorBase_V1``); vLLM then
    recomputes them (``kv_load_failure_policy="recompute"``) or fails only
    that request (``"fail"``, vLLM's default). With several KV cache groups,
    whose block ids vLLM cannot map back to requests, an async load's
    request is reported in ``failed_recving`` instead (sync loads are refused
    at start-up there: nothing could report them).
  - the scheduler side tells the manager (``manager.FailureAwareManager``):
    a request whose load failed gets no CPU hits again (it recomputes, so a
    fault that repeats cannot make it retry forever); a failed store's CPU
    blocks are freed by ``complete_store(success=False)`` instead of being
    recorded as stored. Failed job ids travel in
    ``AscendOffloadingWorkerMetadata.failed_jobs``.

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

from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
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
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig, MambaSpec
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.outputs import KVConnectorOutput

from vllm_ascend.kv_offload import vllm_compat
from vllm_ascend.kv_offload.kv_layout import KVCacheParts, canonicalize
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.manager import FailureAwareManager
from vllm_ascend.kv_offload.npu import OffloadConfigError, validate_connector_config
from vllm_ascend.kv_offload.plugin import fallback_connector_class, names_our_spec
from vllm_ascend.kv_offload.worker import NPUOffloadingWorker

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

    A failed job is also in ``completed_jobs`` (vLLM saw it finish), so vLLM's
    bookkeeping (one count per worker) is unchanged; ``failed_jobs`` tells
    the scheduler side what the job did not do.
    """

    failed_jobs: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        return AscendOffloadingWorkerMetadata(
            completed_jobs=merged.completed_jobs,
            transfer_stats=merged.transfer_stats,
            failed_jobs=self.failed_jobs | getattr(other, "failed_jobs", set()),
        )


@dataclass(frozen=True)
class _LoadJob:
    """What the worker side must know to report a failed load."""

    req_id: ReqId
    block_ids: tuple[int, ...]
    sync: bool


def _device_block_sizes(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> list[int]:
    """Tokens per device block of each offloaded group, as vLLM derives them."""
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    return [
        resolve_dcp_kv_block_size(kv_cache_config.kv_cache_groups[g].kv_cache_spec, dcp)
        for g in get_offloading_group_ids(kv_cache_config)
    ]


def _spec_page_bytes(
    kv_cache_config: KVCacheConfig, group_ids: Iterable[int]
) -> dict[str, tuple[int, int]]:
    """Per layer: (unpadded, padded) page bytes of vLLM's KV cache spec."""
    out: dict[str, tuple[int, int]] = {}
    for g in group_ids:
        group = kv_cache_config.kv_cache_groups[g]
        per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", {})
        for layer in group.layer_names:
            spec = per_layer.get(layer, group.kv_cache_spec)
            if isinstance(spec, AttentionSpec):
                unpadded = spec.unpadded_page_size_bytes
            elif isinstance(spec, MambaSpec):
                unpadded = replace(spec, page_size_padded=None).page_size_bytes
            else:
                continue  # no page size to check against
            out[layer] = (unpadded, spec.page_size_bytes)
    return out


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
        extra = transfer_config.kv_connector_extra_config
        validate_connector_config(
            transfer_config.kv_role,
            extra,
            _device_block_sizes(vllm_config, kv_cache_config),
        )
        groups = get_offloading_group_ids(kv_cache_config)
        # vLLM maps failed block ids back to requests only with one KV cache
        # group (Scheduler._handle_invalid_blocks); else report per request.
        self._report_block_ids = len(groups) <= 1
        if not self._report_block_ids and extra.get("sync_load_budget_bytes"):
            raise OffloadConfigError(
                "kv_connector_extra_config['sync_load_budget_bytes']="
                f"{extra['sync_load_budget_bytes']!r} cannot be used with a model "
                f"whose KV cache has {len(groups)} offloaded groups: a failed "
                "synchronous load could not be reported to vLLM there; remove "
                "sync_load_budget_bytes (loads then run asynchronously)"
            )
        super().__init__(vllm_config, role, kv_cache_config)
        self._num_workers = vllm_config.parallel_config.world_size
        # Worker side: load jobs of the bound metadata and earlier steps, and
        # what the current step has to report.
        self._load_jobs: dict[int, _LoadJob] = {}
        self._load_error_block_ids: set[int] = set()
        self._failed_recving: set[ReqId] = set()
        self._failed_jobs: set[int] = set()
        # Scheduler side: per job, what a failure means (store -> its keys,
        # load -> its request) and how many workers have yet to report it.
        self._job_failure_target: dict[int, tuple[bool, object]] = {}
        self._job_reports_due: dict[int, int] = {}
        if self.connector_scheduler is not None:
            manager = self.connector_scheduler.manager
            if not isinstance(manager, FailureAwareManager):
                raise TypeError(
                    "AscendOffloadingConnector needs NPUOffloadingSpec's manager "
                    f"(FailureAwareManager), got {type(manager).__name__}"
                )
            self._manager = manager
            policy = getattr(transfer_config, "kv_load_failure_policy", "fail")
            if policy != "recompute":
                logger.info(
                    "KV offload: kv_load_failure_policy=%r: a request whose "
                    "CPU->device load fails will fail; 'recompute' recomputes "
                    "its blocks instead",
                    policy,
                )

    # -- worker side -------------------------------------------------------

    @property
    def _offloading_worker(self) -> NPUOffloadingWorker:
        worker = self.connector_worker.worker if self.connector_worker else None
        assert worker is not None, "KV caches are not registered yet"
        return worker

    def register_kv_caches(self, kv_caches: dict[str, KVCacheParts]) -> None:
        connector_worker = self.connector_worker
        assert connector_worker is not None
        if all(isinstance(c, torch.Tensor) for c in kv_caches.values()):
            connector_worker.register_kv_caches(kv_caches)
        else:
            config = connector_worker.kv_cache_config
            group_ids = get_offloading_group_ids(config)
            groups = [config.kv_cache_groups[g].layer_names for g in group_ids]
            canonical = canonicalize(
                kv_caches,
                groups,
                config.num_blocks,
                page_bytes=_spec_page_bytes(config, group_ids),
            )
            logger.info(
                "KV offload: %d layers in %d groups as %d per-part block views",
                sum(len(g) for g in groups),
                len(groups),
                len(canonical.tensors),
            )
            vllm_compat.init_offloading_worker(connector_worker, canonical)
        self._offloading_worker.divert_failures()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, OffloadingConnectorMetadata)
        for job_id, entry in connector_metadata.load_jobs.items():
            assert isinstance(entry.dst_spec, GPULoadStoreSpec)
            self._load_jobs[job_id] = _LoadJob(
                req_id=entry.req_id,
                block_ids=tuple(
                    np.asarray(entry.dst_spec.block_ids, dtype=np.int64).tolist()
                ),
                sync=bool(getattr(entry, "sync", False)),
            )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        meta = vllm_compat.bound_metadata(self)
        if getattr(meta, "idle_step", False):
            self._offloading_worker.wait_for_progress(IDLE_STEP_WAIT_S)
        finished = super().get_finished(finished_req_ids)
        for job_id in self._offloading_worker.take_failed_jobs():
            self._failed_jobs.add(job_id)
            load = self._load_jobs.pop(job_id, None)
            if load is None:
                logger.warning(
                    "KV offload: store job %d failed; its blocks are not kept in "
                    "the CPU cache",
                    job_id,
                )
                continue
            # The job may have written some of its blocks, or garbage: all of
            # them must be recomputed before anything uses them.
            if self._report_block_ids:
                self._load_error_block_ids.update(load.block_ids)
            else:
                self._failed_recving.add(load.req_id)
            logger.warning(
                "KV offload: %s load job %d of request %s failed; its %d device "
                "blocks are reported as not loaded (kv_load_failure_policy "
                "decides: recompute them, or fail the request)",
                "sync" if load.sync else "async",
                job_id,
                load.req_id,
                len(load.block_ids),
            )
        return finished

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        results.failed_recving |= self._failed_recving
        self._failed_recving = set()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Called after get_transfer_results in the same step, so a failed
        # load's blocks arrive with its request's finished_recving.
        block_ids, self._load_error_block_ids = self._load_error_block_ids, set()
        return block_ids

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        meta = super().build_connector_worker_meta()
        if meta is None:
            return None
        for job_id in meta.completed_jobs:
            self._load_jobs.pop(job_id, None)
        failed = self._failed_jobs & set(meta.completed_jobs)
        self._failed_jobs -= failed
        return AscendOffloadingWorkerMetadata(
            completed_jobs=meta.completed_jobs,
            transfer_stats=meta.transfer_stats,
            failed_jobs=failed,
        )

    # -- scheduler side ----------------------------------------------------

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> AscendOffloadingConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        for job_id, entry in meta.store_jobs.items():
            keys = self._manager.keys_of_store(entry.dst_spec)
            self._expect_reports(job_id, (True, keys))
        for job_id, entry in meta.load_jobs.items():
            self._expect_reports(job_id, (False, entry.req_id))
        # Every field of vLLM's metadata, whatever its version has.
        values = {f.name: getattr(meta, f.name) for f in fields(meta)}
        return AscendOffloadingConnectorMetadata(
            **values, idle_step=scheduler_output.total_num_scheduled_tokens == 0
        )

    def _expect_reports(self, job_id: int, target: tuple[bool, object]) -> None:
        self._job_failure_target[job_id] = target
        self._job_reports_due[job_id] = self._num_workers

    def update_connector_output(self, connector_output: KVConnectorOutput):
        meta = connector_output.kv_connector_worker_meta
        failed = getattr(meta, "failed_jobs", ())
        # Before vLLM completes the jobs below: complete_store must already
        # know that a failed store's keys hold nothing.
        for job_id in failed:
            is_store, target = self._job_failure_target.get(job_id, (None, None))
            if target is None:
                continue  # stale (issued before a cache reset) or unknown
            if is_store:
                self._manager.store_failed(target)
            else:
                self._manager.load_failed(target)
        if isinstance(meta, OffloadingWorkerMetadata):
            for job_id, count in meta.completed_jobs.items():
                due = self._job_reports_due.get(job_id)
                if due is None:
                    continue
                if due - count > 0:
                    self._job_reports_due[job_id] = due - count
                else:
                    del self._job_reports_due[job_id]
                    self._job_failure_target.pop(job_id, None)
        super().update_connector_output(connector_output)
