"""The block file format of the ``fs`` tier: a one-page header (magic,
version, payload length, CRC32 of the payload, identity digest, key digest)
followed by the payload, written atomically and verified on every read."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import struct
import threading
import zlib

from vllm.v1.kv_offload.base import (
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
)

# One page, so that header + payload stay O_DIRECT-aligned (the payload is a
# region row, page-aligned in address and size).
HEADER_BYTES = mmap.PAGESIZE
MAGIC = b"VAKVOFF1"
HEADER_VERSION = 1
# magic, version, payload bytes, crc32 of payload, identity digest, key digest
_HEADER = struct.Struct("<8sIQI32s32s")


def key_digest(key: OffloadKey) -> bytes:
    block_hash = bytes(get_offload_block_hash(key))
    group = get_offload_group_idx(key)
    return hashlib.sha256(block_hash + group.to_bytes(4, "little")).digest()


class StoredBlockError(OSError):
    """A stored file that must not be loaded (short, foreign, corrupted)."""


_local = threading.local()


def _header_buffer() -> mmap.mmap:
    """A page-aligned page per thread (O_DIRECT needs aligned buffers)."""
    buf = getattr(_local, "header", None)
    if buf is None:
        buf = _local.header = mmap.mmap(-1, HEADER_BYTES)
    return buf


def _tmp_suffix() -> str:
    suffix = getattr(_local, "suffix", None)
    if suffix is None:
        suffix = _local.suffix = f".{os.getpid()}.{threading.get_ident()}.tmp"
    return suffix


def write_block(
    path: str,
    payload: memoryview,
    identity: bytes,
    key: bytes,
    o_direct: int,
) -> bool:
    """Writes ``header | payload`` atomically (temp file, then rename).
    Returns False if the file exists already (another writer won)."""
    if os.path.exists(path):
        return False
    header = _header_buffer()
    header[:] = bytes(HEADER_BYTES)
    _HEADER.pack_into(
        header,
        0,
        MAGIC,
        HEADER_VERSION,
        len(payload),
        zlib.crc32(payload),
        identity,
        key,
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + _tmp_suffix()
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | o_direct, 0o644)
        try:
            want = HEADER_BYTES + len(payload)
            written = os.writev(fd, [header, payload])
            if written != want:
                raise OSError(errno.EIO, f"short write: {written} of {want} bytes")
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return True


def read_block(
    path: str,
    payload: memoryview,
    identity: bytes,
    key: bytes,
    o_direct: int,
) -> None:
    """Reads ``path`` into ``payload`` and verifies it; raises
    ``StoredBlockError`` (after which ``payload`` holds garbage) if the file
    is not exactly what ``write_block`` wrote for this identity and key."""
    header = _header_buffer()
    fd = os.open(path, os.O_RDONLY | o_direct)
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
    magic, version, length, crc, file_identity, file_key = _HEADER.unpack_from(
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
