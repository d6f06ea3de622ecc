"""The offload worker's record of the jobs it accepted, until reported.

Every job ``submit_store``/``submit_load`` accepted is reported exactly once
(``NPUOffloadingWorker.get_finished``): with its bytes and duration when it
succeeded; failed with ``success=False`` by default (vLLM's own connector
asserts on that: a failure stays loud); or, once ``divert`` was called,
as finished without transfer stats, kept for ``take_failed`` (the connector
then reports it through vLLM's public hooks: ``connector.py``). A job refused
at submission is reported by the next ``report`` in the same way, when
failures are diverted; otherwise the worker returns False for it and vLLM
expects nothing more of it.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm.v1.kv_offload.base import TransferResult

from vllm_ascend.kv_offload.transfer_queue import FinishedJob


class JobLedger:
    """Bytes and kind of each job in flight, failures to report, and how."""

    def __init__(self) -> None:
        # job_id -> bytes, for the TransferResult; stores among them.
        self._job_bytes: dict[int, int] = {}
        self._store_jobs: set[int] = set()
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
        self._job_bytes[job_id] = num_bytes
        if store:
            self._store_jobs.add(job_id)

    def forget(self, job_id: int) -> None:
        """``job_id`` could not be queued after all (see ``refuse``)."""
        self._job_bytes.pop(job_id, None)
        self._store_jobs.discard(job_id)

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
            size = self._job_bytes.pop(job.job_id, 0)
            self._store_jobs.discard(job.job_id)
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
        stores = sum(self._job_bytes[j] for j in self._store_jobs)
        return stores, sum(self._job_bytes.values()) - stores

    def clear(self) -> None:
        """Forget the jobs in flight (the worker shut down)."""
        self._job_bytes.clear()
        self._store_jobs.clear()
