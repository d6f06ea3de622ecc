"""Where the CPU block pool's memory comes from: exactly the bytes asked for,
in the kind of memory the device's copies accept, released by its owner.

Not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator
rounds each allocation up to a power of two (PyTorch issue #150517; vLLM
moved its own pool to mmap + ``cudaHostRegister`` for it), so a 10 GiB pool
could take 16 GiB behind the host-memory guard's back.

* ``cpu``: an anonymous private mmap (pageable), faulted in at start-up so
  that the first store into a block does not pay for its page faults
  (``populate``: on several threads, in huge pages where the kernel allows).
* ``cuda``: the same mmap, page-locked with ``cudaHostRegister`` through
  vLLM's ``host_register`` (where vLLM has it, else torch's cudart binding),
  in chunks of at most vLLM's limit; left pageable if that fails (the cuda
  backend copies pageable memory too, slower).
* ``npu``: ``aclrtMallocHost`` first: the memory torch_npu's own pinned
  allocator hands out, documented for every kernel. If the runtime refuses
  it, and only on Linux newer than 5.10 (CANN: pageable memory registered on
  older kernels "causes exceptions"), the mmap registered with
  ``aclrtHostRegisterV2``. If both fail: pageable memory, said loudly; the
  native npu backend refuses it, so the start-up self-check picks the torch
  path (or refuses to offload).

Every ``HostMemory`` knows what it is (``kind``, ``pinned``) and how to give
itself back (``release``); memory someone else allocated (``borrowed``: a
shared region) is its owner's to free.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.populate import populate

logger = init_logger(__name__)

# vLLM's bound on one cudaHostRegister call (driver limits on large ranges).
MAX_REGISTER_CHUNK_BYTES = 64 * 2**30

PAGEABLE = "pageable mmap"
CUDA_REGISTERED = "mmap + cudaHostRegister"
ACL_MALLOC_HOST = "aclrtMallocHost"
ACL_REGISTERED = "mmap + aclrtHostRegisterV2"
BORROWED = "borrowed"


@dataclass
class HostMemory:
    """One host allocation: ``tensor`` (int8, ``nbytes`` long) until
    ``release``. ``kind`` says where it came from (the constants above)."""

    tensor: torch.Tensor | None
    nbytes: int
    kind: str
    pinned: bool
    _release: Callable[[], None] | None = field(default=None, repr=False)
    # Separate allocations the memory is made of (one today), on /metrics.
    pieces: int = 1

    @property
    def base(self) -> int:
        return 0 if self.tensor is None else self.tensor.data_ptr()

    def release(self) -> None:
        """Gives the memory back (once); no copy may use it afterwards.
        Logs instead of raising: it runs at shutdown."""
        release, self._release = self._release, None
        self.tensor = None
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
    return HostMemory(tensor, tensor.numel() * tensor.element_size(), BORROWED, pinned)


# -- kernels and runtimes ----------------------------------------------------


def kernel_release() -> str:
    return os.uname().release


def kernel_registers_pageable_memory(release: str) -> bool:
    """Whether ``aclrtHostRegisterV2`` may page-lock pageable memory on a
    Linux kernel of this release: the CANN documentation says that on 5.10
    and older, pageable memory "causes exceptions" and must come from
    ``aclrtMallocHost`` instead."""
    numbers = []
    for part in release.split(".")[:2]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        numbers.append(int(digits) if digits else 0)
    return tuple(numbers) > (5, 10)


@dataclass(frozen=True)
class AclHostApi:
    """The four ACL host-memory calls, as functions of addresses; the native
    op's by default (``ops.host_*``). Each raises RuntimeError naming the
    ACL call and its code."""

    alloc: Callable[[int], int]  # aclrtMallocHost(size) -> addr
    free: Callable[[int], None]  # aclrtFreeHost(addr)
    register: Callable[[int, int], None]  # aclrtHostRegisterV2(addr, size)
    unregister: Callable[[int], None]  # aclrtHostUnregister(addr)

    @classmethod
    def native(cls) -> AclHostApi:
        from vllm_ascend.kv_offload import ops

        return cls(
            alloc=lambda size: ops.host_alloc(size, "npu"),
            free=lambda addr: ops.host_free(addr, "npu"),
            register=lambda addr, size: ops.host_register(addr, size, "npu"),
            unregister=lambda addr: ops.host_unregister(addr, "npu"),
        )


# -- the factory -------------------------------------------------------------


def allocate_host_memory(
    nbytes: int,
    device_type: str,
    *,
    acl: AclHostApi | None = None,
    kernel: str | None = None,
) -> HostMemory:
    """``nbytes`` of host memory for a pool that ``device_type`` copies to
    and from (see the module docstring). ``acl`` and ``kernel`` replace the
    ACL calls and the kernel release (tests drive a simulated ACL runtime).
    Raises MemoryError naming the size when not even pageable memory fits."""
    if nbytes <= 0:
        raise ValueError(f"KV offload: a host allocation of {nbytes} bytes")
    if device_type == "npu":
        return _npu_memory(nbytes, acl or AclHostApi.native(), kernel)
    memory = _mmap_memory(nbytes)
    if device_type == "cuda":
        _cuda_register(memory)
    return memory


def _mmap_memory(nbytes: int) -> HostMemory:
    """An anonymous private mapping of ``nbytes``, faulted in now."""
    try:
        region = mmap.mmap(
            -1,
            nbytes,
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
    except (OSError, OverflowError) as e:
        raise MemoryError(
            f"KV offload: mapping {nbytes} bytes of host memory failed ({e})"
        ) from e
    tensor = torch.frombuffer(region, dtype=torch.int8)
    try:
        populate(tensor.data_ptr(), nbytes)
    except MemoryError:
        del tensor
        region.close()
        raise

    def unmap() -> None:
        try:
            region.close()
        except BufferError:
            # A view outlives the pool: the mapping goes with the last one.
            logger.debug("KV offload: host mapping still viewed; unmapped at GC")

    return HostMemory(tensor, nbytes, PAGEABLE, pinned=False, _release=unmap)


def _cuda_register(memory: HostMemory) -> None:
    """Page-locks ``memory`` (an mmap) for CUDA in place, where it can."""
    register, unregister = _cuda_register_fns()
    base, done = memory.base, []
    for offset in range(0, memory.nbytes, MAX_REGISTER_CHUNK_BYTES):
        size = min(MAX_REGISTER_CHUNK_BYTES, memory.nbytes - offset)
        if register(base + offset, size):
            done.append(base + offset)
            continue
        for addr in reversed(done):
            unregister(addr)
        logger.warning(
            "KV offload: cudaHostRegister of the CPU block pool (%d bytes) "
            "failed; it stays pageable (slower copies)",
            memory.nbytes,
        )
        return
    unmap = memory._release

    def release() -> None:
        for addr in reversed(done):
            unregister(addr)  # before the mapping goes
        if unmap is not None:
            unmap()

    memory.kind, memory.pinned, memory._release = CUDA_REGISTERED, True, release


def _cuda_register_fns() -> tuple[Callable[[int, int], bool], Callable[[int], None]]:
    """vLLM's host_register / host_unregister where this vLLM has them."""
    try:
        from vllm.v1.kv_offload.cpu.host_register import (
            host_register,
            host_unregister,
        )

        return host_register, host_unregister
    except ImportError:  # vLLM < 0.32
        cudart = torch.cuda.cudart()

        def register(addr: int, size: int) -> bool:
            return int(cudart.cudaHostRegister(addr, size, 0)) == 0

        def unregister(addr: int) -> None:
            cudart.cudaHostUnregister(addr)

        return register, unregister


