"""``OffloadingConnector`` for Ascend, registered by plugin.

vLLM's connector, unchanged in its transfer logic, with these additions, made
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
  sees the job finish, and this connector reports the failure through its
  worker side (``worker_side.py``) and acts on it on its scheduler side
  (``scheduler_side.py``).
* idle steps: while every request waits for its KV, vLLM steps its engine
  again as soon as a step returns, each step polling the transfers once. The
  scheduler side marks such steps (nothing scheduled) in the metadata, and the
  worker side then waits, at most ``IDLE_STEP_WAIT_S``, for a transfer to
  finish before polling: on the CPU backend the busy loop took CPU from the
  very copy it waited for (docs/e2e_benchmark.md).
* the worker's facts on ``/metrics``: each worker adds its pool's info series
  (memory kind, pieces, copy path: ``pool_metrics.py``) to the KV connector
  stats vLLM collects from workers; vLLM's worker side reports none.
* a bounded wait for CPU hits (``load_wait.py``, ``max_load_wait_ratio``):
  the workers' figures in their metadata, the manager's ``LoadWaitBound`` on
  the scheduler side.

``plugin.register`` puts this class under the name ``OffloadingConnector``,
so the guide's ``kv_connector="OffloadingConnector"`` selects it; a config
whose spec is not ours gets the class that had the name before (``__new__``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
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
from vllm.v1.kv_offload.base import CanonicalKVCaches
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from vllm_ascend.kv_offload import pool_metrics, vllm_compat
from vllm_ascend.kv_offload.kv_layout import KVCacheParts, canonicalize
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.npu import (
    NPUOffloadingSpec,
    OffloadConfigError,
    validate_connector_config,
)
from vllm_ascend.kv_offload.plugin import fallback_connector_class
from vllm_ascend.kv_offload.scheduler_side import SchedulerSide
from vllm_ascend.kv_offload.worker import NPUOffloadingWorker
from vllm_ascend.kv_offload.worker_side import WorkerSide

logger = init_logger(__name__)

# Longest a step with nothing to compute waits for a transfer to finish. It
# returns as soon as one does, so this only bounds how late the engine sees a
# request that arrives meanwhile.
IDLE_STEP_WAIT_S = 0.02


@dataclass
class AscendOffloadingConnectorMetadata(OffloadingConnectorMetadata):
    """vLLM's scheduler -> worker metadata, plus whether the step computes
    nothing (the worker may then wait for transfers instead of returning) and
    how many tokens it computes (the worker times it: ``load_wait.py``)."""

    idle_step: bool = False
    num_scheduled_tokens: int = 0


def our_spec_class(extra_config: Mapping[str, Any]) -> type[NPUOffloadingSpec] | None:
    """The spec class an offloading config names if it is ours or derives
    from it (subclasses count), else None: the one check of which connector
    serves a config."""
    try:
        # Public in vLLM 0.30-0.33.
        spec_cls = OffloadingSpecFactory.get_spec_cls(extra_config)
    except (ImportError, AttributeError, ValueError, AssertionError):
        return None  # vLLM reports an unusable spec itself, with its message
    if isinstance(spec_cls, type) and issubclass(spec_cls, NPUOffloadingSpec):
        return spec_cls
    return None


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


def _canonical_kv_caches(
    kv_caches: dict[str, KVCacheParts], config: KVCacheConfig
) -> CanonicalKVCaches:
    """vllm-ascend's tuple layouts as one block view per part, checked
    against vLLM's page sizes (``kv_layout.canonicalize``)."""
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
    return canonical


