"""A CPU pool shared by the workers of one host: vLLM's ``/dev/shm`` region
(``SharedOffloadRegion``) and ``slot_pool``, this rank's slot of each
region row; its registration with the device runtime where the copies need
it (``AclRegionRegistration``, ``register_with_cuda``); and the region's
lifetime. The tiering spec's primary tier
lives in one, and the guide's spec stores a replicated KV layout (MLA under
tensor parallelism) in one (``region_worker.py``).

vLLM names a region after its engine id (``vllm_offload_<engine_id>.mmap``)
and removes it only in the creating worker's ``cleanup``, which ``vllm
serve``'s default ``--shutdown-timeout 0`` never lets run (the engine core
and the worker are force-killed), nor does a crash or SIGKILL. Every start
has a new engine id, so each such stop used to leave a region the pool's
size in ``/dev/shm`` until starts failed for want of space. Here:

* The name lives only while a process is still to map it. The workers map
  the region first (``open_region``, the first one creating it), the
  scheduler's tiering manager last (vLLM builds the scheduler after every
  worker registered its KV caches); once the manager has joined it,
  ``RegionMark.release_name`` unlinks it: the kernel frees the memory when
  the last mapping goes, however the processes end. Where the name was not
  released (a worker without our scheduler on its host), the first of its
  processes to close the region unlinks it, as vLLM's creator did. The
  guide's spec, whose scheduler maps nothing, releases it as soon as every
  worker has mapped the region (a barrier of all workers, as vLLM's CPU
  spec does).
* A mark of ours beside each region, ``vllm_ascend_offload_<engine_id>.lock``,
  on which every process that opens the region through this module holds a
  shared ``flock`` until it closes the region or dies; the mark goes with
  the name. vLLM on CUDA names its regions the same way and marks none, so
  a region without our mark is never touched.
* Every opening first sweeps (``sweep_dead_regions``): each mark no process
  holds, whatever its engine id, is a start that died before its name was
  released; the mark and its region are removed. Only this user's regular
  files are removed (``/dev/shm`` is world-writable).

Creation, joining and the sweep are serialised by ``shm_marks.dir_lock``.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from vllm_ascend.kv_offload import acl_host, vllm_compat
from vllm_ascend.kv_offload.config import TIERING_SPEC, OffloadConfigError
from vllm_ascend.kv_offload.cpu_pool import CpuBlockPool, PoolLayout
from vllm_ascend.kv_offload.host_memory import borrowed, register_pieces
from vllm_ascend.kv_offload.host_pieces import (
    DEFAULT_PIECE_BYTES,
    SVM_ALIGNMENT,
    PiecePlan,
    describe,
)
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.shm_marks import (
    SHM_DIR,
    dir_lock,
    is_users_file,
    open_held,
    sweep_marks,
)

logger = init_logger(__name__)

REGION_PREFIX, REGION_SUFFIX = "vllm_offload_", ".mmap"  # vLLM's names
MARK_PREFIX, MARK_SUFFIX = "vllm_ascend_offload_", ".lock"  # ours


def region_path(engine_id: str) -> str:
    """Where vLLM's ``SharedOffloadRegion`` puts an engine's region."""
    return os.path.join(SHM_DIR, f"{REGION_PREFIX}{engine_id}{REGION_SUFFIX}")


def mark_path(engine_id: str) -> str:
    """Our mark beside that region."""
    return os.path.join(SHM_DIR, f"{MARK_PREFIX}{engine_id}{MARK_SUFFIX}")


def sweep_dead_regions() -> None:
    """Removes every region of ours whose processes are all gone (its mark
    unlocked) and the mark. Call it under ``dir_lock``."""

    def remove_region(engine_id: str) -> None:
        region = region_path(engine_id)
        if is_users_file(region):
            os.unlink(region)
            logger.warning(
                "KV offload: removed %s, a shared region left by a run that "
                "ended without cleanup (killed while starting)",
                region,
            )

    sweep_marks(SHM_DIR, MARK_PREFIX, MARK_SUFFIX, remove_region)


class RegionMark:
    """This process's hold on our mark of ``engine_id``'s region: a shared
    ``flock`` on the mark (created if missing), until ``close``."""

    def __init__(self, engine_id: str):
        self.region_path = region_path(engine_id)
        self.path = mark_path(engine_id)
        # Whether the region was there before this process opened it.
        self.region_existed = os.path.exists(self.region_path)
        if self.region_existed and not os.path.exists(self.path):
            raise OffloadConfigError(
                f"KV offload: {self.region_path} exists and is not a region of "
                f"this package (no {self.path} beside it): another program "
                f"uses engine id {engine_id!r}. Give this engine another "
                "kv_transfer_config engine_id (or leave it unset), or remove "
                "the file if no process uses it"
            )
        self.fd: int | None = open_held(self.path)

    def release_name(self) -> None:
        """Unlinks the region and the mark, unless the mark there is no
        longer the one this process holds (released already)."""
        if self.fd is None:
            return
        held = os.fstat(self.fd)
        try:
            there = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not os.path.samestat(there, held):
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.region_path)
            logger.info(
                "KV offload: unlinked %s (mapped by every process that uses "
                "it; the kernel frees it when the last one exits)",
                self.region_path,
            )
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def hold_mark(engine_id: str) -> RegionMark:
    """``RegionMark`` after a sweep, for a process about to map the region
    through vLLM (the scheduler's tiering manager)."""
    with dir_lock():
        sweep_dead_regions()
        return RegionMark(engine_id)


def open_region(
    create: bool = True, **kwargs: Any
) -> tuple[SharedOffloadRegion, RegionMark]:
    """``SharedOffloadRegion(**kwargs)`` after a sweep, held by its mark
    before anyone else can look at it. vLLM's own unlink at ``cleanup`` is
    turned off: ``close_region`` releases the name (if no one did).
    ``create=False``: join the region only; if it is not there, raise
    (another worker was to create it)."""
    with dir_lock():
        sweep_dead_regions()
        mark = RegionMark(kwargs["engine_id"])
        try:
            if not create and not mark.region_existed:
                raise OffloadConfigError(
                    f"KV offload: {mark.region_path}, the CPU pool this worker "
                    "shares with rank 0 of its engine, does not exist: rank 0 "
                    "did not create it (its error says why)"
                )
            region = SharedOffloadRegion(**kwargs)
        except BaseException:
            if not mark.region_existed:
                mark.release_name()
            mark.close()
            raise
        vllm_compat.disown_region(region)
    return region, mark


def slot_pool(
    region: SharedOffloadRegion,
    page_bytes: list[int],
    blocks_per_chunk: int,
    slot_offset: int,
    slot_capacity: int,
    row_stride: int,
) -> CpuBlockPool:
    """The CPU block pool of region mode: this rank's slot of each row of a
    shared region, which it does not own (``release`` frees nothing).

    ``row_stride`` is the stride from one CPU block to the next (the
    region's row: every rank's slot, padded), the pool's ``row_bytes`` as
    ``CopyEngine.build`` addresses rows; its ``slot_bytes`` is what this
    rank uses of it. Pageable until the region is registered
    (``register_with_cuda``, ``AclRegionRegistration``).
    """
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
    return CpuBlockPool(layout, borrowed(region.base_tensor, pinned=False))


class AclRegionRegistration:
    """The shared region registered with ACL as page-locked host memory, so
    that the npu copy backend accepts it (it refuses pageable memory).

    The whole mapping of this process (every rank's slots, as vLLM's CUDA
    worker does), in pieces of whole rows (``host_pieces``' rule; vLLM lays
    the rows out back to back, so no gaps), flags as ``AclRegistrar`` picks
    them. ``release`` must run after the copies have stopped and before the
    region is unmapped.
    """

    def __init__(self, region: SharedOffloadRegion, piece_bytes: int | None = None):
        nbytes = region.total_size_bytes
        where = (
            f"the shared region {region.mmap_path} ({nbytes} bytes at "
            f"{region.base_tensor.data_ptr():#x})"
        )
        release = os.uname().release
        if not acl_host.kernel_registers_pageable_memory(release):
            raise OffloadConfigError(
                f"{TIERING_SPEC} on npu needs {where} registered with ACL as "
                "page-locked memory, which CANN supports for pageable memory "
                f"on Linux kernels newer than 5.10 only (this one is "
                f"{release}); use spec_name='NPUOffloadingSpec' (a pinned "
                "private pool) on this host, or a newer kernel"
            )
        plan = PiecePlan.of(
            region.num_chunks,
            nbytes // region.num_chunks,
            piece_bytes or DEFAULT_PIECE_BYTES,
            SVM_ALIGNMENT,
            gaps=False,
        )
        acl = acl_host.AclHostApi.native()
        registrar = acl_host.AclRegistrar(acl.register)
        # The pool's own rule and release (``host_memory.register_pieces``)
        # over the region, which stays its owner's to unmap.
        self.memory = borrowed(region.base_tensor, pinned=False)
        t0 = time.perf_counter()
        refused = register_pieces(
            self.memory, plan, registrar, acl.unregister, "aclrtHostRegisterV2", where
        )
        if refused:
            raise OffloadConfigError(
                f"{TIERING_SPEC} on npu: registering {where} with ACL failed, and "
                "the NPU copy backend copies page-locked host memory only: "
                f"{'; '.join(refused)}. Fix: a CANN release with "
                "aclrtHostRegisterV2 (its 8.5 documentation has it) on an Atlas "
                "A2/A3/A5, a smaller host_piece_bytes if the runtime refuses "
                "pieces that large, a smaller region (num_cpu_blocks or "
                "cpu_bytes_to_use) if the host cannot lock that much memory, or "
                "spec_name='NPUOffloadingSpec' (a pinned private pool, no "
                "tiering)"
            )
        logger.info(
            "KV offload: registered %s with ACL as %s in %s in %.2f s",
            where,
            registrar.kind,
            describe(list(self.memory.piece_bytes)),
            time.perf_counter() - t0,
        )

    def release(self) -> None:
        """Unregisters every piece (once); logs instead of raising, as it
        runs at shutdown."""
        self.memory.release()


def register_with_cuda(region: SharedOffloadRegion, pool: CpuBlockPool) -> None:
    """cudaHostRegister the region exactly as vLLM's CUDA worker does: its
    ``pin_mmap_region`` (row-aligned chunks of at most 64 GiB, rolled back on
    failure, where vLLM pins memory at all). The region's ``cleanup`` then
    unregisters the chunks (vLLM's ``host_unregister``) before it unmaps.
    A failure leaves the region pageable, which the cuda backend copies too
    (slower)."""
    from vllm.utils.torch_utils import PIN_MEMORY
    from vllm.v1.kv_offload.cpu.gpu_worker import pin_mmap_region

    if PIN_MEMORY:
        pin_mmap_region(region)
    pool.memory.pinned = region.is_pinned


def close_region(
    region: SharedOffloadRegion,
    registration: AclRegionRegistration | None,
    mark: RegionMark,
) -> None:
    """Unregisters the region from ACL (if it was), unmaps it, then removes
    its name if no one did."""
    try:
        if registration is not None:
            registration.release()
    finally:
        try:
            region.cleanup()
        finally:
            mark.release_name()
            mark.close()
