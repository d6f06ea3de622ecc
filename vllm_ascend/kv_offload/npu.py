"""``NPUOffloadingSpec``: KV-cache CPU offloading for Ascend NPUs.

Loaded by vLLM's ``OffloadingConnector`` through::

    "spec_name": "NPUOffloadingSpec",
    "spec_module_path": "vllm_ascend.kv_offload.npu",

The scheduler side is vLLM's own: ``CPUOffloadingSpec`` sizes the pool and
builds ``CPUOffloadingManager`` with its LRU/ARC policies, KV events and
metrics. This spec changes two things:

* configuration: it accepts the Ascend guide's ``num_cpu_blocks`` (a count of
  CPU blocks of ``block_size`` tokens) besides vLLM's ``cpu_bytes_to_use``,
  and refuses values it cannot use at start-up, before the pool exists, with
  one error that names the setting, the value and the fix;
* the worker: upstream's refuses every platform but CUDA and XPU, ours runs
  on ``npu``, ``cuda`` and ``cpu`` (see ``worker.py``).

Validation happens in three places because each sees different things: the
connector (``connector.py``) sees ``kv_role`` and the device block size
before vLLM derives the chunk size (``validate_connector_config``); this spec
sees the sizes of a KV block (``resolve_extra_config``); the worker side of
this spec, right before it allocates the pool, sees the host memory left
after vLLM's own allocations (``check_host_memory``). Every key and the type
of its value are checked by ``extra_config.check_keys``, from the first two.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import psutil
from vllm.utils.math_utils import round_up
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from vllm_ascend.kv_offload.extra_config import (
    PREFIX,
    OffloadConfigError,
    check_keys,
    int_setting,
    shown,
)
from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.manager import FailureAwareManager
from vllm_ascend.kv_offload.worker import NPUOffloadingWorker

logger = init_logger(__name__)

KV_ROLE = "kv_both"
# The pool may take at most this share of the host memory available when it
# is allocated: the rest is headroom for the engine, the tokenizer and the OS.
MAX_HOST_MEMORY_FRACTION = 0.9
# Far beyond any host; catches typos (an extra digit group) even before the
# size of a block is known.
MAX_CPU_BLOCKS = 2**31 - 1
# Where vLLM's CPU backend sizes its KV cache (GiB), besides kv_cache_memory_bytes.
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def validate_connector_config(
    kv_role: str | None,
    extra: dict[str, Any],
    device_block_sizes: Iterable[int],
) -> None:
    """Checks the connector can run before vLLM derives its chunk size.

    ``device_block_sizes``: tokens per device block of the offloaded KV cache
    groups. vLLM itself would fail on some of these later, with an assertion
    or a bare ``int()`` error; here each fails with its key and its fix.
    """
    check_keys(extra)
    if kv_role != KV_ROLE:
        raise OffloadConfigError(
            f"kv_transfer_config.kv_role={kv_role!r} cannot be used with "
            f"OffloadingConnector, which both stores KV to the CPU and loads it "
            f"back; set kv_role='{KV_ROLE}'"
        )
    block_size = int_setting(extra, "block_size")
    blocks_per_chunk = int_setting(extra, "blocks_per_chunk")
    if block_size is not None and blocks_per_chunk is not None:
        raise OffloadConfigError(
            f"{PREFIX} sets both block_size={block_size} and "
            f"blocks_per_chunk={blocks_per_chunk}, which say the same thing in "
            "tokens and in device blocks; set only one of them"
        )
    sizes = sorted(set(device_block_sizes))
    if block_size is None or not sizes:
        return
    if len(sizes) > 1:
        raise OffloadConfigError(
            f"{PREFIX}['block_size']={block_size} needs one device block size, "
            f"but the offloaded KV cache groups use {sizes} tokens per block; "
            "drop block_size and set blocks_per_chunk (device blocks per CPU "
            "block) instead"
        )
    device = sizes[0]
    if block_size % device:
        lower = block_size // device * device
        fix = f"set block_size to {round_up(block_size, device)}"
        if lower > 0:
            fix += f" or {lower}"
        raise OffloadConfigError(
            f"{PREFIX}['block_size']={block_size} must be a multiple of the "
            f"device KV cache block size ({device} tokens); {fix}"
        )


def cpu_block_bytes(config: OffloadingConfig) -> int:
    """Bytes of one CPU block, as vLLM's spec sizes it (all workers, padded)."""
    kv_bytes = (
        config.worker_kv_bytes_per_block
        * config.parallel.world_size
        * config.cache.blocks_per_chunk
    )
    return round_up(kv_bytes, CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)


def host_available_bytes() -> int:
    """Host memory available now (a function so that tests can replace it)."""
    return int(psutil.virtual_memory().available)


def _size(nbytes: int) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.2f} MiB"


def host_kv_cache_bytes(kv_caches: CanonicalKVCaches) -> int:
    """Bytes of the device KV cache that live in host memory: all of it on
    vLLM's CPU backend, none on an accelerator. Tensors may share storage."""
    storages = {}
    for t in kv_caches.tensors:
        if t.tensor.device.type == "cpu":
            storage = t.tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@dataclass(frozen=True)
