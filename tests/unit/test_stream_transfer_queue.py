"""StreamTransferQueue keeps each job's workspace until the job's end event.

The op returns, with the copies it enqueued, a workspace: host memory (the
batch copy APIs' descriptor arrays) that those copies may still read
(csrc/kv_offload/ops.h). No accelerator here, so torch's stream and event
types are replaced by fakes whose events complete when the test says so; the
queue's own code is what runs.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from vllm_ascend.kv_offload import transfer_queue


class FakeStream:
    def __init__(self, device=None) -> None:
        self.events: list[FakeEvent] = []

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        for event in self.events:
            event.done = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.done = False

    def record(self, stream: FakeStream) -> None:
        self.done = False
        stream.events.append(self)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1.0


@pytest.fixture
def queue(monkeypatch: pytest.MonkeyPatch) -> transfer_queue.StreamTransferQueue:
    monkeypatch.setattr(torch, "Stream", FakeStream)
    monkeypatch.setattr(torch, "Event", FakeEvent)
    compute = FakeStream()
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device: compute)
    # Any device: its streams and events are faked.
    return transfer_queue.StreamTransferQueue(torch.device("cuda", 0))


def submit(q: transfer_queue.StreamTransferQueue, job_id: int) -> weakref.ref:
    """Submits a job whose copy function, like CopyEngine.swap, makes a
    workspace and returns (copies, workspace); returns a weak reference to
    the workspace."""
    refs = []

    def copy() -> tuple[int, torch.Tensor]:
        workspace = torch.empty(64, dtype=torch.uint8)
        refs.append(weakref.ref(workspace))
        return 1, workspace

    q.submit(job_id, copy)
    return refs[0]


def copies_complete(queue: transfer_queue.StreamTransferQueue, nth: int) -> None:
    """The ``nth`` job submitted (from 0) has completed on the stream: its end
    event (each job records a start and an end event on the queue's stream)."""
    start, end = queue.stream.events[2 * nth : 2 * nth + 2]
    end.done = True


def test_workspace_lives_until_poll_sees_the_end_event(queue) -> None:
    first, second = submit(queue, 1), submit(queue, 2)
    assert queue.poll() == []  # no end event has completed
    assert first() is not None and second() is not None
    copies_complete(queue, 0)  # job 1's copies have completed
    assert [job.job_id for job in queue.poll()] == [1]
    assert first() is None  # released with the job
    assert second() is not None  # still in flight
    copies_complete(queue, 1)
    assert [job.job_id for job in queue.poll()] == [2]
    assert second() is None


def test_wait_releases_the_workspace_of_the_jobs_it_waited_for(queue) -> None:
    first, second = submit(queue, 1), submit(queue, 2)
    queue.wait({2})
    assert second() is None  # its end event has completed
    assert first() is not None  # not waited for, not finished
    queue.wait({1})
    assert first() is None
    assert [job.job_id for job in queue.poll()] == [1, 2]


def test_shutdown_releases_workspaces_after_the_stream_has_run(queue) -> None:
    refs = [submit(queue, job) for job in range(3)]
    assert all(ref() is not None for ref in refs)
    assert queue.shutdown()
    assert all(event.done for event in queue.stream.events)
    assert all(ref() is None for ref in refs)


def test_a_failed_submission_keeps_nothing(queue) -> None:
    def failing_copy():
        raise RuntimeError("could not enqueue")

    with pytest.raises(RuntimeError, match="could not enqueue"):
        queue.submit(1, failing_copy)
    assert queue.poll() == []
