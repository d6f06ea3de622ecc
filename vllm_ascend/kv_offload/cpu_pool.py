"""The CPU block pool: its layout, where its memory comes from, and whether
the host can hold it.

Layout (``PoolLayout``): ``num_cpu_blocks`` rows. A row is one CPU block
across every cached tensor (all layers, K and V): tensor ``t`` owns
``blocks_per_chunk`` consecutive device-sized pages starting at
``tensor_offsets[t]``. Keeping a CPU block in one region makes it a single
object that another tier can move whole. A private pool's row is exactly
its slot; a shared region's row holds every rank's slot.

Pool (``CpuBlockPool``): a layout over memory, from one of two factories:
``private_pool`` (exact-size memory of our own, ``host_memory.py``) or
``region_pool`` (memory another component owns). Before a private pool is
allocated, ``check_host_memory`` refuses one the host cannot hold, naming
the setting to lower; it counts exactly what the factory allocates.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil
import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches

from vllm_ascend.kv_offload.config import PREFIX, OffloadConfigError, shown
from vllm_ascend.kv_offload.host_memory import (
    HostMemory,
    allocate_host_memory,
    borrowed,
)
from vllm_ascend.kv_offload.host_pieces import DEFAULT_PIECE_BYTES
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


@dataclass(frozen=True)
class PoolLayout:
    """Where each tensor's pages of a CPU block sit: block ``b`` of tensor
    ``t`` starts at ``b * row_bytes + tensor_offsets[t]``; this worker uses
    ``slot_bytes`` of each row (all of it in a private pool; its own slot
    of a shared region's row, whose stride is every rank's slots)."""

    num_blocks: int
    blocks_per_chunk: int
    row_bytes: int  # stride from one CPU block to the next
    tensor_offsets: np.ndarray  # int64 [T]
    slot_bytes: int

    @classmethod
    def of(
        cls,
        page_bytes: list[int],
        blocks_per_chunk: int,
        num_blocks: int,
        slot_offset: int = 0,
        row_bytes: int | None = None,
    ) -> PoolLayout:
        """Tensor ``t``'s ``blocks_per_chunk`` pages of ``page_bytes[t]``
        follow each other from ``slot_offset``; ``row_bytes`` defaults to
        exactly one slot (a private pool)."""
        pages = np.asarray(page_bytes, dtype=np.int64) * blocks_per_chunk
        slot = int(pages.sum())
        offsets = slot_offset + np.concatenate(([0], np.cumsum(pages)[:-1]))
        return cls(
            num_blocks=num_blocks,
            blocks_per_chunk=blocks_per_chunk,
            row_bytes=slot if row_bytes is None else row_bytes,
            tensor_offsets=offsets.astype(np.int64),
            slot_bytes=slot,
        )

    @property
    def span_bytes(self) -> int:
        """Bytes from the first row to the end of the last."""
        return self.num_blocks * self.row_bytes


class CpuBlockPool:
    """The host memory offloaded KV lives in, read through its layout.

    The memory's units (``host_pieces``) each hold whole rows: ``tensors``
    are ``[rows, row_bytes]`` int8 views of them (one for a shared region),
    ``[]`` once released; ``row_addresses`` finds any rows' addresses in one
    numpy expression. ``release`` gives the memory back as its owner said
    (``HostMemory.release``: frees our own, hands a borrowed one back)."""

    def __init__(self, layout: PoolLayout, memory: HostMemory):
        if memory.nbytes < layout.span_bytes:
            raise ValueError(
                f"KV offload: {memory.nbytes} bytes of host memory cannot hold "
                f"{layout.num_blocks} CPU blocks of {layout.row_bytes} bytes"
            )
        self.layout = layout
        self.memory = memory
        units = memory.units
        rows = layout.num_blocks
        self._unit_rows = (
            units[0].numel() // layout.row_bytes if len(units) > 1 else rows
        )
        self.tensors: list[torch.Tensor] = []
        for i, unit in enumerate(units):
            n = min(self._unit_rows, rows - i * self._unit_rows)
            self.tensors.append(unit[: n * layout.row_bytes].view(n, layout.row_bytes))
        self._unit_base = np.asarray([t.data_ptr() for t in self.tensors], np.int64)

    def row_addresses(self, rows: np.ndarray) -> np.ndarray:
        """int64 addresses of the first byte of each of ``rows`` (CPU block
        ids): a lookup of their unit, no Python per row."""
        rows = np.asarray(rows, dtype=np.int64)
        unit, within = np.divmod(rows, self._unit_rows)
        return self._unit_base[unit] + within * self.layout.row_bytes

    def row(self, i: int) -> torch.Tensor:
        """Row ``i`` (CPU block ``i``) as an int8 view."""
        return self.tensors[i // self._unit_rows][i % self._unit_rows]

    @property
    def tensor(self) -> torch.Tensor | None:
        """The rows as one ``[num_blocks, row_bytes]`` view, where they are
        one unit (a pool in one piece below 1/16 of its limit, a shared
        region); None once released."""
        if not self.tensors:
            return None
        if len(self.tensors) > 1:
            raise ValueError(
                f"KV offload: the CPU block pool is {len(self.tensors)} units "
                "of memory, not one tensor; read its rows with row(i)"
            )
        return self.tensors[0]

    @property
    def base(self) -> int:
        """Address of row 0 (0 once released)."""
        return int(self._unit_base[0]) if self.tensors else 0

    # The layout's fields, as the copy engine and tests read them.
    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def blocks_per_chunk(self) -> int:
        return self.layout.blocks_per_chunk

    @property
    def row_bytes(self) -> int:
        return self.layout.row_bytes

    @property
    def tensor_offsets(self) -> np.ndarray:
        return self.layout.tensor_offsets

    @property
    def slot_bytes(self) -> int:
        return self.layout.slot_bytes

    @property
    def pinned(self) -> bool:
        return self.memory.pinned

    @property
    def nbytes(self) -> int:
        """Bytes of KV this worker can hold (its slots)."""
        return self.num_blocks * self.slot_bytes

    @property
    def released(self) -> bool:
        return not self.tensors

    def release(self) -> None:
        """No job may use the pool afterwards; idempotent."""
        if not self.tensors:
            return
        self.tensors = []
        self.memory.release()


def private_pool(
    page_bytes: list[int],
    blocks_per_chunk: int,
    num_cpu_blocks: int,
    device_type: str,
    piece_bytes: int | None = None,
) -> CpuBlockPool:
    """A pool of our own: exactly its rows, in pieces of at most
    ``piece_bytes`` (``host_piece_bytes``; None: 64 GiB), in the memory
    ``device_type``'s copies accept (``host_memory.allocate_host_memory``).
    Raises MemoryError naming the setting to lower when the host cannot give
    it."""
    layout = PoolLayout.of(page_bytes, blocks_per_chunk, num_cpu_blocks)
    t0 = time.perf_counter()
    try:
        memory = allocate_host_memory(
            num_cpu_blocks,
            layout.row_bytes,
            device_type,
            piece_bytes=piece_bytes or DEFAULT_PIECE_BYTES,
        )
    except MemoryError as e:
        raise MemoryError(
            f"KV offload: the CPU block pool of {num_cpu_blocks} blocks x "
            f"{layout.row_bytes} bytes ({layout.span_bytes / 2**30:.2f} GiB) "
            f"could not be allocated ({e}); lower num_cpu_blocks (or "
            f"cpu_bytes_to_use) in {PREFIX}"
        ) from e
    logger.info(
        "KV offload: CPU block pool of %d blocks x %d bytes (%s, %s, pieces: "
        "%d) allocated in %.2f s for %d KV cache tensors on %s",
        num_cpu_blocks,
        layout.row_bytes,
        _size(layout.span_bytes),
        memory.kind,
        memory.pieces,
        time.perf_counter() - t0,
        len(page_bytes),
        device_type,
    )
    return CpuBlockPool(layout, memory)


def region_pool(
    base: torch.Tensor,
    layout: PoolLayout,
    pinned: bool,
    release: Callable[[], None] | None = None,
) -> CpuBlockPool:
    """A pool over memory someone else owns (a shared region's ``base``
    tensor): ``release`` is what the owner wants done when the pool lets go."""
    return CpuBlockPool(layout, borrowed(base.view(-1), pinned, release))