class PoolRequest:
    """One worker's CPU block pool, as the user asked for it."""

    num_blocks: int
    row_bytes: int  # host bytes of one CPU block in this worker's pool
    key: str  # the setting that sized it: num_cpu_blocks or cpu_bytes_to_use
    value: Any  # its value as given
    # Bytes of one CPU block over all workers, padded: cpu_bytes_to_use's unit.
    all_workers_block_bytes: int
    blocks_per_chunk: int
    chunk_key: str  # the setting that sized a CPU block: block_size or blocks_per_chunk
    device_block_tokens: int


def check_host_memory(pool: PoolRequest, host_kv_bytes: int) -> None:
    """Refuses a pool that would not fit in the host memory available now.

    Called once, by the worker that is about to allocate the pool (the
    scheduler side allocates nothing, and by the time it starts the pools
    exist), so nothing it counts is counted twice: vLLM's allocations so far,
    the KV cache of its CPU backend included (``host_kv_bytes``), are no
    longer available, and the pool is the one large allocation still to
    come. Each worker checks its own pool; workers allocating at the same
    moment do not see each other's.
    """
    need = pool.num_blocks * pool.row_bytes
    available = host_available_bytes()
    limit = int(available * MAX_HOST_MEMORY_FRACTION)
    fit = limit // pool.row_bytes
    if need <= limit:
        logger.info(
            "KV offload: host memory check passed: %d CPU blocks (%s) fit in "
            "%.0f%% of the %s available (at most %d blocks)",
            pool.num_blocks,
            _size(need),
            MAX_HOST_MEMORY_FRACTION * 100,
            _size(available),
            fit,
        )
        return
    asked = (
        f"{PREFIX}['{pool.key}']={shown(pool.value)} asks for a CPU pool of "
        f"{_size(need)} ({pool.num_blocks} blocks of {pool.row_bytes} bytes)"
    )
    room = (
        f"{MAX_HOST_MEMORY_FRACTION:.0%} of the {_size(available)} of host memory "
        "available"
    )
    if fit == 0:
        raise OffloadConfigError(
            f"{asked}, but one CPU block ({pool.row_bytes} bytes) alone is more "
            f"than {room}: no pool fits; make CPU blocks smaller "
            f"({_smaller_blocks(pool)}), or free host memory"
        )
    fix = (
        f"lower num_cpu_blocks to {fit}"
        if pool.key == "num_cpu_blocks"
        else f"lower cpu_bytes_to_use to {fit * pool.all_workers_block_bytes}"
    )
    raise OffloadConfigError(
        f"{asked}, more than {room}; {fix}{_kv_cache_fix(need - limit, host_kv_bytes)}"
        ", or free host memory"
    )


def _smaller_blocks(pool: PoolRequest) -> str:
    device = pool.device_block_tokens
    if pool.blocks_per_chunk > 1 and pool.chunk_key == "blocks_per_chunk":
        return f"lower blocks_per_chunk from {pool.blocks_per_chunk} to 1"
    if pool.blocks_per_chunk > 1:
        tokens = pool.blocks_per_chunk * device
        return f"lower block_size from {tokens} to {device} tokens"
    return (
        f"a CPU block is one device block ({device} tokens) already: a smaller "
        "device KV block size (vLLM's block_size) or KV cache dtype makes it smaller"
    )


def _kv_cache_fix(excess: int, host_kv_bytes: int) -> str:
    """The other fix where the device KV cache is host memory as well."""
    # The pool may take this share of whatever the KV cache gives back.
    shrink = math.ceil(excess / MAX_HOST_MEMORY_FRACTION)
    if host_kv_bytes == 0 or shrink >= host_kv_bytes:
        return ""
    setting = os.environ.get(CPU_KV_CACHE_ENV)
    how = (
        f"{CPU_KV_CACHE_ENV}={setting} GiB sets it"
        if setting
        else "kv_cache_memory_bytes or gpu_memory_utilization sets it"
    )
    return (
        f", or shrink the KV cache of vLLM's CPU backend, which takes "
        f"{_size(host_kv_bytes)} of host memory ({how}), by at least "
        f"{_size(shrink)}"
    )


