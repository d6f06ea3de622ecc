"""The verified ``fs`` tier: vLLM's ``FileSystemTierManager`` (thread pool,
async lookups, events, metrics) storing ``block_file`` files under an
identity directory of ``root_dir``; a file that fails verification is a
miss (the request recomputes), logged and removed. A tier directory that
cannot be created is dropped at start (CPU tier only)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from typing_extensions import override
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
    StoredBlockError,
    key_digest,
    read_block,
    write_block,
)
from vllm_ascend.kv_offload.tiering.identity import (
    IDENTITY_FILE,
    identity_digest,
    identity_root,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = init_logger(__name__)

# Our fs tier, registered under this type; a config's "fs" tiers become it.
VERIFIED_FS_TYPE = "ascend_fs"


class VerifiedFileSystemTier(FileSystemTierManager):
    """vLLM's ``fs`` tier (thread pool, async lookups, atomic renames, events,
    metrics) with an identity directory and verified files
    (``block_file``). Registered as tier type ``ascend_fs``; reports itself as
    ``fs`` in metrics and logs."""

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        **kw: Any,
    ):
        identity = getattr(offloading_spec, "storage_identity", None)
        if identity is None:
            raise OffloadConfigError(
                f"secondary tier type {VERIFIED_FS_TYPE!r} needs spec_name="
                f"{TIERING_SPEC!r} and spec_module_path={TIERING_MODULE!r}"
            )
        digest = identity_digest(identity)
        self.identity_bytes = bytes.fromhex(digest)
        self.user_root_dir = root_dir
        self.root_dir = identity_root(root_dir, digest)
        super().__init__(
            offloading_spec,
            primary_kv_view,
            "fs" if tier_type == VERIFIED_FS_TYPE else tier_type,
            self.root_dir,
            **kw,
        )
        # Our own views of what vLLM's tier is built on (public arguments).
        self.block_bytes: int = primary_kv_view.strides[0]
        self.primary_bytes = primary_kv_view.cast("B")
        use_o_direct = vllm_compat.fs_tier_uses_o_direct(self)
        self._o_direct = getattr(os, "O_DIRECT", 0) if use_o_direct else 0
        self._rejected = 0
        logger.info(
            "KV offload: fs tier at %s (identity %s; files carry a header and a "
            "CRC32, verified on every read)",
            self.root_dir,
            digest[:16],
        )

    def _paths_and_offsets(
        self, job: TransferJob
    ) -> tuple[list[str], list[int], list[bytes]]:
        keys = list(job.keys)
        paths = [self.file_mapper.get_file_name(k) for k in keys]
        offsets = [int(c) * self.block_bytes for c in job.chunk_ids]
        return paths, offsets, [key_digest(k) for k in keys]

    def _payload(self, offset: int) -> memoryview:
        return self.primary_bytes[offset : offset + self.block_bytes]

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        paths, offsets, key_ids = self._paths_and_offsets(job_metadata)

        def store_task() -> None:
            for path, offset, key in zip(paths, offsets, key_ids, strict=True):
                write_block(
                    path,
                    self._payload(offset),
                    self.identity_bytes,
                    key,
                    self._o_direct,
                )

        vllm_compat.enqueue_fs_tier_store(self, job_metadata.job_id, keys, store_task)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        paths, offsets, key_ids = self._paths_and_offsets(job_metadata)

        def load_task() -> None:
            for i, (path, offset, key) in enumerate(
                zip(paths, offsets, key_ids, strict=True)
            ):
                try:
                    read_block(
                        path,
                        self._payload(offset),
                        self.identity_bytes,
                        key,
                        self._o_direct,
                    )
                except OSError as exc:
                    # Blocks before i are kept; this one and later recompute.
                    vllm_compat.record_fs_tier_load_progress(self, job_id, i)
                    self._log_rejected(path, exc)
                    raise

        vllm_compat.enqueue_fs_tier_load(self, job_id, keys, load_task)

    def _log_rejected(self, path: str, exc: OSError) -> None:
        self._rejected += 1
        if isinstance(exc, StoredBlockError):
            logger.warning(
                "KV offload: fs tier file %s is not loaded (%s); the request "
                "recomputes those tokens, the file is removed",
                path,
                exc.strerror,
            )
            with contextlib.suppress(OSError):
                os.remove(path)
        else:
            logger.warning(
                "KV offload: fs tier file %s could not be read (%s); the request "
                "recomputes those tokens",
                path,
                exc,
            )

    @classmethod
    @override
    def build_metric_definitions(cls, tier_config: dict[str, Any]) -> dict[str, Any]:
        return FileSystemTierManager.build_metric_definitions(tier_config)


with contextlib.suppress(ValueError):  # registered already (module reloaded)
    SecondaryTierFactory.register_tier(
        VERIFIED_FS_TYPE, __name__, VerifiedFileSystemTier.__name__
    )


def tier_dir_usable(root_dir: str, identity: Mapping[str, Any]) -> bool:
    """Creates the identity directory and its identity.json. False (and a log
    line) when the directory cannot even be created; a read-only directory
    that exists (a reader of a cache others write) is usable."""
    root = identity_root(root_dir, identity_digest(identity))
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        logger.error(
            "KV offload: the fs tier directory %s cannot be created (%s); the "
            "engine runs without this tier (CPU tier only). Fix: make root_dir "
            "writable, or point it at a shared file system mounted here",
            root,
            e,
        )
        return False
    path = os.path.join(root, IDENTITY_FILE)
    if not os.path.exists(path):
        try:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(identity, f, indent=2, sort_keys=True)
            os.replace(tmp, path)
        except OSError as e:
            logger.warning(
                "KV offload: cannot write %s (%s): the fs tier directory is "
                "read-only here; stores to it will fail (and be counted), "
                "existing files are still read",
                path,
                e,
            )
    return True
