"""Start-up self-check: a copy path is used only after it moved scratch KV
byte-exact, on this device, through this pool's kind of host memory.

For each candidate path, best first (``copy_paths.candidate_paths``), the
check stores scratch device blocks of the real fragment sizes into CPU
blocks of the pool (none holds KV yet at start-up; only this worker's slot
of each row is written) and loads them back into a second scratch device
buffer, through the worker's own transfer queues (its streams, or its copy
thread), and compares every byte on both sides, poison around them
included. The first path that is byte-exact is the worker's; each one that
raised, failed or moved a wrong byte is logged with what went wrong. If none
is byte-exact, ``SelfCheckFailed`` refuses offloading at start-up: never
wrong KV (the live KV cache is never touched).

``run_self_check`` is public (the ``doctor`` command calls it without a
worker). Its result carries the chosen path's copy function, bound over the
buffers the caller named: the worker copies with it as it is (on the torch
path it also holds the scratch buffers, two blocks' worth).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_ascend.kv_offload import ops
from vllm_ascend.kv_offload.copy_paths import CopyPath, Swap, candidate_paths
from vllm_ascend.kv_offload.cpu_pool import CpuBlockPool, private_pool
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.transfer_queue import TransferQueue, make_transfer_queue

logger = init_logger(__name__)

# CPU blocks the check round-trips: enough to give the batch calls several
# entries per tensor, few enough to cost little at start-up.
SCRATCH_BLOCKS = 2
POISON = 0xA5
_GAP = 64  # bytes of poison after each scratch fragment on the device
# Without a model: K and V pages of 8 layers, 64 KiB each.
DEFAULT_FRAGMENTS = (65536,) * 16
_REPORT = (
    "report it, with this message and the output of "
    "`python -m vllm_ascend.kv_offload.doctor --json`, to the vllm-ascend KV "
    "offload maintainers (docs/pool_and_self_check.md); until then run "
    "without kv_transfer_config"
)


class SelfCheckFailed(RuntimeError):
    """No copy path moved the scratch KV byte-exact: offloading is refused."""


@dataclass(frozen=True)
class PathAttempt:
    path: str
    passed: bool
    failure: str | None = None
    seconds: float = 0.0  # the two copy jobs, not the comparison
    bandwidth_gbps: float | None = None  # bytes both ways / seconds, 1e9 B/s


@dataclass(frozen=True)
class SelfCheckResult:
    device: str
    memory_kind: str  # host_memory's kind of the pool
    path: str | None  # the path chosen; None if none passed
    passed: bool
    failure: str | None  # every path's failure when none passed
    bandwidth_gbps: float | None  # of the chosen path
    bytes_per_direction: int
    seconds: float  # the whole check
    attempts: tuple[PathAttempt, ...] = field(default=())
    # The chosen path's copy function, bound over the caller's buffers (and
    # the scratch ones); None if none passed.
    swap: Swap | None = field(default=None, repr=False, compare=False)

    def figures(self) -> str:
        """What the chosen path measured (the doctor's line, the worker's)."""
        return (
            f"{self.bytes_per_direction} bytes each way, {self.bandwidth_gbps:.2f} "
            f"GB/s, {self.memory_kind} host memory, {self.seconds * 1e3:.0f} ms"
        )

    def summary(self) -> str:
        if self.passed:
            return f"passed on path {self.path} ({self.figures()})"
        return f"FAILED: {self.failure}"


@dataclass
class _Scratch:
    """Scratch device buffers and where each fragment goes."""

    src: torch.Tensor  # uint8, random
    dst: torch.Tensor  # uint8, poisoned before each attempt
    dev_off: np.ndarray  # int64 [F], offset of fragment f in src and dst
    host_addr: np.ndarray  # int64 [F], its address in the pool
    sizes: np.ndarray  # int64 [F]
    host: list[np.ndarray]  # [F] numpy views of the fragments in the pool


def _scratch(device: torch.device, pool: CpuBlockPool, fragment_sizes, blocks):
    sizes = np.asarray(fragment_sizes, dtype=np.int64)
    # Block b of tensor t: pool row b, the tensor's first page (the engine's
    # addressing).
    rows = pool.row_addresses(np.arange(blocks, dtype=np.int64))
    host_addr = (rows[:, None] + pool.tensor_offsets[None, :]).ravel()
    frag_sizes = np.broadcast_to(sizes[None, :], (blocks, len(sizes))).ravel()
    # A gap of poison after each fragment on the device, so that nothing
    # merges (as with scattered KV blocks) and a copy that runs over shows.
    ends = np.cumsum(frag_sizes + _GAP)
    dev_off = ends - frag_sizes - _GAP
    total = int(ends[-1])
    rng = np.random.default_rng(20261202)
    src = torch.from_numpy(rng.integers(0, 256, total, dtype=np.uint8)).to(device)
    dst = torch.empty(total, dtype=torch.uint8, device=device)
    offsets = pool.tensor_offsets.tolist()
    host = []
    for b in range(blocks):  # row by row: rows may sit in different pieces
        row = pool.row(b).view(torch.uint8).numpy()
        host += [row[o : o + n] for o, n in zip(offsets, sizes.tolist(), strict=True)]
    return _Scratch(src, dst, dev_off, host_addr, frag_sizes.copy(), host)


def _run_job(queue: TransferQueue, job_id: int, copy) -> str | None:
    """Runs one copy job on ``queue``; its failure, or None."""
    raised: list[BaseException] = []

    def job():
        try:
            return copy()
        except BaseException as e:
            raised.append(e)
            raise

    try:
        queue.submit(job_id, job)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    queue.wait({job_id})
    # Waited for, so finished (nothing else runs on these queues yet).
    (done,) = [j for j in queue.poll() if j.job_id == job_id]
    if raised:
        return f"{type(raised[0]).__name__}: {raised[0]}"
    if not done.success:
        return "the copy job failed on its stream (see the error logged above)"
    return None


def _compare(wants, gots, offsets, where: str) -> str | None:
    """None if each fragment ``gots[i]`` holds ``wants[i]``; else how many
    bytes are wrong, and the first (in the fragment at ``offsets[i]``: an
    address in the pool, an offset on the device). (numpy: torch's CPU ops
    on many small slices pay thread-pool overhead, seconds on a busy host.)"""
    wrong, first = 0, None
    for want, got, offset in zip(wants, gots, offsets, strict=True):
        if np.array_equal(want, got):
            continue
        bad = np.flatnonzero(want != got)
        wrong += len(bad)
        if first is None:
            i = int(bad[0])
            first = (
                f"byte {i} of the fragment at {offset:#x} (got {int(got[i])}, "
                f"expected {int(want[i])})"
            )
    if not wrong:
        return None
    return f"{wrong} wrong bytes in the {where}, the first {first}"


def _attempt(
    path: CopyPath, s: _Scratch, pool: CpuBlockPool, queues, buffers
) -> tuple[PathAttempt, Swap | None]:
    assert not pool.released
    for view in s.host:
        view[:] = POISON
    s.dst.fill_(POISON)
    try:
        swap = path.bind([*buffers, s.src, s.dst, *pool.tensors])
    except Exception as e:
        return PathAttempt(path.name, False, f"{type(e).__name__}: {e}"), None
    src_dev = s.src.data_ptr() + s.dev_off
    dst_dev = s.dst.data_ptr() + s.dev_off
    store = [torch.from_numpy(a) for a in (src_dev, s.host_addr, s.sizes)]
    load = [torch.from_numpy(a) for a in (s.host_addr, dst_dev, s.sizes)]
    store_q, load_q = queues
    t0 = time.perf_counter()
    failure = _run_job(store_q, -1, lambda: swap(*store))
    if failure is None:
        failure = _run_job(load_q, -2, lambda: swap(*load))
    seconds = time.perf_counter() - t0
    if failure is None:
        failure = _verify(s)
    if failure is not None:
        return PathAttempt(path.name, False, failure, seconds), None
    moved = 2 * int(s.sizes.sum())
    gbps = moved / max(seconds, 1e-9) / 1e9
    return PathAttempt(path.name, True, None, seconds, gbps), swap


def _verify(s: _Scratch) -> str | None:
    """What the store and the load got wrong, or None."""
    src = s.src.cpu().numpy()
    dst = s.dst.cpu().numpy()
    frags = list(zip(s.dev_off.tolist(), s.sizes.tolist(), strict=True))
    wants = [src[o : o + n] for o, n in frags]
    host = s.host_addr.tolist()
    if failure := _compare(wants, s.host, host, "CPU pool after the store"):
        return failure
    # Device side: every fragment back, the poison after it untouched.
    gots = [dst[o : o + n] for o, n in frags]
    dev = s.dev_off.tolist()
    if failure := _compare(wants, gots, dev, "device buffer after the load"):
        return failure
    for o, n in frags:
        if not (dst[o + n : o + n + _GAP] == POISON).all():
            return f"the load wrote past the fragment at device offset {o}"
    return None


def run_self_check(
    device: torch.device | str,
    fragment_sizes: Sequence[int] = DEFAULT_FRAGMENTS,
    *,
    pool: CpuBlockPool | None = None,
    paths: Sequence[CopyPath] | None = None,
    queues: tuple[TransferQueue, TransferQueue] | None = None,
    buffers: Sequence[torch.Tensor] = (),
) -> SelfCheckResult:
    """Round-trips ``SCRATCH_BLOCKS`` scratch CPU blocks of ``fragment_sizes``
    (bytes of each tensor's page) through each path until one is byte-exact.

    ``pool``: the pool to check, with its layout (its first ``SCRATCH_BLOCKS``
    CPU blocks are overwritten: call it before any is stored); None: a scratch
    pool from the same factory, released afterwards. ``paths``: the order to
    try (default: ``candidate_paths(device)``). ``queues``: the
    (store, load) transfer queues to run on (default: fresh ones, shut down
    afterwards). ``buffers``: what else the chosen path's copy function
    (``result.swap``) must reach, e.g. the KV caches (the torch path copies
    between views of known buffers). Never raises for a failed path: the
    result says.
    """
    device = torch.device(device)
    t0 = time.perf_counter()
    attempts: list[PathAttempt] = []
    swap = None
    with contextlib.ExitStack() as cleanup:
        if pool is None:
            pool = private_pool(list(fragment_sizes), 1, SCRATCH_BLOCKS, device.type)
            cleanup.callback(pool.release)
        if queues is None:
            queues = tuple(
                make_transfer_queue(device, f"self-check-{kind}")
                for kind in ("store", "load")
            )
            for q in queues:
                cleanup.callback(q.shutdown)
        blocks = min(SCRATCH_BLOCKS, pool.num_blocks)
        scratch = _scratch(device, pool, fragment_sizes, blocks)
        for path in candidate_paths(device.type) if paths is None else paths:
            attempt, swap = _attempt(path, scratch, pool, queues, buffers)
            attempts.append(attempt)
            if attempt.passed:
                break
            logger.warning(
                "KV offload self-check: copy path %s is NOT byte-exact on %s: "
                "%s; trying the next one",
                path.name,
                device,
                attempt.failure,
            )
    chosen = attempts[-1] if attempts and attempts[-1].passed else None
    failure = None
    if chosen is None:
        failure = "; ".join(f"{a.path}: {a.failure}" for a in attempts) or (
            "no copy path to try"
        )
    return SelfCheckResult(
        device=str(device),
        memory_kind=pool.memory.kind,
        path=chosen.path if chosen else None,
        passed=chosen is not None,
        failure=failure,
        bandwidth_gbps=chosen.bandwidth_gbps if chosen else None,
        bytes_per_direction=int(scratch.sizes.sum()),
        seconds=time.perf_counter() - t0,
        attempts=tuple(attempts),
        swap=swap if chosen else None,
    )


# What a worker runs as its self-check (``run_self_check``; a test's own).
SelfCheck = Callable[..., SelfCheckResult]


def choose_copy_path(
    device: torch.device,
    fragment_sizes: Sequence[int],
    setting: str,
    *,
    pool: CpuBlockPool,
    queues: tuple[TransferQueue, TransferQueue],
    buffers: Sequence[torch.Tensor],
    check: SelfCheck = run_self_check,
) -> SelfCheckResult:
    """A worker's copy path, before it serves: ``check`` run on the
    candidates for the ``copy_path`` ``setting``, on the worker's own pool,
    (store, load) queues and ``buffers``. Warns where a device falls back to
    the torch path for want of a native op, and logs the choice; raises
    ``refusal`` when no path passed."""
    paths = candidate_paths(device.type, setting)
    if not paths[0].native and setting != "torch":
        logger.warning(
            "KV offload: no native copy op for %s here (%s); copies use the torch path",
            device.type,
            "vLLM's swap_blocks_batch is not registered"
            if device.type == "cuda"
            else ops.fallback_reason()
            or f"compiled backends: {', '.join(ops.native_backends())}",
        )
    result = check(
        device, fragment_sizes, pool=pool, paths=paths, queues=queues, buffers=buffers
    )
    if not result.passed:
        raise refusal(result)
    # The one line that says which path serves (run_self_check logs none).
    logger.info(
        "KV offload: copy path %s on %s (self-check: %s)",
        result.path,
        device,
        result.figures(),
    )
    return result


def refusal(result: SelfCheckResult) -> SelfCheckFailed:
    """The start-up error for a self-check that no path passed."""
    native = f"native op backends: {', '.join(ops.native_backends()) or 'none'}"
    return SelfCheckFailed(
        f"KV offload: start-up self-check failed on {result.device}: no copy "
        f"path moved scratch KV byte-exact between the device and "
        f"{result.memory_kind} host memory ({native}): {result.failure}. "
        f"Offloading is refused so that no wrong KV is ever used; {_REPORT}"
    )