def _check_config(
    vllm_config: VllmConfig, num_groups: int, device_block_sizes: list[int]
) -> None:
    """The connector's settings, before vLLM derives anything from them."""
    transfer_config = vllm_config.kv_transfer_config
    assert transfer_config is not None
    extra = transfer_config.kv_connector_extra_config
    # __new__ sent other specs elsewhere (a subclass of ours gets ours).
    spec_cls = our_spec_class(extra) or NPUOffloadingSpec
    validate_connector_config(
        transfer_config.kv_role, extra, device_block_sizes, spec_cls.extra_config_keys
    )
    if num_groups > 1 and extra.get("sync_load_budget_bytes"):
        raise OffloadConfigError(
            "kv_connector_extra_config['sync_load_budget_bytes']="
            f"{extra['sync_load_budget_bytes']!r} cannot be used with a model "
            f"whose KV cache has {num_groups} offloaded groups: a failed "
            "synchronous load could not be reported to vLLM there; remove "
            "sync_load_budget_bytes (loads then run asynchronously)"
        )


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
            if our_spec_class(extra) is None:
                other = fallback_connector_class() or OffloadingConnector
                return other(vllm_config, role, kv_cache_config)
        return super().__new__(cls)

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        groups = get_offloading_group_ids(kv_cache_config)
        # Tokens per device block of each offloaded group, as vLLM derives them.
        dcp = vllm_config.parallel_config.decode_context_parallel_size
        sizes = [
            resolve_dcp_kv_block_size(
                kv_cache_config.kv_cache_groups[g].kv_cache_spec, dcp
            )
            for g in groups
        ]
        _check_config(vllm_config, len(groups), sizes)
        report_block_ids = len(groups) <= 1
        # The tiering spec's storage identity reads the resolved model config
        # (vLLM hands the spec only its OffloadingConfig).
        with set_current_vllm_config(vllm_config):
            super().__init__(vllm_config, role, kv_cache_config)
        # Used on workers only (plain bookkeeping, harmless elsewhere).
        self._worker_side = WorkerSide(report_block_ids)
        self._idle_step = False  # the bound metadata's (get_finished)
        self._scheduler: SchedulerSide  # on the scheduler's connector only
        if self.connector_scheduler is not None:
            # One worker's offloaded KV bytes per token (what a load copies).
            page_bytes = _spec_page_bytes(kv_cache_config, groups).values()
            per_token = sum(p for _, p in page_bytes) / sizes[0] if sizes else 0.0
            self._scheduler = SchedulerSide(
                self.connector_scheduler.manager,
                vllm_config,
                kv_cache_config,
                groups[0] if report_block_ids and groups else None,
                per_token,
            )

    # -- worker side -------------------------------------------------------

    @property
    def _offloading_worker(self) -> NPUOffloadingWorker:
        worker = self.connector_worker.worker if self.connector_worker else None
        assert worker is not None, "KV caches are not registered yet"
        return worker

    def register_kv_caches(self, kv_caches: dict[str, KVCacheParts]) -> None:
        if all(isinstance(c, torch.Tensor) for c in kv_caches.values()):
            super().register_kv_caches(kv_caches)
        else:
            connector_worker = self.connector_worker
            assert connector_worker is not None
            config = connector_worker.kv_cache_config
            canonical = _canonical_kv_caches(kv_caches, config)
            vllm_compat.init_offloading_worker(connector_worker, canonical)
        self._offloading_worker.divert_failures()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, OffloadingConnectorMetadata)
        self._worker_side.on_metadata(connector_metadata)
        self._idle_step = getattr(connector_metadata, "idle_step", False)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self._worker_side.forward_done()
        if self._idle_step:
            self._offloading_worker.wait_for_progress(IDLE_STEP_WAIT_S)
        finished = super().get_finished(finished_req_ids)
        self._worker_side.record_failures(self._offloading_worker.take_failed_jobs())
        return finished

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        self._worker_side.add_failed_recving(results)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Called after get_transfer_results in the same step, so a failed
        # load's blocks arrive with its request's finished_recving.
        return self._worker_side.take_load_error_block_ids()

    def get_kv_connector_stats(self):
        stats = super().get_kv_connector_stats()
        if self.connector_worker is None or self.connector_worker.worker is None:
            return stats
        # Every step, not once: it is one gauge, and then no single step's
        # output has to reach the front end for the series to appear.
        info = self.build_kv_connector_stats()
        pool_metrics.add_pool_info(info, self._offloading_worker.pool_info())
        return info if stats is None else stats.aggregate(info)

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        meta = super().build_connector_worker_meta()
        worker = self.connector_worker.worker if self.connector_worker else None
        if worker is None:  # no KV caches registered yet: nothing to report
            return meta
        return self._worker_side.worker_metadata(meta, worker.queued_bytes())

    # -- scheduler side ----------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.bind(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        lookup = super().get_num_new_matched_tokens
        return self._scheduler.lookup(request, num_computed_tokens, lookup)

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens):
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        self._scheduler.on_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> AscendOffloadingConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        self._scheduler.on_metadata(meta)
        # Every field of vLLM's metadata, whatever its version has.
        values = {f.name: getattr(meta, f.name) for f in fields(meta)}
        tokens = scheduler_output.total_num_scheduled_tokens
        return AscendOffloadingConnectorMetadata(
            **values, idle_step=tokens == 0, num_scheduled_tokens=tokens
        )

    def update_connector_output(self, connector_output: KVConnectorOutput):
        # Before vLLM completes the jobs (see SchedulerSide.on_output).
        self._scheduler.on_output(connector_output)
        super().update_connector_output(connector_output)
