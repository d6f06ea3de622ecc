"""From vLLM's ``submit_store`` call to the copy op: at most four Python
frames of ours (issue 25; vLLM's own worker takes three).

Counted with a profile hook on the threads involved: on the caller's thread,
our frames from ``submit_store`` down to the queue's ``submit``; on the copy
thread (the CPU backend's queue), ours from its loop down to the op. On a
stream (npu, cuda) the queue's ``submit`` calls the copy function in place,
so the op then sees the first count plus the copy function's own frame where
it has one (vLLM's op on cuda, the torch path), never more than the sum here.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from tests.unit.kv_helpers import make_kv_caches, make_worker
from vllm_ascend.kv_offload import ops
from vllm_ascend.kv_offload.copy_paths import TorchCopier
from vllm_ascend.kv_offload.transfer_queue import TransferQueue

PACKAGE = Path(ops.__file__).resolve().parent
# Where a copy reaches the op: torch's op call, or (a build without native
# code) the torch path.
OP_ENTRIES = {torch._ops.OpOverload.__call__.__code__, TorchCopier.swap.__code__}
QUEUE_SUBMITS = {cls.submit.__code__ for cls in TransferQueue.__subclasses__()}


def ours(frame) -> list[str]:
    """Our package's frames from ``frame`` up to the thread's first."""
    names = []
    while frame is not None:
        if Path(frame.f_code.co_filename).resolve().is_relative_to(PACKAGE):
            names.append(frame.f_code.co_qualname)
        frame = frame.f_back
    return names


def test_a_store_reaches_the_op_through_at_most_four_frames_of_ours():
    seen: dict[str, list[str]] = {}
    watching = threading.Event()  # set once the start-up self-check is done

    def hook(frame, event, arg):
        if event != "call" or not watching.is_set():
            return
        if frame.f_code in QUEUE_SUBMITS and "submit" not in seen:
            seen["submit"] = ours(frame)
        elif frame.f_code in OP_ENTRIES and "op" not in seen:
            seen["op"] = ours(frame.f_back)

    # The worker's copy threads start with the hook (Python 3.11 has no
    # setprofile_all_threads).
    threading.setprofile(hook)
    try:
        worker = make_worker(make_kv_caches(8, [256, 256]), 1, 4)
    finally:
        threading.setprofile(None)
    spec = GPULoadStoreSpec([2, 5], group_sizes=[2], block_indices=[0])
    sys.setprofile(hook)
    watching.set()
    try:
        assert worker.submit_store(1, spec, CPULoadStoreSpec([0, 3]))
        worker.wait({1})
    finally:
        sys.setprofile(None)
        watching.clear()
        worker.shutdown()
    assert [r.success for r in worker.get_finished()] == [True]
    submit_side, copy_side = seen["submit"], seen["op"]
    assert submit_side[-1] == "NPUOffloadingWorker.submit_store"
    assert len(submit_side) + len(copy_side) <= 4, seen
