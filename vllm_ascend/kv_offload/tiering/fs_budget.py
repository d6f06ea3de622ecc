"""The size bound of the ``fs`` tier (``max_bytes`` in its entry of
``secondary_tiers``): once the block files of the tier's directory reach
it, the least recently used ones are removed, down to ``EVICT_TO`` of it.

Several engines may share the directory, so the state is on disk: a file's
mtime is its LRU clock (set when written, touched on every read), a scan
runs under an advisory lock (``flock`` on ``LOCK_FILE`` in the directory;
an engine that finds it held skips its scan, the holder makes the room,
unless it has written an eighth of the bound since its own last scan: then
it waits for the lock, so a holder that stalls cannot let the others run
past the bound), and only regular ``*.bin`` files, re-checked just before,
are unlinked; nothing is followed (files there are untrusted). Removing a
file another engine is reading is safe: its open descriptor still reads
the whole file; one that it has only looked up becomes a miss, recomputed.

The scan runs in the tier's I/O thread after stores, amortized: a cached
estimate (the last scan's size plus this engine's writes since) triggers
it at the bound, or after an eighth of the bound written, so the bound
holds within one eighth of it per engine sharing the directory."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata

from vllm_ascend.kv_offload.config import OffloadConfigError
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.tiering.tier_paths import (
    open_dirs,
    remove_file,
    split_under,
    walk_files,
)

logger = init_logger(__name__)

MAX_BYTES_KEY = "max_bytes"
# Evict below the bound, so that one scan makes room for many stores.
EVICT_TO = 0.9
# A scan after this fraction of the bound written by this engine: the
# estimate does not see other engines' writes.
RESCAN_FRACTION = 8
# The bound must hold this many block files (fewer would evict per store).
MIN_FILES = 4
LOCK_FILE = "evict.lock"
BLOCK_SUFFIX = ".bin"

EVICTED_BLOCKS = "vllm:kv_offload_tiering_fs_evicted_blocks"
EVICTED_BYTES = "vllm:kv_offload_tiering_fs_evicted_bytes"
TIER_BYTES = "vllm:kv_offload_tiering_fs_bytes"


def budget_metric_definitions() -> dict[str, Any]:
    return {
        EVICTED_BLOCKS: OffloadingCounterMetadata(
            documentation=(
                "Block files this engine removed from the fs tier to keep it "
                "within max_bytes (least recently used first)."
            ),
        ),
        EVICTED_BYTES: OffloadingCounterMetadata(
            documentation="Bytes of the block files counted in " + EVICTED_BLOCKS + ".",
        ),
        TIER_BYTES: OffloadingGaugeMetadata(
            documentation=(
                "Bytes of block files in the fs tier directory at this "
                "engine's last size scan (all engines' files)."
            ),
        ),
    }


def block_files(
    root: str, top: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], str, os.stat_result]]:
    """The regular ``*.bin`` files under ``root/top`` (``walk_files``:
    nothing followed), as (directories under ``root``, name, ``lstat``);
    temp files (in-flight writes) are left out. A file's mtime is its LRU
    clock."""
    return [
        (dirs, name, st)
        for _, dirs, name, st in walk_files(root, top)
        if name.endswith(BLOCK_SUFFIX)
    ]


class FsTierBudget:
    """Keeps the block files under ``root/top`` within ``max_bytes``;
    ``root`` is trusted (configured), nothing below it is (an fs tier's
    identity directory is its ``top``)."""

    def __init__(
        self, root: str, max_bytes: int, file_bytes: int, top: tuple[str, ...] = ()
    ):
        if max_bytes < MIN_FILES * file_bytes:
            raise OffloadConfigError(
                f"secondary_tiers fs '{MAX_BYTES_KEY}'={max_bytes} holds fewer "
                f"than {MIN_FILES} block files of {file_bytes} bytes each; set "
                f"it to at least {MIN_FILES * file_bytes} (a useful bound holds "
                "many requests' prefixes)"
            )
        self.root, self.top = root, tuple(top)
        self.max_bytes = max_bytes
        self.low_bytes = int(max_bytes * EVICT_TO)
        self._rescan_bytes = max(file_bytes, max_bytes // RESCAN_FRACTION)
        # Unknown until the first scan: taken as full, so the first store scans.
        self._estimate = max_bytes
        self._since_scan = 0
        self._count_lock = threading.Lock()
        self._scan_lock = threading.Lock()  # one scan per process at a time
        self._stats = OffloadingConnectorStats()  # since the last take_stats

    def note_stored(self, nbytes: int) -> None:
        """After this engine wrote ``nbytes`` of block files (I/O thread):
        scans when the estimate reaches the bound or is stale."""
        with self._count_lock:
            self._since_scan += nbytes
            stale = self._since_scan >= self._rescan_bytes
            due = stale or self._estimate + self._since_scan >= self.max_bytes
        if due and self._scan_lock.acquire(blocking=False):
            try:
                self.scan(wait=stale)
            finally:
                self._scan_lock.release()

    def touch(self, path: str) -> None:
        """A read is a use: the file becomes the most recently used."""
        with contextlib.suppress(OSError):
            dirs, name = split_under(self.root, path)
            with open_dirs(self.root, dirs) as dir_fd:
                os.utime(name, dir_fd=dir_fd, follow_symlinks=False)

    def scan(self, wait: bool = False) -> None:
        """Measures the directory and, above the bound, removes the least
        recently used block files down to ``low_bytes``; skipped while
        another engine scans (it makes the room) unless ``wait``."""
        lock_fd = self._lock(wait)
        if lock_fd is None:
            return  # this engine's writes stay counted: the next store retries
        try:
            entries = block_files(self.root, self.top)
            total = sum(st.st_size for _, _, st in entries)
            removed = removed_bytes = 0
            if total >= self.max_bytes:
                entries.sort(key=lambda e: e[2].st_mtime_ns)
                for dirs, name, st in entries:
                    if total <= self.low_bytes:
                        break
                    try:  # only the file listed, unchanged since
                        gone = remove_file(self.root, dirs, name, st)
                    except OSError as e:
                        logger.warning(
                            "KV offload: fs tier file %s cannot be removed (%s); "
                            "the tier may stay above %s",
                            os.path.join(self.root, *dirs, name),
                            e,
                            MAX_BYTES_KEY,
                        )
                        continue
                    if gone is None:
                        continue  # used again or replaced: kept
                    total -= st.st_size
                    if gone:
                        removed += 1
                        removed_bytes += st.st_size
        finally:
            os.close(lock_fd)  # releases the flock
        with self._count_lock:
            self._estimate, self._since_scan = total, 0
            self._stats.increase_counter(EVICTED_BLOCKS, removed)
            self._stats.increase_counter(EVICTED_BYTES, removed_bytes)
            self._stats.set_gauge(TIER_BYTES, total)
        if removed:
            logger.info(
                "KV offload: fs tier %s reached %s=%d; removed the %d least "
                "recently used block files (%d bytes), %d bytes remain",
                os.path.join(self.root, *self.top),
                MAX_BYTES_KEY,
                self.max_bytes,
                removed,
                removed_bytes,
                total,
            )

    def take_stats(self) -> OffloadingConnectorStats | None:
        """Evictions and the size since the last call (None: no scan since),
        as vLLM's offloading metrics."""
        with self._count_lock:
            stats, self._stats = self._stats, OffloadingConnectorStats()
        return None if stats.is_empty() else stats

    def _lock(self, wait: bool) -> int | None:
        """The scan lock's fd, flocked (None: another engine scans, or the
        lock file cannot be used: a non-regular file there is not followed)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = None
        try:
            with open_dirs(self.root, self.top) as dir_fd:
                fd = os.open(LOCK_FILE, flags, 0o644, dir_fd=dir_fd)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            return fd
        except OSError as e:
            if fd is not None:
                os.close(fd)
            if not isinstance(e, BlockingIOError):  # else another engine scans
                logger.warning(
                    "KV offload: fs tier lock file %s cannot be used (%s); no "
                    "eviction this time. Fix: remove whatever is at that path",
                    os.path.join(self.root, *self.top, LOCK_FILE),
                    e,
                )
            return None
