"""Page-locked host memory from ACL, piece by piece: ``aclrtMallocHost``
pieces, and ``aclrtHostRegisterV2`` with the flags the chip accepts. Used
for the CPU block pool (``host_memory.py``) and the shared region
(``region.py``); the rule for pieces is ``host_pieces``."""

from __future__ import annotations

import ctypes
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_ascend.kv_offload.host_pieces import PiecePlan, take_pieces
from vllm_ascend.kv_offload.logger import init_logger

logger = init_logger(__name__)

# aclrtHostRegisterV2's flags (acl_rt.h): A2/A3 register with both (as
# upstream vllm-ascend does), A5 rejects PINNED (error 107000).
ACL_HOST_REG_MAPPED = 0x2
ACL_HOST_REG_PINNED = 0x10000000

ACL_MALLOC_HOST = "aclrtMallocHost"
ACL_REGISTERED = "mmap + aclrtHostRegisterV2"
ACL_REGISTERED_MAPPED = "mmap + aclrtHostRegisterV2 (MAPPED only)"


def kernel_registers_pageable_memory(release: str) -> bool:
    """Whether ``aclrtHostRegisterV2`` may page-lock pageable memory on a
    Linux kernel of this release: the CANN documentation says that on 5.10
    and older, pageable memory "causes exceptions" and must come from
    ``aclrtMallocHost`` instead."""
    m = re.match(r"(\d+)(?:\.(\d+))?", release)
    return m is not None and (int(m[1]), int(m[2] or 0)) > (5, 10)


@dataclass(frozen=True)
class AclHostApi:
    """The four ACL host-memory calls, as functions of addresses; the native
    op's by default (``ops.host_*``). Each raises RuntimeError naming the
    ACL call and its code."""

    alloc: Callable[[int], int]  # aclrtMallocHost(size) -> addr
    free: Callable[[int], None]  # aclrtFreeHost(addr)
    register: Callable[[int, int, int], None]  # aclrtHostRegisterV2(addr, size, flags)
    unregister: Callable[[int], None]  # aclrtHostUnregister(addr)

    @classmethod
    def native(cls) -> AclHostApi:
        from vllm_ascend.kv_offload import ops

        return cls(
            alloc=lambda size: ops.host_alloc(size, "npu"),
            free=lambda addr: ops.host_free(addr, "npu"),
            register=lambda addr, size, flags: ops.host_register(
                addr, size, "npu", flags
            ),
            unregister=lambda addr: ops.host_unregister(addr, "npu"),
        )


class AclRegistrar:
    """``aclrtHostRegisterV2`` of one piece after another: MAPPED | PINNED,
    and from the first piece where PINNED is refused but MAPPED alone is
    accepted (A5), MAPPED alone. A refused piece raises RuntimeError naming
    what each flag got; a registered one returns its address (what
    ``aclrtHostUnregister`` takes)."""

    def __init__(self, register: Callable[[int, int, int], None]):
        self._register = register
        self.flags = ACL_HOST_REG_MAPPED | ACL_HOST_REG_PINNED

    def __call__(self, addr: int, size: int) -> int:
        try:
            self._register(addr, size, self.flags)
        except RuntimeError as pinned:
            if self.flags == ACL_HOST_REG_MAPPED:
                raise
            try:
                self._register(addr, size, ACL_HOST_REG_MAPPED)
            except RuntimeError as mapped:
                raise RuntimeError(f"{pinned}; MAPPED alone: {mapped}") from mapped
            self.flags = ACL_HOST_REG_MAPPED
            logger.warning(
                "KV offload: aclrtHostRegisterV2 refused ACL_HOST_REG_PINNED "
                "(%s); host memory is registered with ACL_HOST_REG_MAPPED "
                "alone from now on (as on A5)",
                pinned,
            )
        return addr

    @property
    def kind(self) -> str:
        """The kind of memory the registrations made so far give."""
        if self.flags & ACL_HOST_REG_PINNED:
            return ACL_REGISTERED
        return ACL_REGISTERED_MAPPED


def acl_malloc_units(
    plan: PiecePlan, acl: AclHostApi
) -> tuple[list[torch.Tensor], list[int]]:
    """The plan's units (int8 views of whole rows) in ``aclrtMallocHost``
    pieces, each with a gap after it so that no two pieces' rows are
    adjacent, and the bytes of each piece. Raises ``PiecesRefused`` when not
    even one unit is given. ACL frees a piece once the last view of it is
    gone."""

    def take(first_unit: int, units: int) -> torch.Tensor:
        return _acl_malloc_piece(plan.piece_allocation(first_unit, units), acl)

    pieces, failures = take_pieces(
        plan, take, lambda t: None, size_of=plan.piece_allocation
    )
    if failures:
        logger.warning(
            "KV offload: aclrtMallocHost refused a piece of the CPU block pool "
            "and took it in smaller pieces: %s",
            "; ".join(failures),
        )
    offsets = plan.unit_offsets()
    units = []
    for piece in pieces:
        for unit in range(piece.first_unit, piece.first_unit + piece.units):
            start = int(offsets[unit] - offsets[piece.first_unit])
            length = plan.rows_of_unit(unit) * plan.row_bytes
            units.append(piece.handle[start : start + length])
    return units, [p.nbytes for p in pieces]


def _acl_malloc_piece(nbytes: int, acl: AclHostApi) -> torch.Tensor:
    addr = acl.alloc(nbytes)
    # A ctypes array over the allocation gives torch a buffer to wrap; the
    # tensor's storage holds it, and ACL frees the memory once the last view
    # is gone (at release, normally), never under a view still in use.
    buffer = (ctypes.c_int8 * nbytes).from_address(addr)
    weakref.finalize(buffer, _free_logged, acl.free, addr)
    return torch.frombuffer(buffer, dtype=torch.int8)


def _free_logged(free: Callable[[int], None], addr: int) -> None:
    try:
        free(addr)
    except RuntimeError:
        logger.exception("KV offload: aclrtFreeHost(%#x) failed", addr)
