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

Validation happens in two places because each sees different things: the
connector (``connector.py``) sees ``kv_role`` and the device block size
before vLLM derives the chunk size (``validate_connector_config``); this spec
sees the sizes of a KV block and checks the pool against host memory
(``resolve_extra_config``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
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

from vllm_ascend.kv_offload.logger import init_logger
from vllm_ascend.kv_offload.manager import FailureAwareManager
from vllm_ascend.kv_offload.worker import NPUOffloadingWorker

logger = init_logger(__name__)

EVICTION_POLICIES = ("lru", "arc")
KV_ROLE = "kv_both"
# The pool may take at most this share of the host memory available at
# start-up: the rest is headroom for the engine, the tokenizer and the OS.
MAX_HOST_MEMORY_FRACTION = 0.9
# Far beyond any host; catches typos (an extra digit group) even before the
# size of a block is known.
MAX_CPU_BLOCKS = 2**31 - 1

_PREFIX = "kv_connector_extra_config"


class OffloadConfigError(ValueError):
    """A KV offloading setting that offloading cannot use."""


def _int_setting(
    extra: dict[str, Any], key: str, example: int, minimum: int = 1
) -> int | None:
    """``extra[key]`` as an int >= ``minimum``, None if absent."""
    value = extra.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not (
        isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    ):
        kind = "a positive" if minimum == 1 else "a non-negative"
        raise OffloadConfigError(
            f"{_PREFIX}['{key}']={value!r} must be {kind} integer (a JSON "
            f"number, not a string); set it to e.g. {key}={example}"
        )
    if value < minimum:
        bound = "> 0" if minimum == 1 else f">= {minimum}"
        raise OffloadConfigError(
            f"{_PREFIX}['{key}']={value!r} must be {bound}; set it to e.g. "
            f"{key}={example}"
        )
    return int(value)


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
    if kv_role != KV_ROLE:
        raise OffloadConfigError(
            f"kv_transfer_config.kv_role={kv_role!r} cannot be used with "
            f"OffloadingConnector, which both stores KV to the CPU and loads it "
            f"back; set kv_role='{KV_ROLE}'"
        )
    block_size = _int_setting(extra, "block_size", example=128)
    blocks_per_chunk = _int_setting(extra, "blocks_per_chunk", example=1)
    if block_size is not None and blocks_per_chunk is not None:
        raise OffloadConfigError(
            f"{_PREFIX} sets both block_size={block_size} and "
            f"blocks_per_chunk={blocks_per_chunk}, which say the same thing in "
            "tokens and in device blocks; set only one of them"
        )
    sizes = sorted(set(device_block_sizes))
    if block_size is None or not sizes:
        return
    if len(sizes) > 1:
        raise OffloadConfigError(
            f"{_PREFIX}['block_size']={block_size} needs one device block size, "
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
            f"{_PREFIX}['block_size']={block_size} must be a multiple of the "
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


def check_host_memory(num_blocks: int, block_bytes: int, key: str, value: int) -> None:
    """Refuses a pool that would not fit in the host's available memory.

    Called before anything is allocated: an oversized pool would otherwise
    fail late (after the model and the device cache are loaded) or push the
    host into swap. ``key``/``value`` name the setting the user gave.
    """
    pool = num_blocks * block_bytes
    available = host_available_bytes()
    limit = int(available * MAX_HOST_MEMORY_FRACTION)
    if pool <= limit:
        return
    fit = limit // block_bytes
    fix = (
        f"lower num_cpu_blocks to {fit}"
        if key == "num_cpu_blocks"
        else f"lower cpu_bytes_to_use to {fit * block_bytes}"
    )
    raise OffloadConfigError(
        f"{_PREFIX}['{key}']={value} asks for a CPU pool of {pool / 2**30:.2f} "
        f"GiB ({num_blocks} blocks of {block_bytes} bytes), more than "
        f"{MAX_HOST_MEMORY_FRACTION:.0%} of the {available / 2**30:.2f} GiB of "
        f"host memory available; {fix} (or free host memory)"
    )


def resolve_extra_config(config: OffloadingConfig) -> tuple[dict[str, Any], int | None]:
    """Validate the offloading keys and express the pool size in bytes.

    Returns vLLM-native extra config (``cpu_bytes_to_use`` always set) and the
    guide's ``num_cpu_blocks`` if it was given.
    """
    extra = dict(config.extra_config)
    num_cpu_blocks = _int_setting(extra, "num_cpu_blocks", example=1000)
    cpu_bytes = _int_setting(extra, "cpu_bytes_to_use", example=4 * 2**30)
    block_bytes = cpu_block_bytes(config)

    if num_cpu_blocks is None and cpu_bytes is None:
        raise OffloadConfigError(
            f"{_PREFIX} needs the CPU pool size: set 'num_cpu_blocks' (CPU "
            "blocks of 'block_size' tokens, e.g. 1000) or 'cpu_bytes_to_use' "
            "(bytes)"
        )
    if num_cpu_blocks is not None and num_cpu_blocks > MAX_CPU_BLOCKS:
        raise OffloadConfigError(
            f"{_PREFIX}['num_cpu_blocks']={num_cpu_blocks} is not a plausible "
            f"pool size (at most {MAX_CPU_BLOCKS}); lower num_cpu_blocks to "
            "what host memory holds, e.g. 1000"
        )
    if num_cpu_blocks is not None and cpu_bytes is not None and block_bytes > 0:
        if cpu_bytes // block_bytes != num_cpu_blocks:
            raise OffloadConfigError(
                f"{_PREFIX} sets num_cpu_blocks={num_cpu_blocks} and "
                f"cpu_bytes_to_use={cpu_bytes}, which hold "
                f"{cpu_bytes // block_bytes} blocks of {block_bytes} bytes; "
                "set only one of them"
            )
    if block_bytes > 0:
        if num_cpu_blocks is not None:
            check_host_memory(
                num_cpu_blocks, block_bytes, "num_cpu_blocks", num_cpu_blocks
            )
        else:
            assert cpu_bytes is not None
            if cpu_bytes < block_bytes:
                raise OffloadConfigError(
                    f"{_PREFIX}['cpu_bytes_to_use']={cpu_bytes} holds no CPU "
                    f"block ({block_bytes} bytes each); set cpu_bytes_to_use "
                    f"to at least {block_bytes}, or num_cpu_blocks instead"
                )
            check_host_memory(
                cpu_bytes // block_bytes, block_bytes, "cpu_bytes_to_use", cpu_bytes
            )
    if num_cpu_blocks is not None and cpu_bytes is None:
        # vLLM's spec insists on a non-zero byte count even before the KV
        # cache exists (block_bytes == 0); the block count below wins anyway.
        extra["cpu_bytes_to_use"] = num_cpu_blocks * max(block_bytes, 1)

    policy = extra.get("eviction_policy", "lru")
    if extra.get("cache_policy_module_path") is None and policy not in (
        EVICTION_POLICIES
    ):
        raise OffloadConfigError(
            f"{_PREFIX}['eviction_policy']={policy!r} is not supported; use one "
            f"of {', '.join(EVICTION_POLICIES)}"
        )
    _int_setting(extra, "blocks_per_chunk", example=1)
    _int_setting(extra, "store_threshold", example=2, minimum=0)
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

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = self.worker_cls(
                kv_caches,
                blocks_per_chunk=self.blocks_per_chunk,
                num_cpu_blocks=self.num_chunks,
            )
        return self._worker
