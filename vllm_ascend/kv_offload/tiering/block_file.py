"""The block file format of the ``fs`` tier: a one-page header (magic,
version, payload length, CRC32 of the payload, identity digest, key digest,
optionally an HMAC-SHA256 over header and payload) followed by the payload,
written atomically and verified on every read.

Files under the tier directory are untrusted: every path is reached
through ``tier_paths``; a *bad entry* there is a miss, reported to
``on_bad_entry`` and removed, so that the block can be written again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import mmap
import os
import socket
import stat
import struct
import threading
import time
import zlib
from collections.abc import Callable

from vllm.v1.kv_offload.base import (
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
)

from vllm_ascend.kv_offload.tiering.tier_paths import (
    BadEntryHook,
    StoredBlockError,
    bad_entry,
    open_dirs,
    open_regular,
    split_under,
    walk_files,
)

# One page, so that header + payload stay O_DIRECT-aligned (the payload is a
# region row, page-aligned in address and size).
HEADER_BYTES = mmap.PAGESIZE
MAGIC = b"VAKVOFF1"
HEADER_VERSION = 1
# The on-disk header every reader parses: magic, version, payload bytes,
# crc32 of payload, identity digest, key digest.
HEADER_STRUCT = struct.Struct("<8sIQI32s32s")
# Then the MAC kind (0: none, as the zero padding of files without one
# reads) and an HMAC-SHA256 over the header up to the MAC and the payload.
_MAC = struct.Struct("<I32s")
MAC_NONE, MAC_HMAC_SHA256 = 0, 1
# Temp files are hidden and end in ".tmp" (no "*.bin" glob or reader takes
# them for blocks); a writer holds an exclusive flock on its temp file until
# it is renamed, so one that nobody holds is from a writer that is gone.
TMP_SUFFIX = ".tmp"
# ... once it is this old (covers the instant between create and flock).
STALE_TMP_AGE_S = 60.0


def key_digest(key: OffloadKey) -> bytes:
    block_hash = bytes(get_offload_block_hash(key))
    group = get_offload_group_idx(key)
    return hashlib.sha256(block_hash + group.to_bytes(4, "little")).digest()


_local = threading.local()


def _header_buffer() -> mmap.mmap:
    """A page-aligned page per thread (O_DIRECT needs aligned buffers)."""
    buf = getattr(_local, "header", None)
    if buf is None:
        # Private: an anonymous mmap is shared by default, with every
        # process forked after this one wrote or read a block.
        buf = _local.header = mmap.mmap(-1, HEADER_BYTES, flags=mmap.MAP_PRIVATE)
    return buf


def temp_name(name: str) -> str:
    """This thread's temp file name for block file ``name`` (host, pid and
    thread: its own among every writer of a shared directory)."""
    host = socket.gethostname().replace(os.sep, "_")[:64]
    return f".{name}.{host}-{os.getpid()}-{threading.get_ident()}{TMP_SUFFIX}"


def _mac(auth_key: bytes, header: mmap.mmap, payload: memoryview) -> bytes:
    mac = hmac.new(auth_key, header[: HEADER_STRUCT.size + 4], hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def write_block(
    path: str,
    payload: memoryview,
    identity: bytes,
    key: bytes,
    o_direct: int,
    *,
    root: str | None = None,
    auth_key: bytes | None = None,
    on_bad_entry: BadEntryHook | None = None,
) -> bool:
    """Writes ``header | payload`` atomically (temp file, then rename) at
    ``path``, which must lie under ``root`` (default: its own directory).
    Returns False if a block file is there already (another writer won); a
    bad entry in its place is removed and the block written."""
    header = _header_buffer()
    header[:] = bytes(HEADER_BYTES)
    fields = (MAGIC, HEADER_VERSION, len(payload), zlib.crc32(payload), identity, key)
    HEADER_STRUCT.pack_into(header, 0, *fields)
    if auth_key is not None:
        struct.pack_into("<I", header, HEADER_STRUCT.size, MAC_HMAC_SHA256)
        _MAC.pack_into(
            header, HEADER_STRUCT.size, MAC_HMAC_SHA256, _mac(auth_key, header, payload)
        )
    want = HEADER_BYTES + len(payload)

    def write(fd: int) -> None:
        written = os.writev(fd, [header, payload])
        if written != want:
            raise OSError(errno.EIO, f"short write: {written} of {want} bytes")

    return create_file(
        path, write, root or os.path.dirname(path), o_direct, on_bad_entry
    )


def create_file(
    path: str,
    write: Callable[[int], object],
    root: str,
    o_direct: int = 0,
    on_bad_entry: BadEntryHook | None = None,
) -> bool:
    """Writes ``path`` under ``root`` with ``write(fd)`` into this thread's
    temp file, then renames it over ``path``, unless a regular file is
    there already (False). No symlink is followed; a bad entry in its place
    (or on the way) is removed and reported to ``on_bad_entry``."""
    dirs, name = split_under(root, path)
    with open_dirs(root, dirs, True, path, on_bad_entry) as dir_fd:
        with contextlib.suppress(FileNotFoundError):
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
            if stat.S_ISREG(mode):
                return False
            bad_entry(dir_fd, name, mode, "a block file", path, on_bad_entry)
        tmp = temp_name(name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)  # left by an earlier use of this name
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags | o_direct, 0o644, dir_fd=dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held while live (stale temp files)
            write(fd)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        finally:
            os.close(fd)
    return True


def read_block(
    path: str,
    payload: memoryview,
    identity: bytes,
    key: bytes,
    o_direct: int,
    *,
    root: str | None = None,
    auth_key: bytes | None = None,
    on_bad_entry: BadEntryHook | None = None,
) -> None:
    """Reads ``path`` (under ``root``, default its own directory) into
    ``payload`` and verifies it; raises ``StoredBlockError`` (after which
    ``payload`` holds garbage) if the file is not exactly what
    ``write_block`` wrote for this identity and key (and, with
    ``auth_key``, MACed with that key)."""
    root = root or os.path.dirname(path)
    dirs, name = split_under(root, path)
    header = _header_buffer()
    with open_dirs(root, dirs, False, path, on_bad_entry) as dir_fd:
        fd = open_regular(dir_fd, name, path, o_direct, on_bad_entry)
    try:
        size = os.fstat(fd).st_size
        want = HEADER_BYTES + len(payload)
        if size != want:
            raise StoredBlockError(
                errno.EIO, f"size {size} bytes, expected {want}", path
            )
        got = os.readv(fd, [header, payload])
        if got != want:
            raise StoredBlockError(errno.EIO, f"short read: {got} of {want}", path)
    finally:
        os.close(fd)
    magic, version, length, crc, file_identity, file_key = HEADER_STRUCT.unpack_from(
        header, 0
    )
    if magic != MAGIC or version != HEADER_VERSION:
        raise StoredBlockError(errno.EIO, "not a KV block file of ours", path)
    if file_identity != identity:
        raise StoredBlockError(errno.EIO, "written by another identity", path)
    if file_key != key:
        raise StoredBlockError(errno.EIO, "holds another block", path)
    if length != len(payload) or zlib.crc32(payload) != crc:
        raise StoredBlockError(errno.EIO, "checksum mismatch", path)
    if auth_key is not None:
        kind, mac = _MAC.unpack_from(header, HEADER_STRUCT.size)
        if kind != MAC_HMAC_SHA256 or not hmac.compare_digest(
            mac, _mac(auth_key, header, payload)
        ):
            raise StoredBlockError(
                errno.EIO, "no valid HMAC for the deployment key", path
            )


def remove_stale_temp_files(root: str, top: tuple[str, ...] = ()) -> int:
    """Removes temp files under ``root/top`` that no writer holds and that
    are older than ``STALE_TMP_AGE_S``; returns how many. Symlinks are not
    followed, ``top`` included (``walk_files``)."""
    removed = 0
    now = time.time()
    for dir_fd, _, name, st in walk_files(root, top):
        is_temp = name.startswith(".") and name.endswith(TMP_SUFFIX)
        if not is_temp or now - st.st_mtime < STALE_TMP_AGE_S:
            continue
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            continue  # gone, or a live writer holds it
        removed += 1
    return removed
