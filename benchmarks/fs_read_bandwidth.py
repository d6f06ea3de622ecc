"""The fs tier's read bandwidth against a plain sequential read of the same
block files, one thread, the same files in the same order (run by
``bench_ttft.py`` once its engines have exited, over every file of the run).

``plain_cold``: ``readv`` of each whole file into one buffer with a cold
page cache (every file ``fsync``-ed and dropped with
``posix_fadvise(DONTNEED)`` first); ``plain_warm``: read again at once;
``fs_tier_read``: the fs tier's own read path (``read_block``: header +
payload, identity, key and CRC32 checks) with ``O_DIRECT`` where the file
system allows it, as the engine reads (no page cache: cold by construction);
``fs_tier_read_buffered_warm``: buffered with a warm cache (the
verification's cost alone). Each row with the load average when it ran.
"""

from __future__ import annotations

import mmap
import os
import time


def _drop_page_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _resident_fraction(paths: list[str]) -> float | None:
    """Share of the files' pages in the page cache (mincore(2)), or None."""
    import ctypes

    import numpy as np

    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    resident = total = 0
    for path in paths:
        size = os.path.getsize(path)
        pages = -(-size // mmap.PAGESIZE)
        vec = np.zeros(pages, dtype=np.uint8)
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
            try:
                view = np.frombuffer(m, dtype=np.uint8)
                rc = mincore(view.ctypes.data, size, vec.ctypes.data)
                del view
            finally:
                m.close()
        if rc != 0:
            return None
        resident += int((vec & 1).sum())
        total += pages
    return resident / total if total else None


def read_bandwidth(root: str, block_bytes: int) -> dict:
    from vllm.v1.kv_offload.tiering.fs.io import probe_o_direct

    from vllm_ascend.kv_offload.tiering.block_file import (
        HEADER_BYTES,
        HEADER_STRUCT,
        read_block,
    )
    from vllm_ascend.kv_offload.tiering.fs_budget import block_files

    paths = sorted(os.path.join(root, *d, n) for d, n, _ in block_files(root))
    assert paths, f"no block files under {root}"
    size = HEADER_BYTES + block_bytes
    sizes = {os.path.getsize(p) for p in paths}
    assert sizes == {size}, sizes
    total = len(paths) * size
    buf = mmap.mmap(-1, size)  # page-aligned (O_DIRECT)
    payload = memoryview(buf)[HEADER_BYTES:]
    ids = []
    for p in paths:  # identity and key from each header (verified below)
        with open(p, "rb") as f:
            _, _, _, _, identity, key = HEADER_STRUCT.unpack(f.read(HEADER_STRUCT.size))
        ids.append((identity, key))
    use_o_direct = probe_o_direct(root)
    o_direct = getattr(os, "O_DIRECT", 0) if use_o_direct else 0

    def plain() -> None:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                got = os.readv(fd, [buf])
            finally:
                os.close(fd)
            assert got == size

    def verified(flags: int):
        def run() -> None:
            for p, (identity, key) in zip(paths, ids, strict=True):
                read_block(p, payload, identity, key, flags)

        return run

    rows = {}

    def record(name: str, read, cache: str) -> None:
        resident = _resident_fraction(paths)
        t0 = time.perf_counter()
        read()
        seconds = time.perf_counter() - t0
        rows[name] = {"seconds": seconds, "gbps": total / seconds / 1e9,
                      "page_cache": cache, "resident_before": resident,
                      "loadavg": os.getloadavg()[0]}  # fmt: skip

    _drop_page_cache(paths)
    record("plain_cold", plain, "cold (fsync + fadvise DONTNEED)")
    record("plain_warm", plain, "warm (read just before)")
    _drop_page_cache(paths)
    no_cache = "O_DIRECT: bypassed" if o_direct else "cold (buffered; no O_DIRECT here)"
    record("fs_tier_read", verified(o_direct), no_cache)
    verified(0)()  # warm the cache through the buffered path
    record("fs_tier_read_buffered_warm", verified(0), "warm")
    return {
        "files": len(paths),
        "file_bytes": size,
        "total_bytes": total,
        "o_direct": bool(o_direct),
        "rows": rows,
    }
