"""The verified ``fs`` tier: vLLM's ``FileSystemTierManager`` (thread pool,
async lookups, events, metrics) storing ``block_file`` files under an
identity directory of ``root_dir``; a file that fails verification is a
miss (the request recomputes), logged and removed. With ``auth_key_file``
every file carries an HMAC under that key. A tier directory that cannot be
used is dropped at start (CPU tier only)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Mapping
from typing import Any

from typing_extensions import override
from vllm.v1.kv_offload.base import OffloadingSpec
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

from vllm_ascend.kv_offload import vllm_compat
from vllm_ascend.kv_offload.config import (
    TIERING_MODULE,
    TIERING_SPEC,
    OffloadConfigError,
)
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.tiering.block_file import (
    HEADER_BYTES,
    create_file,
    key_digest,
    read_block,
    remove_stale_temp_files,
    write_block,
)
from vllm_ascend.kv_offload.tiering.fs_budget import MAX_BYTES_KEY, FsTierBudget
from vllm_ascend.kv_offload.tiering.identity import (
    IDENTITY_FILE,
    SHARED_ID,
    identity_digest,
    identity_root,
    tier_identity,
)
from vllm_ascend.kv_offload.tiering.tier_paths import (
    BadEntryError,
    StoredBlockError,
    remove_file,
    split_under,
)

logger = init_logger(__name__)

# Our fs tier, registered under this type; a config's "fs" tiers become it.
VERIFIED_FS_TYPE = "ascend_fs"


class VanishedBlockError(FileNotFoundError):
    """A block file found by a lookup was removed before its load."""


class VerifiedBlockFiles:
    """One tier's block files of one identity, written and read verified
    (``block_file``: header, CRC32, and an HMAC where the deployment has a
    key) below the untrusted ``root``; counts and logs what went wrong
    (``read``; a bad entry, ``tier_paths``, is a miss, removed)."""

    def __init__(self, primary, block_bytes, identity, root, auth_key, o_direct):
        """``primary``: the CPU tier's bytes, a block every ``block_bytes``
        (what a job's offsets index). ``identity``: the digest every file
        carries. ``root``: the configured directory (below it nothing is
        trusted). ``o_direct``: ``os.O_DIRECT`` where vLLM's tier uses it,
        else 0."""
        self.primary, self.block_bytes, self.root = primary, block_bytes, root
        self.identity, self.o_direct = identity, o_direct
        self._kw = {"root": root, "auth_key": auth_key, "on_bad_entry": self._bad}
        self._count_lock = threading.Lock()
        self.bad_entries = 0
        self.vanished_blocks = 0  # looked up, gone when loaded: misses

    def write(self, path: str, offset: int, key: bytes) -> bool:
        """Stores the block at ``offset`` as ``path``; False if it was
        there already (``block_file.write_block``)."""
        block = self.primary[offset : offset + self.block_bytes]
        return write_block(path, block, self.identity, key, self.o_direct, **self._kw)

    def read(self, path: str, offset: int, key: bytes) -> None:
        """Loads ``path`` into the block at ``offset``, verified; raises
        ``VanishedBlockError`` if it is gone, else the ``OSError`` that
        refused it (logged, and a file that fails verification removed)."""
        block = self.primary[offset : offset + self.block_bytes]
        try:
            read_block(path, block, self.identity, key, self.o_direct, **self._kw)
        except FileNotFoundError as exc:
            # Removed since the lookup (the size bound, another engine): a
            # miss like any other, not an I/O error.
            with self._count_lock:
                self.vanished_blocks += 1
            raise VanishedBlockError(exc.errno, exc.strerror, path) from exc
        except BadEntryError:
            raise  # logged and removed by _bad
        except StoredBlockError as exc:
            logger.warning(
                "KV offload: fs tier file %s is not loaded (%s); the request "
                "recomputes those tokens, the file is removed",
                path,
                exc.strerror,
            )
            with contextlib.suppress(OSError):
                remove_file(self.root, *split_under(self.root, path))
            raise
        except OSError as exc:
            logger.warning(
                "KV offload: fs tier file %s could not be read (%s); the "
                "request recomputes those tokens",
                path,
                exc,
            )
            raise

    def _bad(self, path: str, found: str) -> None:
        with self._count_lock:
            self.bad_entries += 1
        logger.warning(
            "KV offload: fs tier: %s at %s; a miss, removed (the block can be "
            "stored again)",
            found,
            path,
        )


class VerifiedFileSystemTier(FileSystemTierManager):
    """vLLM's ``fs`` tier with an identity directory and verified files
    (``block_file``). Registered as tier type ``ascend_fs``; reports itself
    as ``fs`` in metrics and logs."""

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        auth_key_file: str | None = None,
        identity: str | None = None,
        **kw: Any,
    ):
        spec_identity = getattr(offloading_spec, "storage_identity", None)
        if spec_identity is None:
            raise OffloadConfigError(
                f"secondary tier type {VERIFIED_FS_TYPE!r} needs spec_name="
                f"{TIERING_SPEC!r} and spec_module_path={TIERING_MODULE!r}"
            )
        files_identity, auth_key = tier_identity(
            spec_identity, {"auth_key_file": auth_key_file, SHARED_ID: identity}
        )
        digest = identity_digest(files_identity)
        weights = spec_identity.get("weights", {})
        if identity is None and "unidentified" in weights:
            logger.warning(
                "KV offload: the fs tier cannot identify the model's weights "
                "(%s): this engine reads no file another engine wrote. If "
                "every engine on %s serves the same weights, name them: "
                "secondary_tiers[..]['%s'] = 'your-deployment-id'",
                weights["unidentified"],
                root_dir,
                SHARED_ID,
            )
        self.root_dir = identity_root(root_dir, digest)
        max_bytes = kw.pop(MAX_BYTES_KEY, None)
        super().__init__(
            offloading_spec,
            primary_kv_view,
            "fs" if tier_type == VERIFIED_FS_TYPE else tier_type,
            self.root_dir,
            **kw,
        )
        # Our own views of what vLLM's tier is built on (public arguments).
        self.block_bytes: int = primary_kv_view.strides[0]
        self.file_bytes = HEADER_BYTES + self.block_bytes
        self.primary_bytes = primary_kv_view.cast("B")
        use_o_direct = vllm_compat.fs_tier_uses_o_direct(self)
        self.files = VerifiedBlockFiles(
            self.primary_bytes,
            self.block_bytes,
            bytes.fromhex(digest),
            root_dir,
            auth_key,
            getattr(os, "O_DIRECT", 0) if use_o_direct else 0,
        )
        vllm_compat.quiet_fs_tier_pool_errors(VanishedBlockError)
        # Size bound (fs_budget): stores report, reads touch, stats count.
        self.budget: FsTierBudget | None = None
        # Below the configured root_dir nothing is trusted, the identity
        # directory included: the walks of its files start above it.
        top = (os.path.basename(self.root_dir),)
        if max_bytes is not None:
            self.budget = FsTierBudget(root_dir, max_bytes, self.file_bytes, top)
        logger.info(
            "KV offload: fs tier at %s (identity %s; files carry a header and a "
            "CRC32%s, verified on every read)",
            self.root_dir,
            digest[:16],
            " and an HMAC-SHA256 under the deployment key" if auth_key else "",
        )
        # Temp files of writers that died mid-write (walks the directory).
        threading.Thread(
            target=self._remove_stale_temp_files,
            args=(root_dir, top),
            name="vllm_kv_fs_tmp_sweep",
            daemon=True,
        ).start()

    def _remove_stale_temp_files(self, root: str, top: tuple[str, ...]) -> None:
        removed = remove_stale_temp_files(root, top=top)  # skips what it cannot
        if removed:
            logger.info(
                "KV offload: removed %d temp files under %s left by writers "
                "that are gone",
                removed,
                self.root_dir,
            )

    def _files_of(
        self, job: TransferJob
    ) -> tuple[list[Any], list[str], list[int], list[bytes]]:
        """The job's keys, and its block files' paths, offsets and key ids."""
        keys = list(job.keys)
        paths = [self.file_mapper.get_file_name(k) for k in keys]
        offsets = [int(c) * self.block_bytes for c in job.chunk_ids]
        return keys, paths, offsets, [key_digest(k) for k in keys]

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys, paths, offsets, key_ids = self._files_of(job_metadata)

        def store_task() -> None:
            written = 0
            for path, offset, key in zip(paths, offsets, key_ids, strict=True):
                written += self.files.write(path, offset, key)
            if self.budget is not None and written:
                self.budget.note_stored(written * self.file_bytes)

        vllm_compat.enqueue_fs_tier_store(self, job_metadata.job_id, keys, store_task)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys, paths, offsets, key_ids = self._files_of(job_metadata)

        def load_task() -> None:
            for i, (path, offset, key) in enumerate(
                zip(paths, offsets, key_ids, strict=True)
            ):
                try:
                    self.files.read(path, offset, key)
                except OSError:
                    # Blocks before i are kept; this one and later recompute.
                    vllm_compat.record_fs_tier_load_progress(self, job_id, i)
                    raise
                if self.budget is not None:
                    self.budget.touch(path)

        vllm_compat.enqueue_fs_tier_load(self, job_id, keys, load_task)

    @override
    def shutdown(self) -> None:
        super().shutdown()  # stops the I/O threads
        # Our view of the CPU tier's region keeps its mmap exported: vLLM's
        # region cleanup, which follows, could not close it (BufferError).
        self.primary_bytes.release()
        logger.info("KV offload: fs tier on %s shut down", self.root_dir)

    @override
    def get_stats(self) -> Any:
        stats = super().get_stats()
        ours = self.budget.take_stats() if self.budget is not None else None
        if stats is None or stats.is_empty():
            return ours
        return stats if ours is None else stats.aggregate(ours)


with contextlib.suppress(ValueError):  # registered already (module reloaded)
    SecondaryTierFactory.register_tier(
        VERIFIED_FS_TYPE, __name__, VerifiedFileSystemTier.__name__
    )


def create_json(path: str, data: Any, root: str) -> None:
    """``data`` as ``path`` under ``root`` unless a regular file is there
    (``block_file.create_file``: no symlink followed)."""
    text = json.dumps(data, indent=2, sort_keys=True).encode()
    create_file(path, lambda fd: os.write(fd, text), root)


def tier_dir_usable(tier: Mapping[str, Any], spec: OffloadingSpec) -> bool:
    """Prepares what vLLM's fs tier creates at start (the identity directory,
    the per-model directory and its config.json, without following a
    symlink) and writes identity.json. False, with one error line, when that
    fails (name too long, read-only or not creatable, a path that cannot hold
    directories): the engine then runs without the tier. A read-only
    directory that has all of it already (a reader of a cache others write)
    is usable; its stores fail and are counted."""
    root_dir = tier["root_dir"]
    identity, _ = tier_identity(spec.storage_identity, tier)
    root = identity_root(root_dir, identity_digest(identity))
    try:
        # As FileSystemTierManager.__init__ names it.
        mapper = FileMapper.from_offloading_spec(
            root_dir=root,
            offloading_spec=spec,
            blocks_per_file=spec.blocks_per_chunk,
            parallel_agnostic=True,
        )
        create_json(mapper.get_config_file_path(), mapper.get_run_config(), root_dir)
    except OSError as e:
        logger.error(
            "KV offload: the fs tier directory %s cannot be used (%s); the "
            "engine runs without this tier (CPU tier only). Fix: a writable "
            "root_dir on a file system mounted here, with a short enough path",
            root,
            e,
        )
        return False
    path = os.path.join(root, IDENTITY_FILE)
    try:
        create_json(path, identity, root_dir)
    except OSError as e:
        logger.warning(
            "KV offload: cannot write %s (%s): the fs tier directory is "
            "read-only here; stores to it will fail (and be counted), "
            "existing files are still read",
            path,
            e,
        )
    return True
