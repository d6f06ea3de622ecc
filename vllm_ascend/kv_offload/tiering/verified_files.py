"""The fs tier's block files of one identity, written and read verified.

``fs.VerifiedFileSystemTier`` (vLLM's fs tier) hands each block of a job to
``VerifiedBlockFiles``, which writes and reads it as a ``block_file`` file
(header, CRC32, and an HMAC where the deployment has a key) below the
untrusted root directory, and counts and logs what went wrong: a bad entry
(``tier_paths``) is a miss, removed; a file that fails verification is not
loaded and is removed; a file removed since its lookup (the size bound,
another engine) is a ``VanishedBlockError``, a miss like any other.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.tiering.block_file import read_block, write_block
from vllm_ascend.kv_offload.tiering.tier_paths import (
    BadEntryError,
    StoredBlockError,
    remove_file,
    split_under,
)

logger = init_logger(__name__)


class VanishedBlockError(FileNotFoundError):
    """A block file found by a lookup was removed before its load."""


class VerifiedBlockFiles:
    """Writes and reads one tier's block files, verified; counts failures."""

    def __init__(
        self,
        primary: memoryview,
        block_bytes: int,
        identity: bytes,
        root: str,
        auth_key: bytes | None,
        o_direct: int,
    ):
        """``primary``: the CPU tier's bytes, a block every ``block_bytes``
        (what a job's offsets index). ``identity``: the digest every file
        carries. ``root``: the configured directory (below it nothing is
        trusted). ``o_direct``: ``os.O_DIRECT`` where vLLM's tier uses it,
        else 0."""
        self.primary = primary
        self.block_bytes = block_bytes
        self.identity = identity
        self.root = root
        self.auth_key = auth_key
        self.o_direct = o_direct
        self._count_lock = threading.Lock()
        self.bad_entries = 0
        self.vanished_blocks = 0  # looked up, gone when loaded: misses

    def _on_file(self, io: Callable[..., Any], path: str, offset: int, key: bytes):
        """``block_file``'s ``write_block`` or ``read_block`` on ``path`` and
        the block at ``offset``, with this tier's identity, key and root."""
        return io(
            path,
            self.primary[offset : offset + self.block_bytes],
            self.identity,
            key,
            self.o_direct,
            root=self.root,
            auth_key=self.auth_key,
            on_bad_entry=self._bad_entry,
        )

    def write(self, path: str, offset: int, key: bytes) -> bool:
        """Stores the block at ``offset`` as ``path``; False if it was
        there already (``block_file.write_block``)."""
        return self._on_file(write_block, path, offset, key)

    def read(self, path: str, offset: int, key: bytes) -> None:
        """Loads ``path`` into the block at ``offset``, verified; raises
        ``VanishedBlockError`` if it is gone, else the ``OSError`` that
        refused it (logged, and a file that fails verification removed)."""
        try:
            self._on_file(read_block, path, offset, key)
        except FileNotFoundError as exc:
            # Removed since the lookup (the size bound, another engine): a
            # miss like any other, not an I/O error.
            with self._count_lock:
                self.vanished_blocks += 1
            raise VanishedBlockError(exc.errno, exc.strerror, path) from exc
        except OSError as exc:
            if isinstance(exc, BadEntryError):
                pass  # logged and removed by _bad_entry
            elif isinstance(exc, StoredBlockError):
                logger.warning(
                    "KV offload: fs tier file %s is not loaded (%s); the request "
                    "recomputes those tokens, the file is removed",
                    path,
                    exc.strerror,
                )
                with contextlib.suppress(OSError):
                    remove_file(self.root, *split_under(self.root, path))
            else:
                logger.warning(
                    "KV offload: fs tier file %s could not be read (%s); the "
                    "request recomputes those tokens",
                    path,
                    exc,
                )
            raise

    def _bad_entry(self, path: str, found: str) -> None:
        with self._count_lock:
            self.bad_entries += 1
        logger.warning(
            "KV offload: fs tier: %s at %s; a miss, removed (the block can be "
            "stored again)",
            found,
            path,
        )
