"""Prototype of a proposed fix, used only to measure it: copy thread affinity.

On vLLM's CPU backend the worker binds its OpenMP threads to cores, and every
thread it starts afterwards inherits the main thread's binding -- including
the copy threads of ``ThreadTransferQueue``. The offload copies then share
one core with the model's compute, while the core vLLM reserves for the rest
(``VLLM_CPU_NUM_OF_RESERVED_CPU``; one more is reserved "for the KV
connector" when a ``kv_transfer_config`` is set) is never used by them.

This module is ``vllm_ascend.kv_offload.npu`` plus one patch: each copy
thread moves itself to the CPUs its creator is *not* bound to (all CPUs if
there are none). Use it with ``--spec-module benchmarks.copy_thread_affinity``
or ``--tp-configs off on on:benchmarks.copy_thread_affinity``.

Measured on the 2-core machine of docs/e2e_benchmark.md it did not make
loads faster (the freed core is busy with vLLM's engine loop while a load is
in flight); it is kept to re-measure on machines with more cores.
"""

from __future__ import annotations

import os

import vllm_ascend.kv_offload.transfer_queue as _tq
from vllm_ascend.kv_offload.npu import NPUOffloadingSpec

__all__ = ["NPUOffloadingSpec"]

_original_run = _tq.ThreadTransferQueue._run


def _run_off_the_compute_cores(self) -> None:
    inherited = os.sched_getaffinity(0)  # the creating (OpenMP-bound) thread's
    all_cpus = set(range(os.cpu_count() or 1))
    os.sched_setaffinity(0, (all_cpus - inherited) or all_cpus)
    _original_run(self)


if not getattr(_tq.ThreadTransferQueue._run, "_affinity_patched", False):
    _run_off_the_compute_cores._affinity_patched = True  # type: ignore[attr-defined]
    _tq.ThreadTransferQueue._run = _run_off_the_compute_cores
