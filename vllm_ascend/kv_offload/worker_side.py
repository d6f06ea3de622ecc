"""The connector's worker-side additions to vLLM's ``OffloadingConnector``.

``connector.AscendOffloadingConnector`` calls these from vLLM's worker hooks,
around vLLM's own code:

* failed transfers (``failures.WorkerFailureLog``): which device blocks each
  load writes, and what the step reports of the jobs the offloading worker
  diverted (``worker.divert_failures``);
* the figures the scheduler side bounds CPU hits' waits with
  (``load_wait.py``): the step's forward pass, timed from the metadata's
  binding to ``get_finished``, and the bytes queued on the worker's copy
  queues, in the worker metadata.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)

from vllm_ascend.kv_offload.failures import WorkerFailureLog
from vllm_ascend.kv_offload.load_wait import WorkerFigures


class WorkerSide:
    """The failure log, the step's timing and the figures for the scheduler."""

    def __init__(self, report_block_ids: bool):
        """``report_block_ids``: a failed load is reported by its device
        blocks (one offloaded KV cache group), else by its request."""
        self._failure_log = WorkerFailureLog(report_block_ids)
        self._started: tuple[float, int] | None = None  # the step's forward
        # The forward passes since the figures were last reported.
        self._tokens = 0
        self._seconds = 0.0
        self._queued_sent = (0, 0)

    def on_metadata(self, meta: OffloadingConnectorMetadata) -> None:
        """The step's metadata, bound before its forward pass."""
        self._failure_log.record_loads(meta.load_jobs)
        tokens = getattr(meta, "num_scheduled_tokens", 0)
        self._started = (time.perf_counter(), tokens) if tokens else None

    def forward_done(self) -> None:
        """The step's forward pass is over."""
        if self._started is not None:
            start, tokens = self._started
            self._seconds += time.perf_counter() - start
            self._tokens += tokens
            self._started = None

    def record_failures(self, job_ids: Iterable[int]) -> None:
        """Jobs the offloading worker diverted (``take_failed_jobs``)."""
        self._failure_log.record_failures(job_ids)

    def add_failed_recving(self, results: KVConnectorTransferResults) -> None:
        """Requests whose failed loads are reported by request."""
        results.failed_recving |= self._failure_log.take_failed_recving()

    def take_load_error_block_ids(self) -> set[int]:
        """Device blocks of the loads that failed, reported once."""
        return self._failure_log.take_load_error_block_ids()

    def worker_metadata(
        self, meta: OffloadingWorkerMetadata | None, queued: tuple[int, int]
    ) -> OffloadingWorkerMetadata | None:
        """vLLM's ``meta`` plus failed jobs and this step's figures;
        ``queued``: the worker's (store, load) bytes in flight."""
        if meta is None:
            # Nothing finished: report only figures the scheduler lacks.
            if not self._tokens and queued == self._queued_sent:
                return None
            meta = OffloadingWorkerMetadata()
        self._queued_sent = queued
        figures = WorkerFigures(*queued, self._tokens, self._seconds)
        self._tokens, self._seconds = 0, 0.0
        return self._failure_log.worker_metadata(meta, figures)
