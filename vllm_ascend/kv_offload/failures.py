"""Failed transfers on the worker side: what is reported, and how (why:
``connector.py``; the scheduler side acts on them: ``scheduler_side.py``).

* ``JobLedger`` (the offloading worker, ``worker.py``): every job
  ``submit_store``/``submit_load`` accepted is reported exactly once
  (``NPUOffloadingWorker.get_finished``): with its bytes and duration when it
  succeeded; failed with ``success=False`` by default (vLLM's own connector
  asserts on that: a failure stays loud); or, once ``divert`` was called
  (``worker.divert_failures``), as finished without transfer stats, kept for
  ``take_failed``. A job refused at submission is reported by the next
  ``report`` in the same way, when failures are diverted; otherwise the worker
  returns False for it and vLLM expects nothing more of it.
* ``WorkerFailureLog`` (the connector's worker side): which device blocks each
  load job writes, and what this step reports: a failed load's device blocks
  through ``get_block_ids_with_load_errors`` in the step vLLM sees the job
  finish (the contract of ``KVConnectorBase_V1``), or, with several KV cache
  groups whose block ids vLLM cannot map back to requests, its request in
  ``failed_recving``; failed job ids in ``AscendOffloadingWorkerMetadata``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
    ReqId,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec, TransferResult

from vllm_ascend.kv_offload.load_wait import WorkerFigures
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.transfer_queue import FinishedJob

logger = init_logger(__name__)


@dataclass
class AscendOffloadingWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker -> scheduler metadata, plus the jobs that failed.

    A failed job is also in ``completed_jobs`` (vLLM saw it finish), so vLLM's
    bookkeeping (one count per worker) is unchanged; ``failed_jobs`` tells
    the scheduler side what the job did not do. ``figures``: what the worker
    measured in the step, for the bounded wait of CPU hits (``load_wait``).
    """

    failed_jobs: set[int] = field(default_factory=set)
    figures: WorkerFigures | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        figures = getattr(other, "figures", None)
        return AscendOffloadingWorkerMetadata(
            completed_jobs=merged.completed_jobs,
            transfer_stats=merged.transfer_stats,
            failed_jobs=self.failed_jobs | getattr(other, "failed_jobs", set()),
            figures=self.figures.aggregate(figures) if self.figures else figures,
        )


@dataclass(frozen=True)
class LoadJob:
    """What the worker side must know to report a failed load."""

    req_id: ReqId
    block_ids: Any  # the spec's own array: read only if the load fails
    sync: bool


class WorkerFailureLog:
    """Load jobs in flight and the failures the current step reports."""

    def __init__(self, report_block_ids: bool):
        # vLLM maps failed block ids back to requests only with one KV cache
        # group (Scheduler._handle_invalid_blocks); else report per request.
        self.report_block_ids = report_block_ids
        self._load_jobs: dict[int, LoadJob] = {}
        self._load_error_block_ids: set[int] = set()
        self._failed_recving: set[ReqId] = set()
        self._failed_jobs: set[int] = set()

    def record_loads(self, load_jobs: Mapping[int, Any]) -> None:
        """The load jobs of the metadata bound for this step."""
        for job_id, entry in load_jobs.items():
            assert isinstance(entry.dst_spec, GPULoadStoreSpec)
            self._load_jobs[job_id] = LoadJob(
                req_id=entry.req_id,
                block_ids=entry.dst_spec.block_ids,
                sync=bool(getattr(entry, "sync", False)),
            )

    def record_failures(self, job_ids: Iterable[int]) -> None:
        """Jobs the worker reported failed (``take_failed_jobs``)."""
        for job_id in job_ids:
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
            if self.report_block_ids:
                self._load_error_block_ids.update(
                    np.asarray(load.block_ids, dtype=np.int64).tolist()
                )
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

    def take_failed_recving(self) -> set[ReqId]:
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def take_load_error_block_ids(self) -> set[int]:
        block_ids, self._load_error_block_ids = self._load_error_block_ids, set()
        return block_ids

    def worker_metadata(
        self, meta: OffloadingWorkerMetadata, figures: WorkerFigures | None = None
    ) -> AscendOffloadingWorkerMetadata:
        """vLLM's metadata of this step, with the failed jobs among it and
        the worker's ``figures``."""
        for job_id in meta.completed_jobs:
            self._load_jobs.pop(job_id, None)
        failed = self._failed_jobs & set(meta.completed_jobs)
        self._failed_jobs -= failed
        return AscendOffloadingWorkerMetadata(
            completed_jobs=meta.completed_jobs,
            transfer_stats=meta.transfer_stats,
            failed_jobs=failed,
            figures=figures,
        )


class JobLedger:
    """Bytes and kind of each job in flight, failures to report, and how."""

    def __init__(self) -> None:
        # job_id -> (bytes, for the TransferResult; whether it stores).
        self._jobs: dict[int, tuple[int, bool]] = {}
        # Jobs that failed at submission; reported by the next report().
        self._refused: list[int] = []
        self._divert_failures = False
        self._failed_jobs: list[int] = []

    def divert(self) -> None:
        """Report failed jobs as finished (without stats) and keep them for
        ``take_failed``."""
        self._divert_failures = True

    def take_failed(self) -> list[int]:
        """Jobs reported failed since the last call (diverted failures)."""
        failed, self._failed_jobs = self._failed_jobs, []
        return failed

    def accept(self, job_id: int, num_bytes: int, store: bool) -> None:
        """``job_id`` is about to be queued: it moves ``num_bytes``."""
        self._jobs[job_id] = (num_bytes, store)

    def forget(self, job_id: int) -> None:
        """``job_id`` could not be queued after all (see ``refuse``)."""
        self._jobs.pop(job_id, None)

    def refuse(self, job_id: int) -> bool:
        """``job_id`` failed at submission: what ``submit_*`` returns."""
        if not self._divert_failures:
            return False  # vLLM's contract: nothing is reported for it later
        # Accepted as far as vLLM knows; finishes failed at the next poll.
        self._refused.append(job_id)
        return True

    def report(self, finished: Iterable[FinishedJob]) -> list[TransferResult]:
        """vLLM's results for the jobs refused since the last call and
        ``finished`` (polled from the queues), in that order."""
        jobs = [FinishedJob(j, False, 0.0) for j in self._refused]
        self._refused.clear()
        jobs += finished
        results = []
        for job in jobs:
            size, _ = self._jobs.pop(job.job_id, (0, False))
            if job.success:
                results.append(TransferResult(job.job_id, True, size, job.seconds))
            elif self._divert_failures:
                # Failed jobs moved no useful bytes: no transfer stats.
                self._failed_jobs.append(job.job_id)
                results.append(TransferResult(job.job_id, True, None, None))
            else:
                results.append(TransferResult(job.job_id, False, size, job.seconds))
        return results

    def queued_bytes(self) -> tuple[int, int]:
        """Bytes of the (store, load) jobs accepted and not yet reported."""
        stores = sum(size for size, store in self._jobs.values() if store)
        return stores, sum(size for size, _ in self._jobs.values()) - stores

    def clear(self) -> None:
        """Forget the jobs in flight (the worker shut down)."""
        self._jobs.clear()
