"""Where the CPU block pool's memory comes from: exactly the rows asked
for, in pieces (``host_pieces.py``), in the kind of memory the device's
copies accept, released by its owner.

Not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator
rounds each allocation up to a power of two (PyTorch issue #150517; vLLM
moved its own pool to mmap + ``cudaHostRegister`` for it), so a 10 GiB pool
could take 16 GiB behind the host-memory guard's back.

* ``cpu``: an anonymous private mmap (pageable), its units faulted in at
  start-up so that the first store into a block does not pay for its page
  faults (``populate``: on the cores the engine leaves free).
* ``cuda``: the same mmap, page-locked piece by piece with
  ``cudaHostRegister`` through vLLM's ``host_register`` (where vLLM has it,
  else torch's cudart binding); left pageable if that fails (the cuda backend
  copies pageable memory too, slower).
* ``npu``: ``aclrtMallocHost`` piece by piece first: the memory torch_npu's
  own pinned allocator hands out, documented for every kernel. If the
  runtime refuses it, and only on Linux newer than 5.10 (CANN: pageable
  memory registered on older kernels "causes exceptions"), the mmap (64
  KiB-aligned) registered piece by piece with ``aclrtHostRegisterV2``,
  MAPPED | PINNED, or MAPPED alone where PINNED is refused (A5). If both
  fail: pageable memory, said loudly; the native npu backend refuses it, so
  the start-up self-check picks the torch path (or refuses to offload).

A refused piece is retried smaller before any of this falls back
(``host_pieces.take_pieces``). Every ``HostMemory`` knows what it is
(``kind``, ``pinned``, ``pieces``) and how to give itself back
(``release``); memory someone else allocated (``borrowed``: a shared
region) is its owner's to free.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vllm_ascend.kv_offload.acl_host import (
    ACL_MALLOC_HOST,
    AclHostApi,
    AclRegistrar,
    acl_malloc_units,
    kernel_registers_pageable_memory,
)
from vllm_ascend.kv_offload.host_pieces import (
    DEFAULT_PIECE_BYTES,
    PAGE_BYTES,
    SVM_ALIGNMENT,
    PiecePlan,
    PiecesRefused,
    take_pieces,
)
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.populate import populate

logger = init_logger(__name__)


PAGEABLE = "pageable mmap"
CUDA_REGISTERED = "mmap + cudaHostRegister"
BORROWED = "borrowed"


@dataclass
class HostMemory:
    """Host memory of ``nbytes`` bytes of rows, as ``units``: int8 tensors,
    each a whole number of rows (``host_pieces``), until ``release``.
    ``kind`` says where it came from (the constants above, ``acl_host``'s
    on npu); ``pieces`` how many allocations (or registrations) it is made
    of, ``piece_bytes`` their sizes."""

    units: list[torch.Tensor]
    nbytes: int
    kind: str
    pinned: bool
    _release: Callable[[], None] | None = field(default=None, repr=False)
    pieces: int = 1
    piece_bytes: tuple[int, ...] = ()

    def release(self) -> None:
        """Gives the memory back (once); no copy may use it afterwards.
        Logs instead of raising: it runs at shutdown."""
        release, self._release = self._release, None
        self.units = []
        if release is None:
            return
        try:
            release()
        except Exception:
            logger.exception(
                "KV offload: releasing %d bytes of %s host memory failed",
                self.nbytes,
                self.kind,
            )


def borrowed(tensor: torch.Tensor, pinned: bool) -> HostMemory:
    """Memory another component owns (e.g. a shared region): releasing it
    frees nothing."""
    return HostMemory(
        [tensor], tensor.numel() * tensor.element_size(), BORROWED, pinned
    )


def allocate_host_memory(
    num_rows: int,
    row_bytes: int,
    device_type: str,
    *,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
    acl: AclHostApi | None = None,
    kernel: str | None = None,
) -> HostMemory:
    """``num_rows`` rows of ``row_bytes`` of host memory, in pieces of at most
    ``piece_bytes``, for a pool that ``device_type`` copies to and from (see
    the module docstring). ``acl`` and ``kernel`` replace the ACL calls and
    the kernel release (tests drive a simulated ACL runtime). Raises
    MemoryError naming the size when not even pageable memory fits."""
    align = SVM_ALIGNMENT if device_type == "npu" else PAGE_BYTES
    plan = PiecePlan.of(num_rows, row_bytes, piece_bytes, align)
    if device_type == "npu":
        memory = _npu_memory(plan, acl or AclHostApi.native(), kernel)
    else:
        memory = _mmap_memory(plan)
        if device_type == "cuda":
            register, unregister = _cuda_register_fns()
            refused = register_pieces(
                memory, plan, register, unregister, "cudaHostRegister"
            )
            if refused:
                logger.warning(
                    "KV offload: cudaHostRegister of the CPU block pool (%d "
                    "bytes) failed (%s); it stays pageable (slower copies)",
                    plan.row_span,
                    "; ".join(refused),
                )
            else:
                memory.kind = CUDA_REGISTERED
    return memory


def _mmap_memory(plan: PiecePlan) -> HostMemory:
    """An anonymous private mapping holding the plan's units (gaps between
    them untouched), each unit faulted in now. One piece until registered."""
    pad = plan.align - PAGE_BYTES if plan.align > PAGE_BYTES else 0
    try:
        region = mmap.mmap(
            -1,
            plan.span + pad,
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
    except (OSError, OverflowError) as e:
        raise MemoryError(
            f"KV offload: mapping {plan.span} bytes of host memory failed ({e})"
        ) from e
    whole = torch.frombuffer(region, dtype=torch.int8)
    first = -whole.data_ptr() % plan.align
    units = []
    try:
        for unit, offset in enumerate(plan.unit_offsets().tolist()):
            start, length = first + offset, plan.rows_of_unit(unit) * plan.row_bytes
            # One unit at a time, never the gaps between them.
            populate(whole.data_ptr() + start, length)
            units.append(whole[start : start + length])
    except BaseException:  # MemoryError, a bad setting, a populate thread's error
        units.clear()
        del whole
        region.close()
        raise
    del whole

    def unmap() -> None:
        try:
            region.close()
        except BufferError:
            # A view outlives the pool: the mapping goes with the last one.
            logger.debug("KV offload: host mapping still viewed; unmapped at GC")

    return HostMemory(
        units,
        plan.row_span,
        PAGEABLE,
        False,
        _release=unmap,
        piece_bytes=(plan.span,),
    )


def register_pieces(
    memory: HostMemory,
    plan: PiecePlan,
    register: Callable[[int, int], int],
    unregister: Callable[[int], None],
    name: str,
    what: str = "the CPU block pool",
) -> list[str]:
    """Page-locks ``memory`` (``plan``'s units: an mmap, or a shared region)
    in place, piece by piece: ``register(addr, size)`` returns what
    ``unregister`` takes, or raises RuntimeError when refused. Where not even
    one unit is taken, ``memory`` stays pageable and what ``name`` (the
    call) said is returned. ``memory.release`` unregisters every piece
    first, logging a failure (it runs at shutdown)."""
    bases = memory.units[0].data_ptr() + plan.unit_offsets()
    try:
        pieces, failures = take_pieces(
            plan,
            lambda u, k: register(int(bases[u]), plan.piece_span(u, k)),
            unregister,
        )
    except PiecesRefused as e:
        return e.failures
    if failures:
        logger.warning(
            "KV offload: %s refused a piece of %s, which was registered in "
            "smaller pieces: %s",
            name,
            what,
            "; ".join(failures),
        )
    unmap = memory._release

    def release() -> None:
        for piece in reversed(pieces):
            try:
                unregister(piece.handle)
            except RuntimeError as e:
                logger.warning(
                    "KV offload: unregistering %s failed for the piece at %#x: %s",
                    what,
                    piece.handle,
                    e,
                )
        if unmap is not None:
            unmap()

    memory.pinned, memory._release = True, release
    memory.pieces, memory.piece_bytes = len(pieces), tuple(p.nbytes for p in pieces)
    return []


def _cuda_register_fns() -> tuple[Callable[[int, int], int], Callable[[int], None]]:
    """cudaHostRegister / cudaHostUnregister as ``register_pieces`` takes
    them: vLLM's host_register (False when refused) where this vLLM has it."""
    try:
        from vllm.v1.kv_offload.cpu import host_register as pin

        registered, unregister = pin.host_register, pin.host_unregister
    except ImportError:  # vLLM < 0.32
        cudart = torch.cuda.cudart()

        def registered(addr: int, size: int) -> bool:
            return int(cudart.cudaHostRegister(addr, size, 0)) == 0

        def unregister(addr: int) -> None:
            cudart.cudaHostUnregister(addr)

    def register(addr: int, size: int) -> int:
        if not registered(addr, size):
            raise RuntimeError(f"cudaHostRegister of {size} bytes failed")
        return addr

    return register, unregister


def _npu_memory(plan: PiecePlan, acl: AclHostApi, kernel: str | None) -> HostMemory:
    try:
        units, sizes = acl_malloc_units(plan, acl)
    except PiecesRefused as e:
        failures = [f"aclrtMallocHost: {'; '.join(e.failures)}"]
    else:
        # The pieces' memory is freed once the last view of it is gone.
        return HostMemory(
            units,
            plan.row_span,
            ACL_MALLOC_HOST,
            True,
            pieces=len(sizes),
            piece_bytes=tuple(sizes),
        )
    release = kernel or os.uname().release
    memory = None
    if kernel_registers_pageable_memory(release):
        memory = _mmap_memory(plan)
        registrar = AclRegistrar(acl.register)
        refused = register_pieces(
            memory, plan, registrar, acl.unregister, "aclrtHostRegisterV2"
        )
        if not refused:
            memory.kind = registrar.kind
            logger.warning(
                "KV offload: aclrtMallocHost refused the CPU block pool (%s); "
                "it is an mmap registered with aclrtHostRegisterV2",
                failures[0],
            )
            return memory
        # Pageable, faulted in already: kept, not mapped again.
        failures.append(f"aclrtHostRegisterV2: {'; '.join(refused)}")
    else:
        failures.append(
            f"aclrtHostRegisterV2 not tried: Linux {release} is 5.10 or older, "
            "where CANN does not support registering pageable memory"
        )
    logger.warning(
        "KV offload: no page-locked host memory for the CPU block pool "
        "(%d bytes): %s. It is pageable memory, which the native npu copy "
        "backend refuses; the start-up self-check decides whether another "
        "copy path can use it",
        plan.row_span,
        "; ".join(failures),
    )
    return memory or _mmap_memory(plan)
