"""ThreadTransferQueue (the ``cpu`` backend's copy thread): every job it
accepted is reported exactly once, whatever its copy raises and however
``submit`` and ``shutdown`` interleave; ``wait`` never blocks forever.

A broken queue would hang these tests, so every blocking call runs on a
helper thread with a generous bound (``finishes``): the bound only turns a
hang into a failure, it never decides a passing outcome.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from tests.unit.conftest import copy_threads_end, kv_offload_threads
from vllm_ascend.kv_offload import transfer_queue
from vllm_ascend.kv_offload.transfer_queue import FinishedJob, ThreadTransferQueue

HANG_S = 10.0  # far beyond any of these operations on a healthy queue


def finishes(call: Callable[[], object]) -> bool:
    """Runs ``call`` on a helper thread; whether it returned within HANG_S."""
    done = threading.Event()

    def run() -> None:
        call()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(HANG_S)


def reports(q: ThreadTransferQueue) -> dict[int, list[bool]]:
    """job id -> the success flag of every report of it so far."""
    seen: dict[int, list[bool]] = {}
    for job in q.poll():
        assert isinstance(job, FinishedJob)
        seen.setdefault(job.job_id, []).append(job.success)
    return seen


@pytest.mark.parametrize("error", [SystemExit, KeyboardInterrupt, ValueError])
def test_a_copy_that_raises_anything_fails_only_its_own_job(error):
    q = ThreadTransferQueue("test")

    def bad_copy() -> None:
        raise error("copy died")

    q.submit(1, bad_copy)
    q.submit(2, lambda: None)  # accepted behind the failing one
    assert finishes(lambda: q.wait({1, 2}))
    assert reports(q) == {1: [False], 2: [True]}
    # The thread survived: later jobs still run.
    q.submit(3, lambda: None)
    assert finishes(lambda: q.wait({3}))
    assert reports(q) == {3: [True]}
    assert q.shutdown()


class _ShutdownDuringSubmit(set):
    """``_pending`` of a queue whose ``shutdown`` starts, on another thread,
    the moment ``submit`` records its job: the tightest interleaving."""

    def __init__(self, q: ThreadTransferQueue):
        super().__init__()
        self.q = q
        self.shutdown_thread: threading.Thread | None = None

    def add(self, job_id: int) -> None:
        if self.shutdown_thread is None:
            self.shutdown_thread = threading.Thread(target=self.q.shutdown)
            self.shutdown_thread.start()
            # Let shutdown run as far as it can while submit is under way.
            # A correct queue makes it wait for submit (this join then times
            # out); a racy one lets it finish first and lose the job.
            self.shutdown_thread.join(0.2)
        super().add(job_id)


def test_a_job_accepted_while_shutting_down_is_still_reported():
    q = ThreadTransferQueue("test")
    race = _ShutdownDuringSubmit(q)
    q._pending = race
    try:
        q.submit(7, lambda: None)
    except RuntimeError:
        accepted = False  # refused is fine too: then nothing is owed
    else:
        accepted = True
    assert race.shutdown_thread is not None
    race.shutdown_thread.join(HANG_S)
    assert not race.shutdown_thread.is_alive()
    if accepted:
        # Ran, or dropped by the shutdown: either way reported, once.
        assert finishes(lambda: q.wait({7}))
        seen = reports(q)
        assert list(seen) == [7] and len(seen[7]) == 1
        assert reports(q) == {}
    with pytest.raises(RuntimeError, match="shut down"):
        q.submit(8, lambda: None)


# The thread's death is the point here; pytest would flag it as a warning.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_wait_returns_and_jobs_fail_if_the_copy_thread_dies_anyway(monkeypatch):
    """Should the thread die outside a copy (a bug in its own bookkeeping),
    waiters are released, its jobs are reported failed, and submit refuses."""
    before = set(kv_offload_threads())
    q = ThreadTransferQueue("test")
    release = threading.Event()
    q.submit(1, release.wait)  # keeps the thread busy while we sabotage it
    recorded = []

    def dies_once(*args) -> FinishedJob:
        recorded.append(args)
        if len(recorded) == 1:  # recording job 1; the thread's cleanup may record
            raise SystemExit("bookkeeping died")
        return FinishedJob(*args)

    monkeypatch.setattr(transfer_queue, "FinishedJob", dies_once)
    q.submit(2, lambda: None)  # queued behind job 1, never run
    release.set()
    assert finishes(lambda: q.wait({1, 2}))
    assert copy_threads_end(before, HANG_S)
    assert reports(q) == {1: [False], 2: [False]}
    with pytest.raises(RuntimeError, match="shut down"):
        q.submit(3, lambda: None)
    assert finishes(q.shutdown)
