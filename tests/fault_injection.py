"""TEST ONLY: transfer jobs that fail, or run slowly, on purpose.

Not part of the package: engines load it through a spec of its own,
``FaultInjectingOffloadingSpec`` (``spec_module_path:
"tests.fault_injection"``), whose worker wraps each job's copy
(``NPUOffloadingWorker.copy_job``). Faults are chosen by
``VLLM_ASCEND_KV_OFFLOAD_FAULTS``, read when the worker is built (in the
engine's worker process), or by a test that sets ``worker.faults``. Slow
copies likewise: ``VLLM_ASCEND_KV_OFFLOAD_COPY_DELAYS`` or ``worker.delays``
(``parse_delays``), for the bounded wait of CPU hits (``load_wait.py``).
"""

from __future__ import annotations

import ctypes
import os
import random
import threading
import time

import torch

from vllm_ascend.kv_offload.copy_engine import Descriptors
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.npu import NPUOffloadingSpec
from vllm_ascend.kv_offload.transfer_queue import CopyFn
from vllm_ascend.kv_offload.worker import NPUOffloadingWorker

logger = init_logger(__name__)

FAULTS_ENV = "VLLM_ASCEND_KV_OFFLOAD_FAULTS"
FAULTS_LOG_ENV = "VLLM_ASCEND_KV_OFFLOAD_FAULTS_LOG"
DELAYS_ENV = "VLLM_ASCEND_KV_OFFLOAD_COPY_DELAYS"
FAULT_KINDS = (
    "store",
    "load",
    "expedited_load",
    "store_submit",
    "load_submit",
    "expedited_load_submit",
)
# What a failed copy leaves behind in the injected faults: recognisably wrong
# bytes, so that using them would change the model's output.
GARBAGE_BYTE = 0x5A


class FaultInjector:
    """TEST ONLY: makes chosen transfer jobs fail, to exercise failure handling.

    Off unless ``VLLM_ASCEND_KV_OFFLOAD_FAULTS`` is set when this module is
    first imported (``FAULTS`` below), or a test passes one to the worker.
    The value is a comma-separated list of ``KIND:PROBABILITY[:MAX_COUNT]``
    and an optional ``seed:N``, e.g. ``"load:0.5,store:1:3,seed:7"``:

    * ``store``, ``load``: the job's copy runs, then its destination is
      overwritten with garbage (host memory only, so on the CPU backend) and
      the job raises on the copy thread or stream: a copy that failed half-way.
    * ``expedited_load``: the same, for expedited loads only (vLLM >= 0.33's
      synchronous loads); ``load`` covers regular loads.
    * ``store_submit``, ``load_submit``, ``expedited_load_submit``: submitting
      the job raises.

    ``MAX_COUNT`` caps how many faults of that kind are injected. With
    ``VLLM_ASCEND_KV_OFFLOAD_FAULTS_LOG=PATH`` each injected fault appends a
    line ``KIND JOB_ID`` to PATH, so a test in another process can count them.
    """

    def __init__(
        self,
        rates: dict[str, tuple[float, int | None]],
        seed: int = 0,
        log_path: str | None = None,
    ):
        unknown = set(rates) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(
                f"{FAULTS_ENV}: unknown fault kind(s) {sorted(unknown)}; "
                f"use {', '.join(FAULT_KINDS)}"
            )
        self.rates = rates
        self.rng = random.Random(seed)
        self.log_path = log_path
        self.injected: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, spec: str, log_path: str | None = None) -> FaultInjector:
        rates: dict[str, tuple[float, int | None]] = {}
        seed = 0
        for item in filter(None, (p.strip() for p in spec.split(","))):
            kind, *values = item.split(":")
            try:
                if kind == "seed" and len(values) == 1:
                    seed = int(values[0])
                    continue
                if len(values) not in (1, 2):
                    raise ValueError(item)
                rate = float(values[0])
                limit = int(values[1]) if len(values) == 2 else None
            except ValueError:
                raise ValueError(
                    f"{FAULTS_ENV}={spec!r}: cannot read {item!r}; write "
                    "KIND:PROBABILITY[:MAX_COUNT] or seed:N, e.g. load:0.5,store:1"
                ) from None
            rates[kind] = (rate, limit)
        return cls(rates, seed=seed, log_path=log_path)

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        spec = os.environ.get(FAULTS_ENV)
        if not spec:
            return None
        faults = cls.parse(spec, os.environ.get(FAULTS_LOG_ENV))
        logger.warning(
            "KV offload: TEST fault injection is on: %s=%s", FAULTS_ENV, spec
        )
        return faults

    def _draw(self, kind: str, job_id: int) -> bool:
        rate, limit = self.rates.get(kind, (0.0, None))
        with self._lock:  # copy threads draw at once: the cap holds for all
            count = sum(k == kind for k, _ in self.injected)
            if rate <= 0 or (limit is not None and count >= limit):
                return False
            if self.rng.random() >= rate:
                return False
            self.injected.append((kind, job_id))
            if self.log_path:
                with open(self.log_path, "a") as f:
                    f.write(f"{kind} {job_id}\n")
        return True

    def apply(
        self,
        direction: str,
        job_id: int,
        desc: Descriptors,
        copy: CopyFn,
        host_destination: bool,
    ) -> CopyFn:
        """The job's copy function, possibly replaced by a failing one.

        ``host_destination``: whether ``desc.dst`` is host memory, which the
        failing copy can then overwrite with garbage.
        """
        if self._draw(f"{direction}_submit", job_id):
            raise RuntimeError(f"injected fault: {direction} job {job_id} at submit")
        if not self._draw(direction, job_id):
            return copy

        def failing_copy() -> None:
            _, workspace = copy()
            if workspace.numel():
                # Enqueued device copies may still read the workspace, which
                # the raise below drops: let them finish first.
                torch.accelerator.current_stream().synchronize()
            if host_destination:
                _scribble(desc)
            raise RuntimeError(f"injected fault: {direction} job {job_id} copy")

        return failing_copy


