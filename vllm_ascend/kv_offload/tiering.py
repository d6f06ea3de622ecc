"""``NPUTieringOffloadingSpec``: device -> CPU -> shared storage tiering.

Loaded by vLLM's ``OffloadingConnector`` through::

    "spec_name": "NPUTieringOffloadingSpec",
    "spec_module_path": "vllm_ascend.kv_offload.tiering",

It is vLLM's tiering framework (``vllm/v1/kv_offload/tiering/``) with our
worker as the primary tier's device side:

* scheduler side: vLLM's ``TieringOffloadingManager`` (a CPU primary tier in
  one ``/dev/shm`` region, secondary tiers such as ``fs``), wrapped in
  ``FailureAwareManager`` like ``NPUOffloadingSpec``'s manager, so our
  connector serves this spec too (it subclasses ``NPUOffloadingSpec``);
* worker side: ``NPUOffloadingWorker`` on the shared region instead of a
  private pool (``RegionBlockPool``: this rank's slot of each region row).
  vLLM's inherited ``get_worker`` refuses every platform but CUDA and XPU;
  this one runs on ``cpu`` (vLLM's CPU backend), ``cuda`` (the region
  registered with ``cudaHostRegister`` through vLLM's ``pin_mmap_region``)
  and ``npu`` (the region registered with ACL as page-locked host memory,
  ``aclrtHostRegisterV2(..., ACL_HOST_REG_PINNED)``, at worker start and
  unregistered at shutdown before it is unmapped: ``AclRegionRegistration``;
  compiled and simulated only, never run on an NPU).

What this layer adds to vLLM's ``fs`` tier (``VerifiedFileSystemTier``):

* an identity directory: every ``fs`` tier's ``root_dir`` gets a component
  ``ascend-kv-<digest>`` derived from what makes stored bytes usable by
  another instance (model and its config.json, KV dtype, block sizes, KV
  cache layout, TP/PP/CP sizes, device kind, the row layout of this
  package). vLLM's own file naming collapses TP sizes when it thinks the
  bytes are portable, which they are not with our per-rank rows;
* a header in every file (magic, format version, identity digest, the key,
  the payload length, a CRC32 of the payload), verified on every read: a
  file that is short, long, foreign or corrupted is a miss (the request
  recomputes), is logged, and is removed;
* a tier directory that cannot be created is logged and dropped (the engine
  runs with the CPU tier only) instead of failing the start.

And to the shared-memory region (``open_region``): a region file left in
``/dev/shm`` by a run that died (vLLM unlinks it only on clean shutdown) is
removed before the next run with the same ``engine_id`` creates its own;
liveness is a shared ``flock`` that every process mapping the region holds.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import hashlib
import itertools
import json
import mmap
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingWorker,
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from vllm_ascend.kv_offload import vllm_compat
from vllm_ascend.kv_offload.cpu_pool import CpuBlockPool, PoolLayout
from vllm_ascend.kv_offload.host_memory import borrowed
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.manager import FailureAwareManager
from vllm_ascend.kv_offload.npu import NPUOffloadingSpec, OffloadConfigError
from vllm_ascend.kv_offload.worker import NPUOffloadingWorker

logger = init_logger(__name__)

SPEC_NAME = "NPUTieringOffloadingSpec"
SPEC_MODULE = "vllm_ascend.kv_offload.tiering"
PREFIX = "kv_connector_extra_config"
# Our fs tier, registered under this type; a config's "fs" tiers become it.
VERIFIED_FS_TYPE = "ascend_fs"
# Bumped whenever the bytes a file holds change meaning (row layout, header).
FORMAT = "vllm-ascend-kv-offload/rows-v1"
IDENTITY_DIR_PREFIX = "ascend-kv-"
IDENTITY_FILE = "identity.json"
SHM_DIR = "/dev/shm"

# -- identity ---------------------------------------------------------------


def _model_fingerprint(model: str) -> str | None:
    """sha256 of a local model's config.json (None for a hub id): two
    checkpoints at one path with different architectures never match."""
    path = os.path.join(model, "config.json")
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def storage_identity(config: OffloadingConfig, device_type: str) -> dict[str, Any]:
    """What must be equal for one instance's stored KV bytes to be valid in
    another. The scheduler side computes it (it owns the secondary tiers)."""
    parallel = config.parallel
    return {
        "format": FORMAT,
        "device_type": device_type,
        "model": config.model.name,
        "model_config_sha256": _model_fingerprint(config.model.name),
        "kv_dtype": config.model.dtype,
        "kv_cache_layout": config.kv_cache_layout,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [
            {"tokens_per_block": g.tokens_per_block, "layers": list(g.layer_names)}
            for g in config.groups
        ],
        "world_size": parallel.world_size,
        "tp_size": parallel.tp_size,
        "pp_size": parallel.pp_size,
        "pcp_size": parallel.pcp_size,
        "dcp_size": parallel.dcp_size,
        "replicated_layout": config.replicated_layout,
    }


def identity_digest(identity: Mapping[str, Any]) -> str:
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def identity_root(root_dir: str, digest: str) -> str:
    return os.path.join(root_dir, f"{IDENTITY_DIR_PREFIX}{digest[:16]}")


# -- verified files ---------------------------------------------------------

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


class VerifiedFileSystemTier(FileSystemTierManager):
    """vLLM's ``fs`` tier (thread pool, async lookups, atomic renames, events,
    metrics) with an identity directory and verified files; see the module
    docstring. Registered as tier type ``ascend_fs``; reports itself as
    ``fs`` in metrics and logs."""

    def __init__(self, offloading_spec, primary_kv_view, tier_type, root_dir, **kw):
        identity = getattr(offloading_spec, "storage_identity", None)
        if identity is None:
            raise OffloadConfigError(
                f"secondary tier type {VERIFIED_FS_TYPE!r} needs spec_name="
                f"{SPEC_NAME!r} and spec_module_path={SPEC_MODULE!r}"
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
        self._o_direct = getattr(os, "O_DIRECT", 0) if self._use_o_direct else 0
        self._rejected = 0
        logger.info(
            "KV offload: fs tier at %s (identity %s; files carry a header and a "
            "CRC32, verified on every read)",
            self.root_dir,
            digest[:16],
        )

    def _paths_and_offsets(self, job) -> tuple[list[str], list[int], list[bytes]]:
        keys = list(job.keys)
        paths = [self.file_mapper.get_file_name(k) for k in keys]
        offsets = [int(c) * self._block_size for c in job.chunk_ids]
        return paths, offsets, [key_digest(k) for k in keys]

    def _payload(self, offset: int) -> memoryview:
        return self._primary_kv_view.cast("B")[offset : offset + self._block_size]

    def submit_store(self, job_metadata) -> None:
        keys = list(job_metadata.keys)
        if self.events is not None:
            self._store_job_keys[job_metadata.job_id] = keys
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

        vllm_compat.count_fs_tier_job_blocks(self, job_metadata.job_id, len(keys))
        self._pool.enqueue_store(job_metadata.job_id, 1, [store_task])

    def submit_load(self, job_metadata) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        self._load_job_keys[job_id] = keys
        vllm_compat.count_fs_tier_job_blocks(self, job_id, len(keys))
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
                    self._load_progress[job_id] = i
                    self._log_rejected(path, exc)
                    raise

        self._pool.enqueue_load(job_id, 1, [load_task])

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
    def build_metric_definitions(cls, tier_config):
        return FileSystemTierManager.build_metric_definitions(tier_config)


with contextlib.suppress(ValueError):  # registered already (module reloaded)
    SecondaryTierFactory.register_tier(
        VERIFIED_FS_TYPE, SPEC_MODULE, VerifiedFileSystemTier.__name__
    )


def _tier_dir_usable(root_dir: str, identity: Mapping[str, Any]) -> bool:
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


# -- the shared region ------------------------------------------------------


def region_path(engine_id: str) -> str:
    """Where vLLM's ``SharedOffloadRegion`` puts an engine's region."""
    return os.path.join(SHM_DIR, f"vllm_offload_{engine_id}.mmap")


@contextlib.contextmanager
def _shm_lock() -> Iterator[None]:
    """Serialises region creation between this package's processes."""
    fd = os.open(SHM_DIR, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def remove_stale_region(path: str) -> bool:
    """Removes ``path`` if no process holds it (every process that maps a
    region of ours holds a shared flock on it until it unmaps or dies)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live engine maps it
        os.unlink(path)
        logger.warning(
            "KV offload: removed %s, a shared region left by a run that ended "
            "without cleanup (crash or kill); this run creates its own",
            path,
        )
        return True
    finally:
        os.close(fd)


def hold_region(region: SharedOffloadRegion) -> None:
    """Marks ``region`` live for ``remove_stale_region`` (until its fd closes)."""
    if region.fd is not None:
        fcntl.flock(region.fd, fcntl.LOCK_SH)


def open_region(**kwargs: Any) -> SharedOffloadRegion:
    """``SharedOffloadRegion(**kwargs)`` after removing a stale file of the
    same name; the region is held (``hold_region``) before anyone else can
    look at it."""
    with _shm_lock():
        remove_stale_region(region_path(kwargs["engine_id"]))
        region = SharedOffloadRegion(**kwargs)
        try:
            hold_region(region)
        except OSError:
            region.cleanup()
            raise
    return region


class RegionBlockPool(CpuBlockPool):
    """Region mode of the CPU block pool: this rank's slot of each row of a
    shared region, which it does not own (``release`` frees nothing).

    ``row_bytes`` is the stride from one CPU block to the next (the region's
    row: every rank's slot, padded), as ``CopyEngine.build`` addresses rows;
    ``slot_bytes`` is what this rank uses of it.
    """

    def __init__(
        self,
        region: SharedOffloadRegion,
        page_bytes: list[int],
        blocks_per_chunk: int,
        slot_offset: int,
        slot_capacity: int,
        row_stride: int,
    ):
        layout = PoolLayout.of(
            page_bytes,
            blocks_per_chunk,
            region.num_chunks,
            slot_offset=slot_offset,
            row_bytes=row_stride,
        )
        if layout.slot_bytes > slot_capacity:
            raise OffloadConfigError(
                f"KV offload: this worker's KV of one CPU block is "
                f"{layout.slot_bytes} bytes, more than its slot of the shared "
                f"region ({slot_capacity} bytes); the KV cache layout is not "
                "one vLLM sized the region for (report this as a bug)"
            )
        # A reference, not an allocation: the region's owner unmaps it.
        super().__init__(layout, borrowed(region.base_tensor, pinned=False))
        self.region = region

    def mark_pinned(self, pinned: bool) -> None:
        """The region was (or was not) page-locked after the pool was built."""
        self.memory.pinned = pinned


def _kernel_release() -> str:
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


class AclRegionRegistration:
    """The shared region registered with ACL as page-locked host memory, so
    that the npu copy backend accepts it (it refuses pageable memory).

    Registers the whole mapping of this process (every rank's slots, as
    vLLM's CUDA worker does) through the native op
    ``kv_offload_host_register`` (``aclrtHostRegisterV2(..., ACL_HOST_REG_PINNED)``,
    then a check that ACL reports it as page-locked host memory);
    ``release`` unregisters it, which must happen after the copies have
    stopped and before the region is unmapped. Compiled against the
    torch-npu headers and tested against a simulated ACL runtime only.
    """

    def __init__(
        self,
        region: SharedOffloadRegion,
        register=None,
        unregister=None,
        kernel_release: str | None = None,
    ):
        from vllm_ascend.kv_offload import ops

        self._unregister = unregister or ops.host_unregister
        register = register or ops.host_register
        self.addr = region.base_tensor.data_ptr()
        self.nbytes = region.total_size_bytes
        where = (
            f"the shared region {region.mmap_path} ({self.nbytes} bytes at "
            f"{self.addr:#x})"
        )
        release = kernel_release or _kernel_release()
        if not kernel_registers_pageable_memory(release):
            raise OffloadConfigError(
                f"{SPEC_NAME} on npu needs {where} registered with ACL as "
                "page-locked memory, which CANN supports for pageable memory "
                f"on Linux kernels newer than 5.10 only (this one is "
                f"{release}); use spec_name='NPUOffloadingSpec' (a pinned "
                "private pool) on this host, or a newer kernel"
            )
        t0 = time.perf_counter()
        try:
            register(self.addr, self.nbytes, "npu")
        except RuntimeError as e:
            self.addr = 0
            raise OffloadConfigError(
                f"{SPEC_NAME} on npu: registering {where} with ACL failed, and "
                "the NPU copy backend copies page-locked host memory only: "
                f"{e}. Fix: a CANN release with aclrtHostRegisterV2 (its 8.5 "
                "documentation has it) on an Atlas A2/A3, a smaller region "
                "(num_cpu_blocks or cpu_bytes_to_use) if the host cannot lock "
                "that much memory, or spec_name='NPUOffloadingSpec' (a pinned "
                "private pool, no tiering)"
            ) from e
        logger.info(
            "KV offload: registered %s with ACL as page-locked memory in %.2f s",
            where,
            time.perf_counter() - t0,
        )

    def release(self) -> None:
        """Unregisters (once); logs instead of raising, as it runs at
        shutdown."""
        addr, self.addr = self.addr, 0
        if not addr:
            return
        try:
            self._unregister(addr, "npu")
        except RuntimeError as e:
            logger.warning(
                "KV offload: unregistering the shared region at %#x from ACL "
                "failed: %s",
                addr,
                e,
            )


def close_region(
    region: SharedOffloadRegion, registration: AclRegionRegistration | None
) -> None:
    """Unregisters the region from ACL (if it was), then unmaps it (and
    removes its file if this process created it)."""
    try:
        if registration is not None:
            registration.release()
    finally:
        region.cleanup()


class NPUTieringWorker(NPUOffloadingWorker):
    """Our worker on a shared region, which it unregisters from ACL (npu),
    unmaps and, if it created it, removes once its copies have stopped."""

    def __init__(
        self,
        kv_caches,
        region: SharedOffloadRegion,
        pool: RegionBlockPool,
        registration: AclRegionRegistration | None = None,
    ):
        self.region = region
        self.registration = registration
        super().__init__(
            kv_caches,
            blocks_per_chunk=pool.blocks_per_chunk,
            num_cpu_blocks=pool.num_blocks,
            pool=pool,
        )

    def shutdown(self) -> None:
        if self._closed:
            return
        super().shutdown()
        if self.pool.tensor is None:  # copies stopped, the pool let go
            close_region(self.region, self.registration)
        else:
            logger.warning(
                "KV offload: copies still running at shutdown; the shared "
                "region %s stays mapped until the process exits",
                self.region.mmap_path,
            )


# -- configuration ----------------------------------------------------------


def check_tiering_config(extra: Mapping[str, Any]) -> None:
    """What this spec cannot do, refused before anything is allocated."""
    if extra.get("canonical_layout"):
        raise OffloadConfigError(
            f"{PREFIX}['canonical_layout']={extra['canonical_layout']!r} is not "
            f"supported by {SPEC_NAME}: its worker stores each rank's KV in its "
            "own layout (files are shared only between identical deployments); "
            "remove canonical_layout"
        )
    threshold = extra.get("store_threshold")
    if threshold is not None and not isinstance(threshold, bool):
        if isinstance(threshold, int | float) and threshold >= 2:
            raise OffloadConfigError(
                f"{PREFIX}['store_threshold']={threshold!r} is not supported by "
                f"{SPEC_NAME} (vLLM's tiering manager stores every block); "
                "remove store_threshold, or use spec_name='NPUOffloadingSpec'"
            )
    tiers = extra.get("secondary_tiers", [])
    if tiers is None:
        tiers = []
    if not isinstance(tiers, list | tuple):
        raise OffloadConfigError(
            f"{PREFIX}['secondary_tiers'] must be a list of tier configs, e.g. "
            '[{"type": "fs", "root_dir": "/mnt/shared/kv"}]; got '
            f"{type(tiers).__name__}"
        )
    for i, tier in enumerate(tiers):
        where = f"{PREFIX}['secondary_tiers'][{i}]"
        if not isinstance(tier, Mapping) or not tier.get("type"):
            raise OffloadConfigError(
                f"{where} must be a dict with a 'type', e.g. "
                '{"type": "fs", "root_dir": "/mnt/shared/kv"}'
            )
        if tier["type"] in ("fs", VERIFIED_FS_TYPE):
            root = tier.get("root_dir")
            if not isinstance(root, str) or not root:
                raise OffloadConfigError(
                    f"{where} (type {tier['type']!r}) needs 'root_dir', a "
                    "directory on a file system every node mounts, e.g. "
                    '"root_dir": "/mnt/shared/kv"'
                )
    backpressure = extra.get("backpressure")
    if backpressure is not None and not isinstance(backpressure, Mapping):
        raise OffloadConfigError(
            f"{PREFIX}['backpressure'] must be a dict (vLLM's tiering "
            "back-pressure settings, e.g. {'backpressure_cls': "
            f"'EMABackpressureDetector'}}); got {type(backpressure).__name__}"
        )


def _device_type() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


class NPUTieringOffloadingSpec(TieringOffloadingSpec, NPUOffloadingSpec):
    """vLLM's tiering (CPU primary tier in ``/dev/shm``, secondary tiers)
    with ``NPUOffloadingSpec``'s configuration, worker and connector.

    Keys: the guide's (``num_cpu_blocks``, ``block_size``) or vLLM's
    (``cpu_bytes_to_use``, ``blocks_per_chunk``, ``eviction_policy``, ...),
    plus tiering's ``secondary_tiers`` and ``backpressure``. The pool is the
    region: ``num_cpu_blocks`` rows of all ranks' KV of one CPU block.
    """

    _tiering_worker: NPUTieringWorker | None = None

    def __init__(self, config: OffloadingConfig):
        check_tiering_config(config.extra_config)
        # MRO: TieringOffloadingSpec -> NPUOffloadingSpec (keys, num_cpu_blocks)
        # -> CPUOffloadingSpec; then tiering reads secondary_tiers.
        super().__init__(config)
        self.storage_identity = storage_identity(config, _device_type())
        tiers = []
        for tier in copy.deepcopy(self.secondary_tier_configs):
            if tier.get("type") == "fs":
                tier["type"] = VERIFIED_FS_TYPE
            elif tier.get("type") != VERIFIED_FS_TYPE:
                logger.warning(
                    "KV offload: secondary tier %r runs as vLLM ships it; the "
                    "identity and checksum checks of this package cover 'fs' only",
                    tier.get("type"),
                )
            tiers.append(tier)
        self.secondary_tier_configs = tiers

    def get_manager(self) -> OffloadingManager:
        if self._failure_aware_manager is None:
            self.secondary_tier_configs = [
                t
                for t in self.secondary_tier_configs
                if t["type"] != VERIFIED_FS_TYPE
                or _tier_dir_usable(t["root_dir"], self.storage_identity)
            ]
            inner = TieringOffloadingSpec.get_manager(self)
            if self._scheduler_mmap is not None:
                hold_region(self._scheduler_mmap)
            self._failure_aware_manager = FailureAwareManager(inner)
        return self._failure_aware_manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._tiering_worker is not None:
            return self._tiering_worker
        device = kv_caches.tensors[0].tensor.device
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = open_region(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        registration = None
        try:
            pool = RegionBlockPool(
                region,
                [t.page_size_bytes for t in kv_caches.tensors],
                self.blocks_per_chunk,
                slot_offset=rank * self.cpu_page_size_per_worker,
                slot_capacity=self.cpu_page_size_per_worker,
                row_stride=self.kv_bytes_per_chunk,
            )
            if device.type == "cuda":
                _register_with_cuda(region, pool)
            elif device.type == "npu":
                # The NPU copy backend refuses pageable host memory.
                registration = AclRegionRegistration(region)
                pool.mark_pinned(True)
            self._tiering_worker = NPUTieringWorker(
                kv_caches, region, pool, registration
            )
        except BaseException:
            close_region(region, registration)
            raise
        logger.info(
            "KV offload: %s worker on shared region %s: %d rows of %d bytes, "
            "this rank's slot %d bytes at offset %d",
            SPEC_NAME,
            region.mmap_path,
            region.num_chunks,
            self.kv_bytes_per_chunk,
            pool.slot_bytes,
            rank * self.cpu_page_size_per_worker,
        )
        return self._tiering_worker


def _register_with_cuda(region: SharedOffloadRegion, pool: RegionBlockPool) -> None:
    """cudaHostRegister the region exactly as vLLM's CUDA worker does: its
    ``pin_mmap_region`` (row-aligned chunks of at most 64 GiB, rolled back on
    failure, where vLLM pins memory at all). The region's ``cleanup`` then
    unregisters the chunks (vLLM's ``host_unregister``) before it unmaps.
    A failure leaves the region pageable, which the cuda backend copies too
    (slower)."""
    from vllm.utils.torch_utils import PIN_MEMORY
    from vllm.v1.kv_offload.cpu.gpu_worker import pin_mmap_region

    if PIN_MEMORY:
        pin_mmap_region(region)
    pool.mark_pinned(region.is_pinned)
