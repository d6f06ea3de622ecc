"""Our worker on a shared ``/dev/shm`` region (``region.py``), and how a
spec builds it: the region opened (created by the first worker of the host),
registered where the device's copies need it, this rank's slot of each row as
its pool (``region.slot_pool``).

Two specs build it:

* ``NPUTieringOffloadingSpec`` always (the region is vLLM's tiering primary
  tier, which its scheduler maps too);
* ``NPUOffloadingSpec`` (the guide's) when vLLM says the KV layout is
  replicated (``OffloadingConfig.replicated_layout``: MLA under tensor
  parallelism, every rank holding the same latent): rank 0 checks the one
  copy against the host's memory budget and records it in the host's
  ledger (``host_ledger``), creates the region, and every worker of the
  host maps it, rank 0's slot, which rank 0 alone writes (vLLM's connector
  gates stores on ``_is_store_writer``) and every rank loads from.

Where ranks share a slot, their start-up self-checks (which round-trip
scratch KV through the pool's first rows) take turns under an exclusive
``flock`` on the region, or one would overwrite what the other compares.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from typing_extensions import override
from vllm.v1.kv_offload.base import CanonicalKVCaches
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.region import (
    AclRegionRegistration,
    RegionMark,
    close_region,
    open_region,
    register_with_cuda,
    slot_pool,
)
from vllm_ascend.kv_offload.worker import NPUOffloadingWorker

if TYPE_CHECKING:
    from vllm_ascend.kv_offload.cpu_pool import CpuBlockPool
    from vllm_ascend.kv_offload.host_ledger import Reservation

logger = init_logger(__name__)


class RegionWorker(NPUOffloadingWorker):
    """Our worker on a shared region, which it unregisters from ACL (npu)
    and unmaps once its copies have stopped (its name, unless released
    already, is removed in any case)."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        region: SharedOffloadRegion,
        mark: RegionMark,
        pool: CpuBlockPool,
        registration: AclRegionRegistration | None = None,
        **worker_args: Any,
    ):
        """``worker_args``: ``NPUOffloadingWorker``'s other arguments."""
        self.region = region
        self.mark = mark
        self.registration = registration
        super().__init__(kv_caches, pool, **worker_args)

    @override
    def shutdown(self) -> None:
        if self._closed:
            return
        super().shutdown()
        if self.pool.released:  # copies stopped, the pool let go
            close_region(self.region, self.registration, self.mark)
        else:
            self.mark.release_name()
            logger.warning(
                "KV offload: copies still running at shutdown; the shared "
                "region %s stays mapped until the process exits",
                self.region.mmap_path,
            )


@contextlib.contextmanager
def taking_turns(region: SharedOffloadRegion) -> Iterator[None]:
    """Holds an exclusive ``flock`` on the region's file (each process
    opened it itself, so the locks exclude each other; an unlinked file
    still locks)."""
    assert region.fd is not None
    fcntl.flock(region.fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(region.fd, fcntl.LOCK_UN)


def build_region_worker(
    kv_caches: CanonicalKVCaches,
    *,
    engine_id: str,
    num_chunks: int,
    slot_rank: int,
    kv_bytes_per_chunk: int,
    slot_bytes: int,
    blocks_per_chunk: int,
    copy_path: str = "auto",
    shared_slot: bool = False,
    reserve: Callable[[], Reservation] | None = None,
    barrier: Callable[[], None] | None = None,
    piece_bytes: int | None = None,
) -> RegionWorker:
    """This worker's ``RegionWorker`` on ``engine_id``'s region of
    ``num_chunks`` rows of ``kv_bytes_per_chunk`` bytes, using slot
    ``slot_rank`` (``slot_bytes`` at ``slot_rank * slot_bytes``) of each.

    ``shared_slot``: other ranks use the same slot (a replicated layout).
    ``piece_bytes``: the ``host_piece_bytes`` setting (npu registration).
    Without ``barrier`` the first worker to open the region creates it.
    With one (every worker of the engine calls it, twice): the worker given
    ``reserve`` (the host-memory check and the ledger's record, once per
    host) creates the region, the others join it after the first call;
    after the second every worker has mapped it, or failed to, and the
    region's name is removed, so that the kernel frees the memory when the
    last process that mapped it exits, however it exits.
    """
    device = kv_caches.tensors[0].tensor.device
    kwargs = dict(
        engine_id=engine_id,
        num_chunks=num_chunks,
        rank=slot_rank,
        kv_bytes_per_chunk=kv_bytes_per_chunk,
        cpu_page_size=slot_bytes,
    )
    if barrier is None:
        region, mark = open_region(**kwargs)
        reservation = None
    else:
        region, mark, reservation = _open_in_turn(kwargs, reserve, barrier)
    registration = None
    try:
        pool = slot_pool(
            region,
            [t.page_size_bytes for t in kv_caches.tensors],
            blocks_per_chunk,
            slot_offset=slot_rank * slot_bytes,
            slot_capacity=slot_bytes,
            row_stride=kv_bytes_per_chunk,
        )
        if reservation is not None:
            pool.on_release(reservation.release)
        if device.type == "cuda":
            register_with_cuda(region, pool)
        elif device.type == "npu":
            # The NPU copy backend refuses pageable host memory.
            registration = AclRegionRegistration(region, piece_bytes=piece_bytes)
            pool.memory.pinned = True
        with taking_turns(region) if shared_slot else contextlib.nullcontext():
            worker = RegionWorker(
                kv_caches, region, mark, pool, registration, copy_path=copy_path
            )
    except BaseException:
        close_region(region, registration, mark)
        if reservation is not None:
            reservation.release()
        raise
    logger.info(
        "KV offload: worker on shared region %s (%d bytes: %d rows of %d "
        "bytes), this rank's slot %d bytes at offset %d%s",
        region.mmap_path,
        region.total_size_bytes,
        region.num_chunks,
        kv_bytes_per_chunk,
        pool.slot_bytes,
        slot_rank * slot_bytes,
        ", shared by every rank (replicated KV layout)" if shared_slot else "",
    )
    return worker


def _open_in_turn(
    kwargs: dict[str, Any],
    reserve: Callable[[], Reservation] | None,
    barrier: Callable[[], None],
) -> tuple[SharedOffloadRegion, RegionMark, Reservation | None]:
    """The two meetings of ``build_region_worker``. Every worker reaches
    both, failed or not, so that none waits for one that gave up: each
    fails on its own error."""
    opened: tuple[SharedOffloadRegion, RegionMark] | None = None
    reservation = None
    try:
        try:
            if reserve is not None:
                reservation = reserve()
                opened = open_region(**kwargs)
                # The creator has faulted the region in (vLLM populates the
                # slot it opens with): out of MemAvailable now.
                reservation.allocated()
        finally:
            barrier()
        if reserve is None:
            opened = open_region(create=False, **kwargs)
    except BaseException:
        with contextlib.suppress(Exception):
            barrier()
        if opened is not None:
            close_region(opened[0], None, opened[1])
        if reservation is not None:
            reservation.release()
        raise
    barrier()
    region, mark = opened
    mark.release_name()
    return region, mark, reservation
