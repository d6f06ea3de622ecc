"""Faulting host memory in at start-up on several threads: ``populate``.

The CPU block pool is an anonymous mapping whose pages are faulted in before
the engine serves, so that the first store into a block does not pay for
them. On one thread (``madvise(MADV_POPULATE_WRITE)`` over the whole range)
that took 0.8-2.4 s/GiB on a 2-core VM: a 900 GiB pool would hold the engine
12-36 minutes (issue 27). Here:

* The range is split into chunks whose inner edges are multiples of
  ``CHUNK_BYTES`` (a multiple of the transparent huge page size, so no huge
  page and no page table is shared by two threads), and a pool of
  ``threads`` threads (``ThreadPoolExecutor``) takes them in turn, calling
  ``madvise(MADV_POPULATE_WRITE)`` on them through ctypes, which releases
  the GIL. Python's ``mmap.madvise`` does not (CPython's ``mmapmodule.c``
  calls ``madvise`` without ``Py_BEGIN_ALLOW_THREADS``), so threads calling
  it would fault one after another.
* Transparent huge pages (``MADV_HUGEPAGE`` first, where THP is
  ``madvise``-only) on request (``HUGE_PAGES_ENV=1``): one fault per 2 MiB
  instead of one per 4 KiB, but not faster everywhere: on this project's
  VM they took 0.14-0.16 s of CPU per GiB where the previous mapping had
  just freed its huge pages and 0.4-2.7 s otherwise (its hypervisor takes
  free memory back), 4 KiB pages 0.27-0.32 s (docs/host_memory.md).
* A kernel without ``MADV_POPULATE_WRITE`` (before 5.14: EINVAL) gets one
  write per page instead, on the same threads (numpy's strided store
  releases the GIL too). ENOMEM raises MemoryError: writing the pages
  would get the process killed by the OOM killer instead.

The threads run on the CPUs the engine leaves free
(``cpu_threads.free_cpus``: outside vLLM's OpenMP binding on its CPU
backend; elsewhere the worker's own CPUs), as many as there are unless
``THREADS_ENV`` says otherwise. The engine's own threads are idle meanwhile:
the pool is allocated while the worker initialises its KV caches, before
any forward pass. One thread (or one chunk) is the caller's own thread.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from vllm_ascend.kv_offload import cpu_threads
from vllm_ascend.kv_offload.logger import init_logger

logger = init_logger(__name__)

PAGE_BYTES = mmap.PAGESIZE
# madvise(2) advice; Python's mmap module has no name for the first before 3.13.
MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable
MADV_HUGEPAGE = 14  # Linux >= 2.6.38: back the range with huge pages

THREADS_ENV = "VLLM_ASCEND_KV_OFFLOAD_POPULATE_THREADS"
HUGE_PAGES_ENV = "VLLM_ASCEND_KV_OFFLOAD_HUGE_PAGES"
_THP = "/sys/kernel/mm/transparent_hugepage"


def huge_page_bytes() -> int:
    """The transparent huge page size (2 MiB on x86-64 and on arm64 with
    4 KiB pages, 512 MiB with 64 KiB pages); 2 MiB where not readable."""
    try:
        with open(f"{_THP}/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 * 2**20


# Large enough that queueing a chunk costs nothing beside faulting it in
# (a few ms), small enough that threads finish together.
CHUNK_BYTES = max(64 * 2**20, huge_page_bytes())

Advise = Callable[[int, int, int], None]  # (addr, nbytes, advice); raises OSError


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def libc_madvise(addr: int, nbytes: int, advice: int) -> None:
    """``madvise(2)`` through ctypes (the GIL released while it runs)."""
    if _libc.madvise(addr, nbytes, advice) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"madvise({advice}): {os.strerror(code)}")


def split(
    addr: int, nbytes: int, chunk_bytes: int = CHUNK_BYTES
) -> list[tuple[int, int]]:
    """``[addr, addr + nbytes)`` as (start, length) chunks in address order:
    every inner edge a multiple of ``chunk_bytes``, no chunk longer. Pure."""
    if nbytes <= 0:
        return []
    end = addr + nbytes
    edges = range((addr // chunk_bytes + 1) * chunk_bytes, end, chunk_bytes)
    starts = [addr, *edges]
    return [(s, e - s) for s, e in zip(starts, [*edges, end], strict=True)]


def default_threads(environ: Mapping[str, str] = os.environ) -> int:
    """``THREADS_ENV`` if set, else one thread per CPU the engine leaves free
    (``cpu_threads.free_cpus``, else this thread's CPUs)."""
    raw = environ.get(THREADS_ENV, "").strip()
    if not raw:
        cpus = cpu_threads.free_cpus(environ) or os.sched_getaffinity(0)
        return max(1, len(cpus))
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(
            f"KV offload: {THREADS_ENV}={raw!r} must be a positive integer "
            f"(threads faulting the CPU block pool in); set e.g. "
            f"{THREADS_ENV}=8, or unset it for one per CPU the engine leaves free"
        )
    return int(raw)


def huge_pages_setting(environ: Mapping[str, str] = os.environ) -> bool:
    """``HUGE_PAGES_ENV``: 1 asks for transparent huge pages, 0 (the
    default) leaves the kernel's choice (see the module docstring)."""
    raw = environ.get(HUGE_PAGES_ENV, "0").strip() or "0"
    if raw not in ("0", "1"):
        raise ValueError(
            f"KV offload: {HUGE_PAGES_ENV}={raw!r} must be 1 (transparent huge "
            f"pages for the CPU block pool) or 0 (the kernel's default); set "
            f"{HUGE_PAGES_ENV}=1 or unset it"
        )
    return raw == "1"


@dataclass(frozen=True)
class Population:
    """What ``populate`` did: for logs and the benchmark."""

    nbytes: int
    threads: int
    huge_pages: bool  # MADV_HUGEPAGE given (and accepted) for the range
    page_writes: bool  # MADV_POPULATE_WRITE unsupported: one write per page
    seconds: float


def populate(
    addr: int,
    nbytes: int,
    threads: int | None = None,
    *,
    huge_pages: bool | None = None,
    advise: Advise = libc_madvise,
) -> Population:
    """Faults ``[addr, addr + nbytes)`` (page-aligned, mapped writable and
    never written: it reads zero afterwards) in on ``threads`` threads (see
    the module docstring; None: ``default_threads``). ``huge_pages``:
    ``MADV_HUGEPAGE`` first (None: ``huge_pages_setting``). ``advise``
    replaces ``madvise`` (tests). Raises MemoryError naming the size when
    the kernel refuses to fault the range in (no memory left: ENOMEM)."""
    if addr % PAGE_BYTES:
        raise ValueError(f"KV offload: populate({addr:#x}) is not page-aligned")
    t0 = time.perf_counter()
    threads = default_threads() if threads is None else threads
    if threads < 1:
        raise ValueError(f"KV offload: populate with {threads} threads")
    if huge_pages is None:
        huge_pages = huge_pages_setting()
    if huge_pages:
        try:
            advise(addr, nbytes, MADV_HUGEPAGE)
        except OSError as e:  # a kernel without transparent huge pages
            logger.debug("KV offload: no huge pages for the CPU block pool (%s)", e)
            huge_pages = False
    chunks = split(addr, nbytes)
    work = _Fault(advise)
    used = max(1, min(threads, len(chunks)))
    if used == 1:  # on the caller's thread, as before: no thread to start
        for chunk in chunks:
            work(chunk)
    else:
        with ThreadPoolExecutor(
            used, "kv-populate", initializer=cpu_threads.pin_copy_thread
        ) as pool:  # off vLLM's OpenMP cores
            list(pool.map(work, chunks))
    if work.error is not None:
        raise MemoryError(
            f"KV offload: faulting {nbytes} bytes of host memory in failed "
            f"({work.error})"
        ) from work.error
    done = Population(
        nbytes, used, huge_pages, work.page_writes, time.perf_counter() - t0
    )
    if work.page_writes:
        logger.warning(
            "KV offload: this kernel has no madvise(MADV_POPULATE_WRITE) "
            "(Linux < 5.14); the CPU block pool was faulted in by one write "
            "per page (%.2f s for %d bytes)",
            done.seconds,
            nbytes,
        )
    logger.debug("KV offload: populated %s", done)
    return done


# madvise's answers where the kernel (or a seccomp filter) does not know or
# allow the advice; anything else (ENOMEM: no memory left) is an error.
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EPERM)


class _Fault:
    """Faults one chunk in (a call per chunk, from any thread); remembers
    what went wrong, after which it faults nothing more."""

    def __init__(self, advise: Advise) -> None:
        self._advise = advise
        self.page_writes = False
        self.error: OSError | None = None

    def __call__(self, chunk: tuple[int, int]) -> None:
        start, length = chunk
        if self.error is not None:
            return
        if not self.page_writes:
            try:
                self._advise(start, length, MADV_POPULATE_WRITE)
                return
            except OSError as e:
                if e.errno not in _UNSUPPORTED:
                    self.error = e
                    return
                self.page_writes = True  # for every later chunk too
        # One zero written per page faults the range in.
        pages = np.frombuffer((ctypes.c_uint8 * length).from_address(start), np.uint8)
        pages[::PAGE_BYTES] = 0