def _npu_memory(nbytes: int, acl: AclHostApi, kernel: str | None) -> HostMemory:
    failures = []
    try:
        return _acl_malloc_host(nbytes, acl)
    except RuntimeError as e:
        failures.append(f"aclrtMallocHost: {e}")
    release = kernel or kernel_release()
    if kernel_registers_pageable_memory(release):
        memory = _mmap_memory(nbytes)
        try:
            acl.register(memory.base, nbytes)
        except RuntimeError as e:
            failures.append(f"aclrtHostRegisterV2: {e}")
            memory.release()
        else:
            unmap, addr = memory._release, memory.base

            def unregister_then_unmap() -> None:
                try:
                    acl.unregister(addr)
                finally:
                    if unmap is not None:
                        unmap()

            memory.kind, memory.pinned = ACL_REGISTERED, True
            memory._release = unregister_then_unmap
            logger.warning(
                "KV offload: aclrtMallocHost refused %d bytes (%s); the CPU "
                "block pool is an mmap registered with aclrtHostRegisterV2",
                nbytes,
                failures[0],
            )
            return memory
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
        nbytes,
        "; ".join(failures),
    )
    return _mmap_memory(nbytes)


def _acl_malloc_host(nbytes: int, acl: AclHostApi) -> HostMemory:
    addr = acl.alloc(nbytes)
    # A ctypes array over the allocation gives torch a buffer to wrap; the
    # tensor's storage holds it, and ACL frees the memory once the last view
    # is gone (at release, normally), never under a view still in use.
    buffer = (ctypes.c_int8 * nbytes).from_address(addr)
    weakref.finalize(buffer, _free_logged, acl.free, addr)
    tensor = torch.frombuffer(buffer, dtype=torch.int8)
    del buffer
    return HostMemory(tensor, nbytes, ACL_MALLOC_HOST, True, _release=lambda: None)


def _free_logged(free: Callable[[int], None], addr: int) -> None:
    try:
        free(addr)
    except RuntimeError:
        logger.exception("KV offload: aclrtFreeHost(%#x) failed", addr)
