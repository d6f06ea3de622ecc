"""A bounded wait for CPU hits: recompute a hit that would wait too long.

vLLM's scheduler waits for a CPU hit as long as it takes: a block whose store
is still queued answers ``HIT_PENDING`` and its request is looked up again
every step until the store lands, and a hit's load queues behind every load
submitted before it (vLLM #57959, #49829: tens of seconds behind a store
backlog). Recomputing the same tokens costs a prefill, which the engine
measures every step. ``LoadWaitBound`` compares the two and answers MISS for
the key where the wait starts, so the hit keeps the prefix that is ready and
the rest is recomputed, when

    estimated wait > max_load_wait_ratio * (tokens at stake / prefill rate)

* the wait (``hit_wait_s``): the bytes queued ahead on the worker's store and
  load queues (``worker.NPUOffloadingWorker.queued_bytes``), plus the hit's
  own bytes, over the copy bandwidth of the jobs that completed last (vLLM's
  ``transfer_stats``: bytes and seconds each worker measured per job). Per
  worker: workers copy their shares at the same time.
* the tokens at stake: the request's prompt tokens from the first key that
  waits on; an upper bound of what the hit can save, so the bound errs
  towards serving the hit.
* the prefill rate: tokens per second of the engine's own forward steps of at
  least ``PREFILL_STEP_MIN_TOKENS`` tokens (smaller ones are decode-bound),
  timed on the workers from the step's metadata to its ``get_finished``.

Until the engine has measured a prefill step nothing is recomputed, and a
direction without a completed copy adds no wait (a lower bound): an estimate
that is not there cannot justify dropping a hit. The workers' figures travel with vLLM's
worker -> scheduler metadata (``failures.AscendOffloadingWorkerMetadata``),
as their failed jobs do.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import LookupResult

# Steps with fewer tokens are mostly decode; their tokens/s is no prefill rate.
PREFILL_STEP_MIN_TOKENS = 128
# Figures over the last this many prefill steps / reports with copies.
WINDOW = 16


def hit_wait_s(
    store_bytes: float,
    store_bytes_per_s: float | None,
    load_bytes: float,
    load_bytes_per_s: float | None,
) -> float:
    """Seconds until a hit's KV is on the device: ``store_bytes`` still to
    copy to the CPU first (0 for a ready block), then ``load_bytes`` (the
    loads ahead and its own). A direction whose bandwidth is not measured
    yet counts 0 s: a lower bound, which errs towards serving the hit."""
    legs = ((store_bytes, store_bytes_per_s), (load_bytes, load_bytes_per_s))
    return sum((n / rate for n, rate in legs if n > 0 and rate), 0.0)


def recompute_instead(
    wait_s: float, tokens: int, tokens_per_s: float | None, ratio: float
) -> bool:
    """Whether recomputing ``tokens`` beats waiting ``wait_s`` for them:
    the wait exceeds ``ratio`` times their prefill. False where the prefill
    rate is unknown or the bound is off (``ratio`` 0)."""
    if ratio <= 0 or not tokens_per_s or tokens <= 0:
        return False
    return wait_s > ratio * tokens / tokens_per_s


class _Rate:
    """Amount per second over the last ``WINDOW`` observations."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=WINDOW)

    def add(self, amount: float, seconds: float) -> None:
        if amount > 0 and seconds > 0:
            self._samples.append((amount, seconds))

    def per_s(self) -> float | None:
        seconds = sum(s for _, s in self._samples)
        return sum(a for a, _ in self._samples) / seconds if seconds else None


@dataclass
class WorkerFigures:
    """What a worker measured in one step (worker -> scheduler)."""

    store_bytes_queued: int = 0
    load_bytes_queued: int = 0
    forward_tokens: int = 0
    forward_s: float = 0.0

    def aggregate(self, other: WorkerFigures | None) -> WorkerFigures:
        # Workers run in parallel: the slowest one bounds the wait.
        if other is None:
            return self
        return WorkerFigures(
            max(self.store_bytes_queued, other.store_bytes_queued),
            max(self.load_bytes_queued, other.load_bytes_queued),
            max(self.forward_tokens, other.forward_tokens),
            max(self.forward_s, other.forward_s),
        )


@dataclass
class _Lookup:
    req_id: str
    num_computed_tokens: int
    num_prompt_tokens: int
    ready_end: int  # tokens up to the last HIT key of this lookup
    load_checked: bool = False
    pending_checked: bool = False


class LoadWaitBound:
    """Scheduler side: the figures, and the answer per looked-up key."""

    def __init__(self, ratio: float, worker_bytes_per_token: float):
        self.ratio = ratio
        self.bytes_per_token = worker_bytes_per_token
        self._store_rate = _Rate()
        self._load_rate = _Rate()
        self._prefill_rate = _Rate()
        self._queued = WorkerFigures()
        self._lookup: _Lookup | None = None
        self._recomputed: set[str] = set()
        self._recomputed_count = 0

    def observe(self, worker_meta: Any) -> None:
        """A step's aggregated worker metadata (``update_connector_output``)."""
        stats = getattr(worker_meta, "transfer_stats", None)
        if stats is not None:
            self._store_rate.add(stats.store.bytes, stats.store.time)
            self._load_rate.add(stats.load.bytes, stats.load.time)
        figures = getattr(worker_meta, "figures", None)
        if figures is not None:
            self._queued = figures
            if figures.forward_tokens >= PREFILL_STEP_MIN_TOKENS:
                self._prefill_rate.add(figures.forward_tokens, figures.forward_s)

    def begin_lookup(
        self, req_id: str, num_computed_tokens: int, num_prompt_tokens: int
    ) -> None:
        """The connector starts looking ``req_id`` up."""
        self._lookup = (
            _Lookup(req_id, num_computed_tokens, num_prompt_tokens, num_computed_tokens)
            if self.ratio > 0
            else None
        )

    def admit(self, result: LookupResult, req_id: str, key_end: int | None):
        """The manager's answer for a key ending at token ``key_end``, or MISS
        where waiting for it takes longer than the bound."""
        lookup = self._lookup
        if lookup is None or lookup.req_id != req_id:
            return result
        if result is LookupResult.HIT:
            if not lookup.load_checked:
                lookup.load_checked = True
                if self._too_long(lookup, lookup.num_computed_tokens, store=False):
                    return self._refuse(req_id)
            if key_end is not None:
                lookup.ready_end = max(lookup.ready_end, key_end)
        elif result is LookupResult.HIT_PENDING and not lookup.pending_checked:
            lookup.pending_checked = True
            if self._too_long(lookup, lookup.ready_end, store=True):
                return self._refuse(req_id)
        return result

    def _too_long(self, lookup: _Lookup, start: int, store: bool) -> bool:
        tokens = lookup.num_prompt_tokens - start
        wait = hit_wait_s(
            self._queued.store_bytes_queued if store else 0,
            self._store_rate.per_s(),
            self._queued.load_bytes_queued + tokens * self.bytes_per_token,
            self._load_rate.per_s(),
        )
        return recompute_instead(wait, tokens, self._prefill_rate.per_s(), self.ratio)

    def _refuse(self, req_id: str) -> LookupResult:
        if req_id not in self._recomputed:
            self._recomputed.add(req_id)
            self._recomputed_count += 1
        return LookupResult.MISS

    def forget(self, req_id: str) -> None:
        self._recomputed.discard(req_id)

    def take_recomputed(self) -> int:
        """Requests whose hit was (partly) recomputed since the last call."""
        count, self._recomputed_count = self._recomputed_count, 0
        return count
