"""Registering the shared region with the device runtime: with ACL as
page-locked host memory on npu (``aclrtHostRegisterV2``, compiled and
simulated only, never run on an NPU), with CUDA through vLLM's own
``pin_mmap_region`` on cuda. The CPU backend registers nothing."""

from __future__ import annotations

import time
from collections.abc import Callable

from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from vllm_ascend.kv_offload import acl_host
from vllm_ascend.kv_offload.config import TIERING_SPEC, OffloadConfigError
from vllm_ascend.kv_offload.host_pieces import (
    DEFAULT_PIECE_BYTES,
    SVM_ALIGNMENT,
    PiecePlan,
    PiecesRefused,
    describe,
    take_pieces,
)
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.region import RegionBlockPool

logger = init_logger(__name__)


class AclRegionRegistration:
    """The shared region registered with ACL as page-locked host memory, so
    that the npu copy backend accepts it (it refuses pageable memory).

    The whole mapping of this process (every rank's slots, as vLLM's CUDA
    worker does), in pieces of whole rows (``host_pieces``' rule; vLLM lays
    the rows out back to back, so no gaps), flags as ``AclRegistrar`` picks
    them. ``release`` must run after the copies have stopped and before the
    region is unmapped.
    """

    def __init__(
        self,
        region: SharedOffloadRegion,
        register: Callable[[int, int, str, int], None] | None = None,
        unregister: Callable[[int, str], None] | None = None,
        kernel_release: str | None = None,
        piece_bytes: int | None = None,
    ):
        from vllm_ascend.kv_offload import ops

        self._unregister = unregister or ops.host_unregister
        register = register or ops.host_register
        base = region.base_tensor.data_ptr()
        self.nbytes = region.total_size_bytes
        self.addresses: list[int] = []
        where = (
            f"the shared region {region.mmap_path} ({self.nbytes} bytes at {base:#x})"
        )
        release = kernel_release or acl_host.kernel_release()
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
            self.nbytes // region.num_chunks,
            piece_bytes or DEFAULT_PIECE_BYTES,
            SVM_ALIGNMENT,
            gaps=False,
        )
        registrar = acl_host.AclRegistrar(lambda a, n, f: register(a, n, "npu", f))
        t0 = time.perf_counter()
        try:
            pieces, failures = take_pieces(
                plan,
                lambda u, k: registrar(base + u * plan.stride, plan.piece_span(u, k)),
                self._unregister_one,
            )
        except PiecesRefused as e:
            raise OffloadConfigError(
                f"{TIERING_SPEC} on npu: registering {where} with ACL failed, and "
                "the NPU copy backend copies page-locked host memory only: "
                f"{e}. Fix: a CANN release with aclrtHostRegisterV2 (its 8.5 "
                "documentation has it) on an Atlas A2/A3/A5, a smaller "
                "host_piece_bytes if the runtime refuses pieces that large, a "
                "smaller region (num_cpu_blocks or cpu_bytes_to_use) if the "
                "host cannot lock that much memory, or "
                "spec_name='NPUOffloadingSpec' (a pinned private pool, no "
                "tiering)"
            ) from e
        self.addresses = [p.handle for p in pieces]
        logger.info(
            "KV offload: registered %s with ACL as %s in %s in %.2f s%s",
            where,
            registrar.kind,
            describe([p.nbytes for p in pieces]),
            time.perf_counter() - t0,
            f" (refused first: {'; '.join(failures)})" if failures else "",
        )

    def _unregister_one(self, addr: int) -> None:
        self._unregister(addr, "npu")

    def release(self) -> None:
        """Unregisters every piece (once); logs instead of raising, as it
        runs at shutdown."""
        addresses, self.addresses = self.addresses, []
        for addr in reversed(addresses):
            try:
                self._unregister_one(addr)
            except RuntimeError as e:
                logger.warning(
                    "KV offload: unregistering the shared region at %#x from "
                    "ACL failed: %s",
                    addr,
                    e,
                )


def register_with_cuda(region: SharedOffloadRegion, pool: RegionBlockPool) -> None:
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
    pool.mark_pinned(region.is_pinned)
