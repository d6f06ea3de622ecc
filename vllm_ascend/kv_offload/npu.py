"""``NPUOffloadingSpec``: KV-cache CPU offloading for Ascend NPUs.

Loaded by vLLM's ``OffloadingConnector`` through::

    "spec_name": "NPUOffloadingSpec",
    "spec_module_path": "vllm_ascend.kv_offload.npu",

The scheduler side is vLLM's own: ``CPUOffloadingSpec`` sizes the pool and
builds ``CPUOffloadingManager`` with its LRU/ARC policies, KV events and
metrics. This spec changes two things:

* configuration: it accepts the Ascend guide's ``num_cpu_blocks`` (a count of
  CPU blocks of ``block_size`` tokens) besides vLLM's ``cpu_bytes_to_use``,
  and refuses values it cannot use at start-up, with one error that names the
  setting, the value and the fix (``config.py`` says where each is checked);
* the worker: upstream's refuses every platform but CUDA and XPU, ours runs
  on ``npu``, ``cuda`` and ``cpu`` (see ``worker.py``), each worker on a
  private pool; where vLLM says the KV layout is replicated (MLA under
  tensor parallelism: every rank holds the same latent), the workers of the
  host share one copy instead, as vLLM's CPU spec does on CUDA
  (``region_worker.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from vllm_ascend.kv_offload import host_guard, host_ledger, pool_metrics, vllm_compat
from vllm_ascend.kv_offload.config import (
    PREFIX,
    SPEC_KEYS,
    OffloadConfigError,
    check_keys,
    cpu_block_bytes,
    int_setting,
    resolve_extra_config,
    shown,
    validate_connector_config,
)
from vllm_ascend.kv_offload.cpu_pool import CpuBlockPool, private_pool
from vllm_ascend.kv_offload.host_guard import PoolRequest
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.manager import FailureAwareManager
from vllm_ascend.kv_offload.pool_metrics import PoolCapacity
from vllm_ascend.kv_offload.region_worker import RegionWorker, build_region_worker
from vllm_ascend.kv_offload.replication import stored_copies
from vllm_ascend.kv_offload.worker import NPUOffloadingWorker

logger = init_logger(__name__)

# Re-exported: the connector and users catch / call these from here.
__all__ = [
    "NPUOffloadingSpec",
    "OffloadConfigError",
    "validate_connector_config",
]


class NPUOffloadingSpec(vllm_compat.ReplicatedOncePerHostSpec, CPUOffloadingSpec):
    """Offloads KV blocks to a CPU block pool; runs on npu, cuda and cpu."""

    # The kv_connector_extra_config keys this spec reads (config.KEYS has
    # their types); the connector and the spec refuse any other.
    extra_config_keys: ClassVar[frozenset[str]] = SPEC_KEYS

    def __init__(self, config: OffloadingConfig):
        extra, num_cpu_blocks = resolve_extra_config(config, self.extra_config_keys)
        super().__init__(dataclasses.replace(config, extra_config=extra))
        if num_cpu_blocks is not None and config.worker_kv_bytes_per_block > 0:
            # The guide's meaning, exactly: this many CPU blocks.
            self.num_chunks = num_cpu_blocks
        logger.info(
            "NPUOffloadingSpec: %d CPU blocks of %d tokens (%d device blocks "
            "each), eviction policy %s",
            self.num_chunks,
            self.blocks_per_chunk * self.tokens_per_block[0],
            self.blocks_per_chunk,
            self.eviction_policy,
        )

    # The worker this spec builds on a private pool; a subclass may
    # substitute its own.
    worker_cls: type[NPUOffloadingWorker] = NPUOffloadingWorker
    _failure_aware_manager: FailureAwareManager | None = None
    _npu_worker: NPUOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        """vLLM's manager (LRU/ARC, events, metrics), told about failed
        transfers by our connector (``manager.py``)."""
        if self._failure_aware_manager is None:
            self._failure_aware_manager = FailureAwareManager(
                super().get_manager(), self.pool_capacity()
            )
        return self._failure_aware_manager

    def pool_capacity(self) -> PoolCapacity:
        """The CPU pool's size, all workers together: one copy of each block
        where the layout is replicated (``/metrics``)."""
        return PoolCapacity(
            self.num_chunks, self.num_chunks * cpu_block_bytes(self.config)
        )

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]):
        # vLLM's reads store_threshold with a bare int(), in the front end.
        check_keys(extra_config, cls.extra_config_keys)
        return {
            **super().build_metric_definitions(extra_config),
            **pool_metrics.metric_definitions(),
        }

    def _pool_request(self, kv_caches: CanonicalKVCaches) -> PoolRequest:
        given: Mapping[str, Any] = self.config.extra_config
        key = "num_cpu_blocks" if "num_cpu_blocks" in given else "cpu_bytes_to_use"
        page_bytes = sum(t.page_size_bytes for t in kv_caches.tensors)
        return PoolRequest(
            num_blocks=self.num_chunks,
            # A shared region's rows are padded to the page size.
            row_bytes=self.kv_bytes_per_chunk
            if self.replicated_layout
            else page_bytes * self.blocks_per_chunk,
            key=key,
            setting=f"{PREFIX}['{key}']={shown(given.get(key))}",
            all_workers_block_bytes=cpu_block_bytes(self.config),
            blocks_per_chunk=self.blocks_per_chunk,
            chunk_key="blocks_per_chunk"
            if "blocks_per_chunk" in given
            else "block_size",
            device_block_tokens=self.tokens_per_block[0],
        )

    def allocate_pool(self, kv_caches: CanonicalKVCaches) -> CpuBlockPool:
        """This worker's private pool, exactly its size (``cpu_pool.py``)."""
        return private_pool(
            [t.page_size_bytes for t in kv_caches.tensors],
            self.blocks_per_chunk,
            self.num_chunks,
            kv_caches.tensors[0].tensor.device.type,
            int_setting(self.config.extra_config, "host_piece_bytes"),
        )

    def reserve_host_memory(
        self, kv_caches: CanonicalKVCaches
    ) -> host_ledger.Reservation:
        """Checks this worker's pool against the host's budget, next to the
        pools of the host's other workers, and records it in the host's
        ledger: one step under the ledger's lock, so that workers starting
        together do not each count memory the others are about to take."""
        pool = self._pool_request(kv_caches)
        host_kv_bytes = _host_kv_cache_bytes(kv_caches)
        try:
            cap = host_guard.budget_cap()
            ledger = host_ledger.ledger_dir()
        except ValueError as e:
            raise OffloadConfigError(f"KV offload: {e}") from None

        def check(others: list[host_ledger.Reserved]) -> None:
            budget = host_guard.HostBudget(
                host_guard.host_available_bytes(), others, cap
            )
            refusal = host_guard.check_pool(
                pool,
                budget,
                engine_id=self.config.engine_id,
                # The engine's pools, assumed on this host (across hosts
                # the fix is lower than needed: on the safe side); one
                # for all workers where the layout is replicated.
                workers=stored_copies(
                    self.config.parallel.world_size, self.replicated_layout
                ),
                host_kv_bytes=host_kv_bytes,
            )
            if refusal is not None:
                raise OffloadConfigError(refusal)
            logger.info(host_guard.passed(pool, budget))

        return host_ledger.reserve(pool.nbytes, self.config.engine_id, check, ledger)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._npu_worker is None:
            # The worker side, right before the pool is allocated: the one
            # place that knows what vLLM has allocated and what is to come.
            # The worker self-checks its copy path before serving.
            copy_path = self.config.extra_config.get("copy_path") or "auto"
            if self.replicated_layout:
                self._npu_worker = self._replicated_worker(kv_caches, copy_path)
                return self._npu_worker
            reservation = self.reserve_host_memory(kv_caches)
            try:
                pool = self.allocate_pool(kv_caches)
            except BaseException:
                reservation.release()
                raise
            # Faulted in now: out of MemAvailable, counted once (host_guard).
            reservation.allocated()
            pool.on_release(reservation.release)
            try:
                self._npu_worker = self.worker_cls(
                    kv_caches, pool=pool, copy_path=copy_path
                )
            except BaseException:
                pool.release()
                raise
        return self._npu_worker

    def _replicated_worker(
        self, kv_caches: CanonicalKVCaches, copy_path: str
    ) -> RegionWorker:
        """Every rank holds the same KV (MLA under tensor parallelism): the
        workers of the host share one copy, rank 0's slot of a shared
        region, which rank 0 checks against host memory, records in the
        host's ledger and creates before the others map it
        (``region_worker.py``)."""
        rank_0 = self.config.parallel.rank == 0
        return build_region_worker(
            kv_caches,
            engine_id=self.config.engine_id,
            num_chunks=self.num_chunks,
            slot_rank=0,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            slot_bytes=self.cpu_page_size_per_worker,
            blocks_per_chunk=self.blocks_per_chunk,
            copy_path=copy_path,
            shared_slot=True,
            reserve=(lambda: self.reserve_host_memory(kv_caches)) if rank_0 else None,
            barrier=vllm_compat.all_workers_barrier,
            piece_bytes=int_setting(self.config.extra_config, "host_piece_bytes"),
        )


def _host_kv_cache_bytes(kv_caches: CanonicalKVCaches) -> int:
    """Bytes of the device KV cache that live in host memory (the host
    guard's other fix): all of it on vLLM's CPU backend, none on an
    accelerator. Tensors may share storage."""
    storages = {}
    for t in kv_caches.tensors:
        if t.tensor.device.type == "cpu":
            storage = t.tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
