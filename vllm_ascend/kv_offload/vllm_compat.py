"""Every use of a private vLLM name in this package, in one place.

Each function says which vLLM releases it was checked against and what it
needs; ``tests/unit/test_vllm_compat.py`` scans the package for any other use
and fails with a clear message when a release changes one of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any


class ReplicatedOncePerHostSpec:
    """Mixin for a ``CPUOffloadingSpec`` that stores a replicated KV layout
    (MLA under tensor parallelism) once per host, on a region its workers
    share (ours: ``region_worker.py``); other layouts in private pools.

    ``CPUOffloadingSpec.__init__`` asks ``_uses_shared_region()`` (True on
    CUDA) whether to honour ``OffloadingConfig.replicated_layout``: if so it
    sizes one copy of each CPU block (``num_copies = 1``, every rank's slot
    the same), and vLLM's connector lets rank 0 alone store. Present with
    this meaning in vLLM 0.30, 0.31, 0.32 and 0.33.
    """

    def _uses_shared_region(self) -> bool:
        return True


def all_workers_barrier() -> None:
    """Returns once every worker of the engine has called it: vLLM's CPU
    spec's ``_all_workers_barrier`` (the gloo barrier of the workers of this
    data-parallel rank), after which its creator unlinks the region's name
    (vLLM 0.30-0.33)."""
    from vllm.v1.kv_offload.cpu import spec

    spec._all_workers_barrier()


def replace_connector_loader(
    name: str, loader: Callable[[], type]
) -> Callable[[], type] | None:
    """Serves connector ``name`` with ``loader``; returns the loader it replaced.

    ``KVConnectorFactory.register_connector`` is the public way in, but it
    refuses a name that is taken (vLLM's own ``OffloadingConnector``) and
    takes a module path, not a loader. vLLM 0.30-0.33 keep the loaders in
    ``KVConnectorFactory._registry`` (name -> zero-argument callable returning
    the class); upstream vllm-ascend 0.30 replaces entries the same way.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry: dict[str, Callable[[], type]] = KVConnectorFactory._registry
    previous = registry.get(name)
    registry[name] = loader
    return previous


def init_offloading_worker(connector_worker: Any, kv_caches: Any) -> None:
    """Hands canonical KV caches that we built (Ascend tuple layouts) to vLLM's
    connector worker, which then builds the offloading worker from the spec.

    ``OffloadingConnectorWorker.register_kv_caches`` only accepts one tensor
    per layer and ends in ``_init_worker(CanonicalKVCaches)``; that method
    exists with this signature in vLLM 0.30, 0.31, 0.32 and 0.33.
    """
    connector_worker._init_worker(kv_caches)


def count_fs_tier_job_blocks(tier: Any, job_id: int, num_blocks: int) -> None:
    """Records how many blocks job ``job_id`` of an ``fs`` tier moves, as
    ``FileSystemTierManager.submit_store``/``submit_load`` do.

    vLLM 0.31, 0.32 and 0.33 keep the counts in ``_job_block_counts``
    (job id -> blocks) and pop them in ``get_finished_jobs`` to report the
    job's ``transfer_bytes``; vLLM 0.30 has no such dict and reports no
    transfer bytes for the tier, so there is nothing to record.
    """
    try:
        counts = tier._job_block_counts
    except AttributeError:  # vLLM 0.30
        return
    counts[job_id] = num_blocks


# -- vLLM's fs tier (FileSystemTierManager), which tiering/fs.py subclasses --
# vLLM's submit_store/submit_load call its module-level batch I/O functions
# directly, with no seam for another file format, so our tier re-implements
# both and does the bookkeeping vLLM's get_finished_jobs reads here.


def fs_tier_uses_o_direct(tier: Any) -> bool:
    """Whether vLLM's probe found ``O_DIRECT`` usable in the tier directory
    (``FileSystemTierManager.__init__`` sets ``_use_o_direct``; vLLM
    0.30-0.33)."""
    return bool(tier._use_o_direct)


def enqueue_fs_tier_store(
    tier: Any, job_id: int, keys: list[Any], task: Callable[[], None]
) -> None:
    """Queues store job ``job_id`` (one task) as ``submit_store`` does: its
    keys for the KV events (``_store_job_keys``, only when events are on),
    its block count (``count_fs_tier_job_blocks``), then
    ``_pool.enqueue_store`` (vLLM 0.30-0.33)."""
    if tier.events is not None:
        tier._store_job_keys[job_id] = keys
    count_fs_tier_job_blocks(tier, job_id, len(keys))
    tier._pool.enqueue_store(job_id, 1, [task])


def enqueue_fs_tier_load(
    tier: Any, job_id: int, keys: list[Any], task: Callable[[], None]
) -> None:
    """Queues load job ``job_id`` (one task) as ``submit_load`` does: its
    keys (``_load_job_keys``, so that a failure marks them a miss), its block
    count, then ``_pool.enqueue_load`` (vLLM 0.30-0.33)."""
    tier._load_job_keys[job_id] = keys
    count_fs_tier_job_blocks(tier, job_id, len(keys))
    tier._pool.enqueue_load(job_id, 1, [task])


def record_fs_tier_load_progress(tier: Any, job_id: int, num_loaded: int) -> None:
    """Before a load task raises: how many of its blocks loaded (kept), in
    ``_load_progress``, which ``get_finished_jobs`` pops (vLLM 0.30-0.33)."""
    tier._load_progress[job_id] = num_loaded


class _DropRecordsOf(logging.Filter):
    """Drops records whose arguments include an exception of ``exc_type``."""

    def __init__(self, exc_type: type[BaseException]):
        super().__init__()
        self.exc_type = exc_type

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(isinstance(a, self.exc_type) for a in args)


def quiet_fs_tier_pool_errors(exc_type: type[BaseException]) -> None:
    """vLLM's fs tier thread pool (``DualQueueThreadPool._worker``, module
    ``vllm.v1.kv_offload.tiering.fs.thread_pool``) logs every exception of a
    task as an error, "Job %s block I/O failed: %s", with the exception as
    the second argument (vLLM 0.30-0.33); the job then fails as a miss.
    Drops those lines for exceptions of ``exc_type``, which the tier counts
    as plain misses instead. Idempotent."""
    pool_logger = logging.getLogger("vllm.v1.kv_offload.tiering.fs.thread_pool")
    for existing in pool_logger.filters:
        if isinstance(existing, _DropRecordsOf) and existing.exc_type is exc_type:
            return
    pool_logger.addFilter(_DropRecordsOf(exc_type))


def disown_region(region: Any) -> None:
    """Stops ``SharedOffloadRegion.cleanup`` from unlinking the region's file
    (``_creator``; vLLM 0.30-0.33): ``region`` removes it."""
    region._creator = False


def cpu_blocks_in_use(manager: Any) -> int:
    """CPU blocks of vLLM's ``CPUOffloadingManager`` that hold KV or are being
    written (allocated minus free). Every supported release's CPU spec builds
    that manager (the tiering manager's CPU tier subclasses it).

    vLLM 0.30-0.33 hand out chunk ids ``0.._num_allocated_chunks`` and keep
    freed ones in ``_free_list`` (its ``get_stats`` reads both).
    """
    return manager._num_allocated_chunks - len(manager._free_list)


def vllm_swap_blocks_batch() -> Callable[..., None] | None:
    """vLLM's batched raw-pointer copy for CUDA, or None where its torch op
    is not registered (a build without CUDA kernels, e.g. vLLM's CPU build).

    ``vllm._custom_ops.swap_blocks_batch(src_ptrs, dst_ptrs, sizes,
    is_src_access_order_any=False)``: int64 CPU tensors, one
    ``cuMemcpyBatchAsync`` on CUDA 12.8+ (a ``cudaMemcpyAsync`` loop before),
    on the current stream, returning None; vLLM's own worker keeps the three
    tensors until the copies have completed. Present with this meaning in
    vLLM 0.30, 0.31, 0.32 and 0.33 (``torch.ops._C_cache_ops.swap_blocks_batch``).
    """
    import torch
    import vllm._custom_ops  # its torch ops load with it (a warning if they fail)

    if not hasattr(torch.ops._C_cache_ops, "swap_blocks_batch"):
        return None
    return vllm._custom_ops.swap_blocks_batch
