"""Faulting host memory in at start-up (``populate``): every page of the
range resident and zero afterwards, each chunk faulted in exactly once on
the threads asked for, off vLLM's OpenMP cores; an unsupported madvise falls
back to one write per page, no memory left is a MemoryError; the settings
refuse bad values, naming the variable."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading

import numpy as np
import pytest
import torch

from tests.unit.tier_helpers import smaps
from vllm_ascend.kv_offload import host_memory, populate
from vllm_ascend.kv_offload.populate import (
    CHUNK_BYTES,
    MADV_HUGEPAGE,
    MADV_POPULATE_WRITE,
    PAGE_BYTES,
    split,
)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_pages(addr: int, nbytes: int) -> int:
    """How many pages of a mapped range are in memory (mincore(2)); raises
    OSError(ENOMEM) where the range is not mapped."""
    pages = (nbytes + PAGE_BYTES - 1) // PAGE_BYTES
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(addr, nbytes, vec) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(np.count_nonzero(np.frombuffer(vec, np.uint8) & 1))


@pytest.fixture
def fresh_mapping():
    """(addr, nbytes) of anonymous mappings never touched, unmapped after."""
    opened = []

    def make(nbytes: int) -> tuple[int, int]:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = torch.frombuffer(region, dtype=torch.int8)
        opened.append((region, view))
        return view.data_ptr(), nbytes

    yield make
    for region, view in opened:
        del view
        region.close()


def all_resident_and_zero(addr: int, nbytes: int) -> bool:
    data = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), np.uint8)
    return resident_pages(addr, nbytes) == nbytes // PAGE_BYTES and not data.any()


# Two and a half chunks: whole chunks and a partial one, for two threads.
SIZE = 2 * CHUNK_BYTES + CHUNK_BYTES // 2


# -- splitting the range -----------------------------------------------------


@pytest.mark.parametrize(
    ("addr", "nbytes", "chunk"),
    [
        (0, 10 * 4096, 4096),  # whole chunks
        (4096, 10 * 4096, 8192),  # starts and ends between edges
        (3 * 8192, 8192, 8192),  # one whole chunk
        (4096, 4096, 8192),  # inside one chunk
        (2**40 + 4096, 5 * 2**21 + 12288, 2**21),  # huge-page chunks
    ],
)
def test_chunks_cover_the_range_once_with_aligned_inner_edges(addr, nbytes, chunk):
    chunks = split(addr, nbytes, chunk)
    starts = [s for s, _ in chunks]
    ends = [s + n for s, n in chunks]
    assert starts[0] == addr and ends[-1] == addr + nbytes
    assert starts[1:] == ends[:-1]  # no gap, no overlap, in order
    assert all(0 < n <= chunk for _, n in chunks)
    assert all(edge % chunk == 0 for edge in starts[1:])
    assert len(chunks) == len({s // chunk for s in starts})  # one per chunk
    assert split(addr, 0, chunk) == []  # an empty range has none


# -- populating ---------------------------------------------------------------


def populated(addr: int, nbytes: int, threads: int, huge=False, fail=None):
    """``populate`` through an ``advise`` that records (start, nbytes,
    advice, thread, CPUs) and then raises OSError(fail[advice]) or calls
    madvise: what ``populate`` returned, and the calls."""
    calls: list = []

    def advise(start: int, n: int, advice: int) -> None:
        calls.append((start, n, advice, threading.get_ident(), os.sched_getaffinity(0)))
        if fail and advice in fail:
            raise OSError(fail[advice], os.strerror(fail[advice]))
        populate.libc_madvise(start, n, advice)

    return populate.populate(
        addr, nbytes, threads, huge_pages=huge, advise=advise
    ), calls


@pytest.mark.parametrize(
    "size, threads, huge, fail, page_writes",
    [
        (SIZE, 1, None, None, False),
        (SIZE, 2, None, None, False),
        # An unsupported madvise: one write per page instead.
        (SIZE, 2, False, {MADV_POPULATE_WRITE: errno.EINVAL}, True),
        # A kernel without huge pages: 4 KiB pages.
        (CHUNK_BYTES, 1, True, {MADV_HUGEPAGE: errno.EINVAL}, False),
    ],
    ids=["1-thread", "2-threads", "no-madvise-populate", "no-huge-pages"],
)
def test_every_page_is_resident_and_zero_afterwards(
    fresh_mapping, size, threads, huge, fail, page_writes
):
    addr, nbytes = fresh_mapping(size)
    assert resident_pages(addr, nbytes) == 0
    done, _ = populated(addr, nbytes, threads, huge, fail)
    assert all_resident_and_zero(addr, nbytes)
    assert done.threads == threads and done.nbytes == nbytes
    assert done.page_writes == page_writes
    if huge is not None:
        assert not done.huge_pages


@pytest.mark.parametrize("size, threads", [(SIZE, 2), (CHUNK_BYTES // 2, 8)])
def test_each_chunk_is_faulted_in_once_on_the_threads_asked_for(
    fresh_mapping, size, threads
):
    """No more threads than chunks: half a chunk is one, or two where it
    spans an edge."""
    addr, nbytes = fresh_mapping(size)
    done, calls = populated(addr, nbytes, threads)
    chunks = split(addr, nbytes)
    assert len(chunks) <= -(-nbytes // CHUNK_BYTES) + 1
    assert sorted(c[:3] for c in calls) == [
        (s, n, MADV_POPULATE_WRITE) for s, n in chunks
    ]
    assert done.threads == min(threads, len(chunks))
    if done.threads > 1:  # the caller's thread only waits: they did the work
        assert threading.get_ident() not in {c[3] for c in calls}


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs this process may use",
)
def test_threads_run_outside_the_openmp_binding(fresh_mapping, monkeypatch):
    first = min(os.sched_getaffinity(0))
    monkeypatch.setenv("GOMP_CPU_AFFINITY", str(first))  # OpenMP on `first`
    monkeypatch.delenv(populate.THREADS_ENV, raising=False)
    addr, nbytes = fresh_mapping(SIZE)
    _, calls = populated(addr, nbytes, 2)
    assert calls and all(first not in c[4] for c in calls)


def test_no_memory_left_is_a_memory_error_naming_the_size(fresh_mapping):
    addr, nbytes = fresh_mapping(SIZE)
    with pytest.raises(MemoryError, match=f"faulting {nbytes} bytes"):
        populated(addr, nbytes, 2, fail={MADV_POPULATE_WRITE: errno.ENOMEM})
    # Not faulted in by page writes instead (the OOM killer's way).
    assert resident_pages(addr, nbytes) == 0


@pytest.mark.parametrize(
    "error",
    [MemoryError("no memory"), RuntimeError("a populate thread failed")],
    ids=["no-memory", "any-other-error"],
)
def test_a_failed_population_unmaps_the_pool_memory(monkeypatch, error):
    seen = []

    def failing(addr: int, nbytes: int) -> None:
        seen.append((addr, nbytes))
        raise error

    monkeypatch.setattr(host_memory, "populate", failing)
    with pytest.raises(type(error)) as failed:
        host_memory.allocate_host_memory(1, CHUNK_BYTES, "cpu")
    # Unmapped by the time the error is raised, not when it is collected
    # (its traceback holds the allocating frame).
    assert failed.tb is not None
    ((addr, nbytes),) = seen
    with pytest.raises(OSError) as unmapped:
        resident_pages(addr, nbytes)
    assert unmapped.value.errno == errno.ENOMEM


def thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


@pytest.mark.skipif(thp_mode() != "madvise", reason="THP must be madvise-only")
@pytest.mark.parametrize("huge", [False, True])
def test_huge_pages_are_asked_for_only_when_wanted(fresh_mapping, huge):
    addr, nbytes = fresh_mapping(SIZE)
    done, calls = populated(addr, nbytes, 1, huge)
    assert done.huge_pages == huge
    assert (smaps(addr)["THPeligible"] == "1") == huge
    assert ((addr, nbytes, MADV_HUGEPAGE) in [c[:3] for c in calls]) == huge
    assert all_resident_and_zero(addr, nbytes)


# -- settings -----------------------------------------------------------------


def test_threads_default_to_the_cpus_the_engine_leaves_free():
    allowed = os.sched_getaffinity(0)
    assert populate.default_threads({}) == len(allowed)  # no OpenMP binding
    if len(os.sched_getaffinity(os.getppid())) >= 2:
        parent = os.sched_getaffinity(os.getppid())
        binding = {"GOMP_CPU_AFFINITY": str(min(parent))}
        assert populate.default_threads(binding) == len(parent) - 1
    assert populate.default_threads({populate.THREADS_ENV: "3"}) == 3


@pytest.mark.parametrize("value", ["0", "-2", "many", "1.5"])
def test_a_bad_thread_count_names_the_setting(value):
    with pytest.raises(ValueError, match=f"{populate.THREADS_ENV}='{value}'.*e.g."):
        populate.default_threads({populate.THREADS_ENV: value})


def test_huge_pages_setting():
    for value, setting in ((None, False), ("1", True), ("0", False)):
        env = {} if value is None else {populate.HUGE_PAGES_ENV: value}
        assert populate.huge_pages_setting(env) is setting
    with pytest.raises(ValueError, match=f"{populate.HUGE_PAGES_ENV}='yes'"):
        populate.huge_pages_setting({populate.HUGE_PAGES_ENV: "yes"})


def test_an_unaligned_range_is_refused(fresh_mapping):
    addr, _ = fresh_mapping(PAGE_BYTES * 2)
    with pytest.raises(ValueError, match="not page-aligned"):
        populate.populate(addr + 8, PAGE_BYTES, 1)


def test_the_benchmark_prints_one_row_per_variant(capsys):
    from benchmarks import populate_benchmark

    assert populate_benchmark.main(["--gib", "0.01", "--rounds", "1"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ")]
    names = list(populate_benchmark.variants(populate_benchmark.parse_args([]).threads))
    assert [r.split(" | ")[0][2:] for r in rows[1:]] == names
    assert sum("(default)" in n for n in names) == 1
