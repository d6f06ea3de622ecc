"""The CPU primary tier's memory: vLLM's shared ``/dev/shm`` region
(``SharedOffloadRegion``), opened after removing a stale one left by a run
that died, and ``RegionBlockPool``, this rank's slot of each region row.

Liveness is a shared ``flock`` that every process mapping the region holds;
vLLM unlinks the region only on clean shutdown.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from vllm_ascend.kv_offload.config import OffloadConfigError
from vllm_ascend.kv_offload.cpu_pool import CpuBlockPool, PoolLayout
from vllm_ascend.kv_offload.host_memory import borrowed
from vllm_ascend.kv_offload.logger import init_logger

if TYPE_CHECKING:
    from vllm_ascend.kv_offload.tiering.host_register import AclRegionRegistration

logger = init_logger(__name__)

SHM_DIR = "/dev/shm"


def region_path(engine_id: str) -> str:
    """Where vLLM's ``SharedOffloadRegion`` puts an engine's region."""
    return os.path.join(SHM_DIR, f"vllm_offload_{engine_id}.mmap")


@contextlib.contextmanager
def _shm_lock() -> Iterator[None]:
    """Serialises region creation between this package's processes."""
    fd = os.open(SHM_DIR, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def remove_stale_region(path: str) -> bool:
    """Removes ``path`` if no process holds it (every process that maps a
    region of ours holds a shared flock on it until it unmaps or dies)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live engine maps it
        os.unlink(path)
        logger.warning(
            "KV offload: removed %s, a shared region left by a run that ended "
            "without cleanup (crash or kill); this run creates its own",
            path,
        )
        return True
    finally:
        os.close(fd)


def hold_region(region: SharedOffloadRegion) -> None:
    """Marks ``region`` live for ``remove_stale_region`` (until its fd closes)."""
    if region.fd is not None:
        fcntl.flock(region.fd, fcntl.LOCK_SH)


def open_region(**kwargs: Any) -> SharedOffloadRegion:
    """``SharedOffloadRegion(**kwargs)`` after removing a stale file of the
    same name; the region is held (``hold_region``) before anyone else can
    look at it."""
    with _shm_lock():
        remove_stale_region(region_path(kwargs["engine_id"]))
        region = SharedOffloadRegion(**kwargs)
        try:
            hold_region(region)
        except OSError:
            region.cleanup()
            raise
    return region


class RegionBlockPool(CpuBlockPool):
    """Region mode of the CPU block pool: this rank's slot of each row of a
    shared region, which it does not own (``release`` frees nothing).

    ``row_bytes`` is the stride from one CPU block to the next (the region's
    row: every rank's slot, padded), as ``CopyEngine.build`` addresses rows;
    ``slot_bytes`` is what this rank uses of it.
    """

    def __init__(
        self,
        region: SharedOffloadRegion,
        page_bytes: list[int],
        blocks_per_chunk: int,
        slot_offset: int,
        slot_capacity: int,
        row_stride: int,
    ):
        layout = PoolLayout.of(
            page_bytes,
            blocks_per_chunk,
            region.num_chunks,
            slot_offset=slot_offset,
            row_bytes=row_stride,
        )
        if layout.slot_bytes > slot_capacity:
            raise OffloadConfigError(
                f"KV offload: this worker's KV of one CPU block is "
                f"{layout.slot_bytes} bytes, more than its slot of the shared "
                f"region ({slot_capacity} bytes); the KV cache layout is not "
                "one vLLM sized the region for (report this as a bug)"
            )
        # A reference, not an allocation: the region's owner unmaps it.
        super().__init__(layout, borrowed(region.base_tensor, pinned=False))
        self.region = region

    def mark_pinned(self, pinned: bool) -> None:
        """The region was (or was not) page-locked after the pool was built."""
        self.memory.pinned = pinned


def close_region(
    region: SharedOffloadRegion, registration: AclRegionRegistration | None
) -> None:
    """Unregisters the region from ACL (if it was), then unmaps it (and
    removes its file if this process created it)."""
    try:
        if registration is not None:
            registration.release()
    finally:
        region.cleanup()
