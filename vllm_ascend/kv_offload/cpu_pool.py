"""The CPU block pool: its layout, where its memory comes from, and whether
the host can hold it.

Layout (``CpuBlockPool``): one allocation of ``num_cpu_blocks`` rows. A row is
one CPU block across every cached tensor (all layers, K and V): tensor ``t``
owns ``blocks_per_chunk`` consecutive device-sized pages starting at
``tensor_offsets[t]``. Keeping a CPU block in one region makes it a single
object that another tier can move whole.

Allocation policy (``allocate_pool``): page-locked memory where the device
can use it (faster DMA), pageable memory otherwise, said once in the log; and
before anything is allocated, ``check_host_memory`` refuses a pool that the
host cannot hold, naming the setting to lower.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil
import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches

from vllm_ascend.kv_offload.config import PREFIX, OffloadConfigError, shown
from vllm_ascend.kv_offload.logger import init_logger

logger = init_logger(__name__)

# The pool may take at most this share of the host memory available when it
# is allocated: the rest is headroom for the engine, the tokenizer and the OS.
MAX_HOST_MEMORY_FRACTION = 0.9
# Where vLLM's CPU backend sizes its KV cache (GiB), besides kv_cache_memory_bytes.
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"


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
        f"{asked}, more than {room}; {fix}"
        f"{_kv_cache_fix(need, available, host_kv_bytes)}, or free host memory"
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


def _kv_cache_fix(need: int, available: int, host_kv_bytes: int) -> str:
    """The other fix where the device KV cache is host memory as well: how
    small it must be for the pool to fit, in the unit of its setting."""
    if host_kv_bytes == 0:
        return ""
    # Whatever the KV cache gives back becomes available to the pool.
    shrink = math.ceil(
        (need - available * MAX_HOST_MEMORY_FRACTION) / MAX_HOST_MEMORY_FRACTION
    )
    while int((available + shrink) * MAX_HOST_MEMORY_FRACTION) < need:
        shrink += 1  # float rounding in the limit
    keep = host_kv_bytes - shrink
    setting = os.environ.get(CPU_KV_CACHE_ENV)
    if setting:
        keep_gib = keep // 2**30  # the variable counts whole GiB
        if keep_gib < 1:
            return ""
        fix = f"lower {CPU_KV_CACHE_ENV} from {setting} to {keep_gib}"
    else:
        if keep <= 0:
            return ""
        fix = (
            f"set kv_cache_memory_bytes to at most {keep} (it is sized by "
            "kv_cache_memory_bytes or gpu_memory_utilization now)"
        )
    return (
        f", or shrink the KV cache of vLLM's CPU backend, which takes "
        f"{_size(host_kv_bytes)} of host memory: {fix}"
    )


class CpuBlockPool:
    """The host memory that offloaded KV lives in, allocated once."""

    def __init__(
        self,
        page_bytes: list[int],
        blocks_per_chunk: int,
        num_cpu_blocks: int,
        pin_memory: bool,
    ):
        self.blocks_per_chunk = blocks_per_chunk
        self.num_blocks = num_cpu_blocks
        pages = np.asarray(page_bytes, dtype=np.int64) * blocks_per_chunk
        self.tensor_offsets = np.concatenate(([0], np.cumsum(pages)[:-1]))
        self.row_bytes = int(pages.sum())
        # Pageable memory is zero-filled here so that its pages are faulted in
        # once at start-up, not by the first store into each block: those
        # first stores measured 2-7x slower (docs/e2e_benchmark.md). Pinned
        # memory is resident already.
        alloc = torch.empty if pin_memory else torch.zeros
        self.tensor: torch.Tensor | None = alloc(
            (num_cpu_blocks, self.row_bytes),
            dtype=torch.int8,
            device="cpu",
            pin_memory=pin_memory,
        )
        self.pinned = pin_memory
        self.base = self.tensor.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.row_bytes

    def release(self) -> None:
        """Frees the host memory; no job may use the pool afterwards."""
        self.tensor = None
        self.base = 0


def host_pinning_available(device: torch.device) -> bool:
    """Whether page-locked host memory can be allocated for ``device``."""
    if device.type == "cpu":
        return False
    try:
        return bool(torch.empty(1, pin_memory=True, device="cpu").is_pinned())
    except RuntimeError:
        return False


def allocate_pool(
    page_bytes: list[int], blocks_per_chunk: int, num_cpu_blocks: int, pin: bool
) -> CpuBlockPool:
    """The CPU block pool, pinned if possible, else pageable (and says so)."""
    try:
        return CpuBlockPool(page_bytes, blocks_per_chunk, num_cpu_blocks, pin)
    except RuntimeError as e:
        row_bytes = sum(page_bytes) * blocks_per_chunk
        gib = num_cpu_blocks * row_bytes / 2**30
        if pin:
            logger.warning(
                "KV offload: could not pin %.2f GiB of host memory (%s); the CPU "
                "block pool falls back to pageable memory (slower transfers)",
                gib,
                e,
            )
            return allocate_pool(page_bytes, blocks_per_chunk, num_cpu_blocks, False)
        raise MemoryError(
            f"KV offload: the CPU block pool of {num_cpu_blocks} blocks x "
            f"{row_bytes} bytes ({gib:.2f} GiB) could not be allocated ({e}); "
            "lower num_cpu_blocks (or cpu_bytes_to_use) in "
            "kv_connector_extra_config"
        ) from e