def _scribble(desc: Descriptors) -> None:
    # Test-only path: one memset per fragment is fine here.
    for addr, size in zip(desc.dst.tolist(), desc.sizes.tolist(), strict=True):
        ctypes.memset(addr, GARBAGE_BYTE, size)


def inject_faults(worker: NPUOffloadingWorker, faults: FaultInjector | None) -> None:
    """Passes each later job of ``worker`` (any of our workers, the tiering
    one included) through ``faults``; ``None`` stops injecting. For in-process
    engines, whose worker a test can reach, e.g. to change the seed between
    rounds of one engine."""
    if not isinstance(worker, FaultInjectingWorker):
        plain_copy_job = worker.copy_job

        def copy_job(kind: str, job_id: int, desc: Descriptors) -> CopyFn:
            return _faulty(
                worker, kind, job_id, desc, plain_copy_job(kind, job_id, desc)
            )

        worker.copy_job = copy_job  # type: ignore[method-assign]
    worker.faults = faults  # type: ignore[attr-defined]


def _faulty(
    worker: NPUOffloadingWorker, kind: str, job_id: int, desc: Descriptors, copy: CopyFn
) -> CopyFn:
    faults: FaultInjector | None = getattr(worker, "faults", None)
    if faults is None:
        return copy
    host_destination = kind == "store" or worker.device.type == "cpu"
    return faults.apply(kind, job_id, desc, copy, host_destination)


def parse_delays(spec: str) -> dict[str, float]:
    """``"store:0.5,load:0.1"``: seconds each copy job of that kind (see
    ``FAULT_KINDS``: store, load, expedited_load) sleeps on its copy thread
    or before its stream work is queued, before copying."""
    delays = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, seconds = item.partition(":")
        if kind not in FAULT_KINDS[:3]:
            raise ValueError(
                f"{DELAYS_ENV}={spec!r}: unknown kind {kind!r}; write KIND:SECONDS "
                "with KIND one of store, load, expedited_load"
            )
        delays[kind] = float(seconds)
    return delays


def _slowed(copy: CopyFn, seconds: float) -> CopyFn:
    def slow_copy() -> object:
        time.sleep(seconds)
        return copy()

    return slow_copy


class FaultInjectingWorker(NPUOffloadingWorker):
    """Our worker, with each job's copy passed through ``self.faults`` and
    slowed by ``self.delays``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults: FaultInjector | None = FaultInjector.from_env()
        self.delays = parse_delays(os.environ.get(DELAYS_ENV, ""))
        if self.delays:
            logger.warning("KV offload: TEST copy delays: %s", self.delays)

    def copy_job(self, kind: str, job_id: int, desc: Descriptors) -> CopyFn:
        copy = _faulty(self, kind, job_id, desc, super().copy_job(kind, job_id, desc))
        delay = getattr(self, "delays", {}).get(kind)
        return _slowed(copy, delay) if delay else copy


class FaultInjectingOffloadingSpec(NPUOffloadingSpec):
    worker_cls = FaultInjectingWorker
