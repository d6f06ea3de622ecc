"""The CPU block pool: its layout and where its memory comes from.

Layout (``PoolLayout``): ``num_cpu_blocks`` rows. A row is one CPU block
across every cached tensor (all layers, K and V): tensor ``t`` owns
``blocks_per_chunk`` consecutive device-sized pages starting at
``tensor_offsets[t]``. Keeping a CPU block in one region makes it a single
object that another tier can move whole. A private pool's row is exactly
its slot; a shared region's row holds every rank's slot.

Pool (``CpuBlockPool``): a layout over memory, from one of two factories:
``private_pool`` (exact-size memory of our own, ``host_memory.py``) or
``region_pool`` (memory another component owns). Whether the host can
hold a private pool is checked before it is allocated (``host_guard``,
``host_ledger``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_ascend.kv_offload.config import PREFIX
from vllm_ascend.kv_offload.host_guard import show
from vllm_ascend.kv_offload.host_memory import (
    HostMemory,
    allocate_host_memory,
    borrowed,
)
from vllm_ascend.kv_offload.logger import init_logger

logger = init_logger(__name__)


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

    ``tensor`` is ``[num_blocks, row_bytes]`` int8 over the memory, ``None``
    once released; ``release`` gives the memory back as its owner said
    (``HostMemory.release``: frees our own, hands a borrowed one back)."""

    def __init__(self, layout: PoolLayout, memory: HostMemory):
        if memory.nbytes < layout.span_bytes:
            raise ValueError(
                f"KV offload: {memory.nbytes} bytes of host memory cannot hold "
                f"{layout.num_blocks} CPU blocks of {layout.row_bytes} bytes"
            )
        self.layout = layout
        self.memory = memory
        assert memory.tensor is not None
        self.tensor: torch.Tensor | None = memory.tensor[: layout.span_bytes].view(
            layout.num_blocks, layout.row_bytes
        )
        self.base = self.tensor.data_ptr()
        self._after_release: list[Callable[[], None]] = []

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
        return self.tensor is None

    def release(self) -> None:
        """No job may use the pool afterwards; idempotent."""
        if self.tensor is None:
            return
        self.tensor = None
        self.base = 0
        self.memory.release()
        for callback in self._after_release:
            callback()

    def on_release(self, callback: Callable[[], None]) -> None:
        """Calls ``callback`` once the memory is given back (the host-memory
        ledger's record of the pool goes with it)."""
        self._after_release.append(callback)


def private_pool(
    page_bytes: list[int], blocks_per_chunk: int, num_cpu_blocks: int, device_type: str
) -> CpuBlockPool:
    """A pool of our own: exactly its size, in the memory ``device_type``'s
    copies accept (``host_memory.allocate_host_memory``). Raises MemoryError
    naming the setting to lower when the host cannot give it."""
    layout = PoolLayout.of(page_bytes, blocks_per_chunk, num_cpu_blocks)
    t0 = time.perf_counter()
    try:
        memory = allocate_host_memory(layout.span_bytes, device_type)
    except MemoryError as e:
        raise MemoryError(
            f"KV offload: the CPU block pool of {num_cpu_blocks} blocks x "
            f"{layout.row_bytes} bytes ({layout.span_bytes / 2**30:.2f} GiB) "
            f"could not be allocated ({e}); lower num_cpu_blocks (or "
            f"cpu_bytes_to_use) in {PREFIX}"
        ) from e
    logger.info(
        "KV offload: CPU block pool of %d blocks x %d bytes (%s, %s) allocated "
        "in %.2f s for %d KV cache tensors on %s",
        num_cpu_blocks,
        layout.row_bytes,
        show(layout.span_bytes),
        memory.kind,
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
