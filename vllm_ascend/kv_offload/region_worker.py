"""Our worker on a shared ``/dev/shm`` region (``region.py``), and how a
spec builds it: the region opened (created by the first worker of the
host), registered where the device's copies need it (``host_register``),
this rank's slot of each row as its pool (``RegionBlockPool``).

Two specs build it:

* ``NPUTieringOffloadingSpec`` always (the region is vLLM's tiering primary
  tier, which its scheduler maps too);
* ``NPUOffloadingSpec`` (the guide's) when vLLM says the KV layout is
  replicated (``OffloadingConfig.replicated_layout``: MLA under tensor
  parallelism, every rank holding the same latent): every worker of the
  host maps one copy, rank 0's slot, which rank 0 alone writes (vLLM's
  connector gates stores on ``_is_store_writer``) and every rank loads from.

Where ranks share a slot, their start-up self-checks (which round-trip
scratch KV through the pool's first rows) take turns under an exclusive
``flock`` on the region, or one would overwrite what the other compares.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Callable, Iterator
from typing import Any

from typing_extensions import override
from vllm.v1.kv_offload.base import CanonicalKVCaches
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from vllm_ascend.kv_offload.host_register import (
    AclRegionRegistration,
    register_with_cuda,
)
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.region import (
    RegionBlockPool,
    RegionMark,
    close_region,
    open_region,
)
from vllm_ascend.kv_offload.worker import NPUOffloadingWorker

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
        pool: RegionBlockPool,
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
    before_create: Callable[[], None] | None = None,
    barrier: Callable[[], None] | None = None,
    piece_bytes: int | None = None,
) -> RegionWorker:
    """This worker's ``RegionWorker`` on ``engine_id``'s region of
    ``num_chunks`` rows of ``kv_bytes_per_chunk`` bytes, using slot
    ``slot_rank`` (``slot_bytes`` at ``slot_rank * slot_bytes``) of each.

    ``shared_slot``: other ranks use the same slot (a replicated layout).
    ``piece_bytes``: the ``host_piece_bytes`` setting (npu registration).
    ``before_create``: called, under the lock that serialises openings,
    only by the worker that is about to create the region (the host-memory
    guard, once per host). ``barrier``: every worker of the engine calls it
    once, after mapping the region or failing to; then no one needs the
    region's name and it is removed, so that the kernel frees the memory
    when the last process that mapped it exits, however it exits.
    """
    device = kv_caches.tensors[0].tensor.device
    try:
        region, mark = open_region(
            before_create=before_create,
            engine_id=engine_id,
            num_chunks=num_chunks,
            rank=slot_rank,
            kv_bytes_per_chunk=kv_bytes_per_chunk,
            cpu_page_size=slot_bytes,
        )
    except BaseException:
        if barrier is not None:
            barrier()  # the others wait there; they fail on their own errors
        raise
    registration = None
    try:
        if barrier is not None:
            barrier()
            mark.release_name()
        pool = RegionBlockPool(
            region,
            [t.page_size_bytes for t in kv_caches.tensors],
            blocks_per_chunk,
            slot_offset=slot_rank * slot_bytes,
            slot_capacity=slot_bytes,
            row_stride=kv_bytes_per_chunk,
        )
        if device.type == "cuda":
            register_with_cuda(region, pool)
        elif device.type == "npu":
            # The NPU copy backend refuses pageable host memory.
            registration = AclRegionRegistration(region, piece_bytes=piece_bytes)
            pool.mark_pinned(True)
        turns = taking_turns(region) if shared_slot else contextlib.nullcontext()
        with turns:
            worker = RegionWorker(
                kv_caches, region, mark, pool, registration, copy_path=copy_path
            )
    except BaseException:
        close_region(region, registration, mark)
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