def resolve_extra_config(config: OffloadingConfig) -> tuple[dict[str, Any], int | None]:
    """Validate the offloading keys and express the pool size in bytes.

    Returns vLLM-native extra config (``cpu_bytes_to_use`` always set) and the
    guide's ``num_cpu_blocks`` if it was given. Host memory is not looked at
    here (``check_host_memory`` does, when the pool is allocated).
    """
    given = config.extra_config
    check_keys(given)
    extra = dict(given)
    num_cpu_blocks = int_setting(extra, "num_cpu_blocks")
    cpu_bytes = int_setting(extra, "cpu_bytes_to_use")
    block_bytes = cpu_block_bytes(config)

    if num_cpu_blocks is None and cpu_bytes is None:
        raise OffloadConfigError(
            f"{PREFIX} needs the CPU pool size: set 'num_cpu_blocks' (CPU "
            "blocks of 'block_size' tokens, e.g. 1000) or 'cpu_bytes_to_use' "
            "(bytes)"
        )
    if num_cpu_blocks is not None and num_cpu_blocks > MAX_CPU_BLOCKS:
        raise OffloadConfigError(
            f"{PREFIX}['num_cpu_blocks']={shown(given['num_cpu_blocks'])} is not "
            f"a plausible pool size (at most {MAX_CPU_BLOCKS}); lower "
            "num_cpu_blocks to what host memory holds, e.g. 1000"
        )
    if num_cpu_blocks is not None and cpu_bytes is not None and block_bytes > 0:
        if cpu_bytes // block_bytes != num_cpu_blocks:
            raise OffloadConfigError(
                f"{PREFIX} sets num_cpu_blocks={num_cpu_blocks} and "
                f"cpu_bytes_to_use={shown(given['cpu_bytes_to_use'])}, which "
                f"hold {shown(cpu_bytes // block_bytes)} blocks of {block_bytes} "
                "bytes; set only one of them"
            )
    if block_bytes > 0 and num_cpu_blocks is None:
        assert cpu_bytes is not None
        if cpu_bytes < block_bytes:
            raise OffloadConfigError(
                f"{PREFIX}['cpu_bytes_to_use']={shown(given['cpu_bytes_to_use'])} "
                f"holds no CPU block ({block_bytes} bytes each); set "
                f"cpu_bytes_to_use to at least {block_bytes}, or num_cpu_blocks "
                "instead"
            )
        if cpu_bytes // block_bytes > MAX_CPU_BLOCKS:
            raise OffloadConfigError(
                f"{PREFIX}['cpu_bytes_to_use']={shown(given['cpu_bytes_to_use'])} "
                f"is not a plausible pool size (more than {MAX_CPU_BLOCKS} blocks "
                f"of {block_bytes} bytes); lower cpu_bytes_to_use to what host "
                "memory holds"
            )
    if num_cpu_blocks is not None and cpu_bytes is None:
        # vLLM's spec insists on a non-zero byte count even before the KV
        # cache exists (block_bytes == 0); the block count below wins anyway.
        extra["cpu_bytes_to_use"] = num_cpu_blocks * max(block_bytes, 1)
    return extra, num_cpu_blocks


class NPUOffloadingSpec(CPUOffloadingSpec):
    """Offloads KV blocks to a CPU block pool; runs on npu, cuda and cpu."""

    def __init__(self, config: OffloadingConfig):
        extra, num_cpu_blocks = resolve_extra_config(config)
        super().__init__(dataclasses.replace(config, extra_config=extra))
        if num_cpu_blocks is not None and config.worker_kv_bytes_per_block > 0:
            # The guide's meaning, exactly: this many CPU blocks.
            self.num_chunks = num_cpu_blocks
        logger.info(
            "NPUOffloadingSpec: %d CPU blocks of %d tokens (%d device blocks "
            "each), eviction policy %s",
            self.num_chunks,
            self.blocks_per_chunk * self.tokens_per_block[0],
            self.blocks_per_chunk,
            self.eviction_policy,
        )

    # The worker this spec builds; a subclass may substitute its own.
    worker_cls: type[NPUOffloadingWorker] = NPUOffloadingWorker
    _failure_aware_manager: FailureAwareManager | None = None

    def _uses_shared_region(self) -> bool:
        # Each worker owns a private pool; no cross-rank shared mmap region.
        return False

    def get_manager(self) -> OffloadingManager:
        """vLLM's manager (LRU/ARC, events, metrics), told about failed
        transfers by our connector (``manager.py``)."""
        if self._failure_aware_manager is None:
            self._failure_aware_manager = FailureAwareManager(super().get_manager())
        return self._failure_aware_manager

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]):
        # vLLM's reads store_threshold with a bare int(), in the front end.
        check_keys(extra_config)
        return super().build_metric_definitions(extra_config)

    def _pool_request(self, kv_caches: CanonicalKVCaches) -> PoolRequest:
        given: Mapping[str, Any] = self.config.extra_config
        key = "num_cpu_blocks" if "num_cpu_blocks" in given else "cpu_bytes_to_use"
        page_bytes = sum(t.page_size_bytes for t in kv_caches.tensors)
        return PoolRequest(
            num_blocks=self.num_chunks,
            row_bytes=page_bytes * self.blocks_per_chunk,
            key=key,
            value=given.get(key),
            all_workers_block_bytes=cpu_block_bytes(self.config),
            blocks_per_chunk=self.blocks_per_chunk,
            chunk_key="blocks_per_chunk"
            if "blocks_per_chunk" in given
            else "block_size",
            device_block_tokens=self.tokens_per_block[0],
        )

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            # The worker side, right before the pool is allocated: the one
            # place that knows what vLLM has allocated and what is to come.
            check_host_memory(
                self._pool_request(kv_caches), host_kv_cache_bytes(kv_caches)
            )
            self._worker = self.worker_cls(
                kv_caches,
                blocks_per_chunk=self.blocks_per_chunk,
                num_cpu_blocks=self.num_chunks,
            )
        return self._worker
