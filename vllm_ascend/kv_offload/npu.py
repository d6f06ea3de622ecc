"""``NPUOffloadingSpec``: KV-cache CPU offloading for Ascend NPUs.

Loaded by vLLM's ``OffloadingConnector`` through::

    "spec_name": "NPUOffloadingSpec",
    "spec_module_path": "vllm_ascend.kv_offload.npu",

The scheduler side is vLLM's own: ``CPUOffloadingSpec`` sizes the pool and
builds ``CPUOffloadingManager`` with its LRU/ARC policies, KV events and
metrics. This spec changes two things:

* configuration: it accepts the Ascend guide's ``num_cpu_blocks`` (a count of
  CPU blocks of ``block_size`` tokens) besides vLLM's ``cpu_bytes_to_use``;
* the worker: upstream's refuses every platform but CUDA and XPU, ours runs
  on ``npu``, ``cuda`` and ``cpu`` (see ``worker.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.utils.math_utils import round_up
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from vllm_ascend.kv_offload.worker import NPUOffloadingWorker
from vllm_ascend.logger import init_logger

logger = init_logger(__name__)

EVICTION_POLICIES = ("lru", "arc")


class OffloadConfigError(ValueError):
    """A ``kv_connector_extra_config`` value that offloading cannot use."""


def _positive_int(extra: dict[str, Any], key: str) -> int | None:
    value = extra.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not (
        isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    ):
        raise OffloadConfigError(
            f"kv_connector_extra_config['{key}']={value!r} must be a positive "
            f"integer; set it to e.g. {key}=1000"
        )
    if value <= 0:
        raise OffloadConfigError(
            f"kv_connector_extra_config['{key}']={value!r} must be > 0; "
            f"give the CPU pool a positive size"
        )
    return int(value)


def cpu_block_bytes(config: OffloadingConfig) -> int:
    """Bytes of one CPU block, as vLLM's spec sizes it (all workers, padded)."""
    kv_bytes = (
        config.worker_kv_bytes_per_block
        * config.parallel.world_size
        * config.cache.blocks_per_chunk
    )
    return round_up(kv_bytes, CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)


def resolve_extra_config(config: OffloadingConfig) -> tuple[dict[str, Any], int | None]:
    """Validate the offloading keys and express the pool size in bytes.

    Returns vLLM-native extra config (``cpu_bytes_to_use`` always set) and the
    guide's ``num_cpu_blocks`` if it was given.
    """
    extra = dict(config.extra_config)
    num_cpu_blocks = _positive_int(extra, "num_cpu_blocks")
    cpu_bytes = _positive_int(extra, "cpu_bytes_to_use")
    block_bytes = cpu_block_bytes(config)

    if num_cpu_blocks is None and cpu_bytes is None:
        raise OffloadConfigError(
            "kv_connector_extra_config needs the CPU pool size: set "
            "'num_cpu_blocks' (CPU blocks of 'block_size' tokens, e.g. 1000) "
            "or 'cpu_bytes_to_use' (bytes)"
        )
    if num_cpu_blocks is not None and cpu_bytes is not None and block_bytes > 0:
        if cpu_bytes // block_bytes != num_cpu_blocks:
            raise OffloadConfigError(
                f"kv_connector_extra_config sets num_cpu_blocks={num_cpu_blocks} "
                f"and cpu_bytes_to_use={cpu_bytes}, which hold "
                f"{cpu_bytes // block_bytes} blocks of {block_bytes} bytes; "
                "set only one of them"
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
            f"kv_connector_extra_config['eviction_policy']={policy!r} is not "
            f"supported; use one of {', '.join(EVICTION_POLICIES)}"
        )
    _positive_int(extra, "blocks_per_chunk")
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

    def _uses_shared_region(self) -> bool:
        # Each worker owns a private pool; no cross-rank shared mmap region.
        return False

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = NPUOffloadingWorker(
                kv_caches,
                blocks_per_chunk=self.blocks_per_chunk,
                num_cpu_blocks=self.num_chunks,
            )
        return self._worker
