"""The CPU block pool: its layout and where its memory comes from.

Layout (``PoolLayout``): ``num_cpu_blocks`` rows. A row is one CPU block
across every cached tensor (all layers, K and V): tensor ``t`` owns
``blocks_per_chunk`` consecutive device-sized pages starting at
``tensor_offsets[t]``. Keeping a CPU block in one region makes it a single
object that another tier can move whole. A private pool's row is exactly
its slot; a shared region's row holds every rank's slot.

Pool (``CpuBlockPool``): a layout over memory: ``private_pool`` (exact-size
memory of our own, ``host_memory.py``) or a shared region's
(``region.py``, memory another component owns). Whether the host
can hold a private pool is checked before it is allocated (``host_guard``,
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
from vllm_ascend.kv_offload.host_memory import HostMemory, allocate_host_memory
from vllm_ascend.kv_offload.host_pieces import DEFAULT_PIECE_BYTES, describe
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

    The memory's units (``host_pieces``) each hold whole rows: ``tensors``
    are ``[rows, row_bytes]`` int8 views of them (one for a shared region),
    ``[]`` once released; ``row_addresses`` finds any rows' addresses in one
    numpy expression. ``release`` gives the memory back as its owner said
    (``HostMemory.release``: frees our own, leaves a borrowed one)."""

    def __init__(self, layout: PoolLayout, memory: HostMemory):
        self.layout = layout
        # Its fields, as the copy engine and tests read them.
        self.num_blocks = layout.num_blocks
        self.blocks_per_chunk = layout.blocks_per_chunk
        self.row_bytes = layout.row_bytes
        self.tensor_offsets = layout.tensor_offsets
        self.slot_bytes = layout.slot_bytes
        self.memory = memory
        units = memory.units
        rows = layout.num_blocks
        self._unit_rows = (
            units[0].numel() // layout.row_bytes if len(units) > 1 else rows
        )
        self._after_release: list[Callable[[], None]] = []
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
        return self._unit_base[unit] + within * self.row_bytes

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
        for callback in self._after_release:
            callback()

    def on_release(self, callback: Callable[[], None]) -> None:
        """Calls ``callback`` once the memory is given back (the host-memory
        ledger's record of the pool goes with it)."""
        self._after_release.append(callback)


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
    # The pool's one line at start-up: its size, its memory, its pieces.
    pieces = memory.piece_bytes
    logger.info(
        "KV offload: CPU block pool of %d blocks x %d bytes (%s of %s%s) "
        "allocated in %.2f s for %d KV cache tensors on %s",
        num_cpu_blocks,
        layout.row_bytes,
        show(layout.span_bytes),
        memory.kind,
        f" in {describe(list(pieces))}" if len(pieces) > 1 else "",
        time.perf_counter() - t0,
        len(page_bytes),
        device_type,
    )
    return CpuBlockPool(layout, memory)
