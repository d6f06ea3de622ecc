"""How the CPU block pool's host memory is cut into pieces, and the one rule
by which pieces are allocated or registered.

Runtimes refuse single host allocations or registrations beyond some size:
one ``aclrtMallocHost`` above roughly 200-250 GB failed on a 910B host with
2 TB (error 207001), and vLLM registers its offload mmap in pieces of at most
64 GiB since one ``cudaHostRegister`` of >= 512 GiB failed. Ascend SVM wants
64 KiB-aligned host buffers. Hence (``PiecePlan``):

* A *unit* is ``unit_rows`` consecutive pool rows (CPU blocks), about 1/16
  of the piece limit (at least one row). Units start ``stride`` bytes apart,
  on the alignment; when there is more than one unit, the bytes between one
  unit's end and the next unit's start stay untouched (a gap). So a row never
  straddles two pieces, and no copy the op merges from adjacent fragments
  runs from one piece into another. A shared region, laid out by vLLM, has
  no gaps (``gaps=False``): its units are back to back.
* A *piece* is a run of whole units taken in one call (``take_pieces``):
  as many units as fit in the limit, unless the runtime refused that; a
  refused piece is retried with half as many units, down to one unit, and the
  pieces after it keep the smaller size.

A row's address is ``unit_base[row // unit_rows] + (row % unit_rows) *
row_bytes``: one numpy expression for a job's rows (``cpu_pool``).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
from vllm.utils.math_utils import cdiv, round_up

# The default of kv_connector_extra_config's host_piece_bytes: vLLM's bound
# on one cudaHostRegister call.
DEFAULT_PIECE_BYTES = 64 * 2**30
# Pieces are cut into this many units at most: the floor a refused piece
# halves down to is 1/16 of the limit (four halvings from the default).
UNITS_PER_PIECE = 16
# Ascend SVM's alignment for host buffers (Mooncake #4046).
SVM_ALIGNMENT = 64 * 2**10
PAGE_BYTES = mmap.PAGESIZE

T = TypeVar("T")


@dataclass(frozen=True)
class PiecePlan:
    """Where each row of a pool of ``num_rows`` rows of ``row_bytes`` sits,
    relative to the start of its memory, and how units group into pieces of
    at most ``limit`` bytes (see the module docstring)."""

    num_rows: int
    row_bytes: int
    unit_rows: int
    stride: int  # bytes from one unit's start to the next's
    units_per_piece: int  # the most units one piece holds
    align: int

    @classmethod
    def of(
        cls,
        num_rows: int,
        row_bytes: int,
        limit: int = DEFAULT_PIECE_BYTES,
        align: int = PAGE_BYTES,
        gaps: bool = True,
    ) -> PiecePlan:
        if num_rows <= 0 or row_bytes <= 0 or limit <= 0:
            raise ValueError(
                f"KV offload: no pool of {num_rows} rows of {row_bytes} bytes "
                f"in pieces of {limit} bytes"
            )
        # With gaps, 16 units and the 15 gaps between them (each less than
        # the alignment) fit in the limit.
        room = limit - (UNITS_PER_PIECE - 1) * align if gaps else limit
        unit_rows = max(1, min(num_rows, room // UNITS_PER_PIECE // row_bytes))
        if gaps:  # units at least one byte apart where there is more than one
            stride = round_up(unit_rows * row_bytes + (unit_rows < num_rows), align)
        else:
            # Back to back: a unit's length keeps the next unit aligned, where
            # the rows allow it (vLLM's region rows are page-aligned).
            multiple = align // math.gcd(row_bytes, align)
            if unit_rows >= multiple:
                unit_rows -= unit_rows % multiple
            stride = unit_rows * row_bytes
        unit_bytes = unit_rows * row_bytes
        # (k - 1) strides and one unit fit in the limit; one unit always.
        fit = 1 + max(0, limit - unit_bytes) // stride
        return cls(num_rows, row_bytes, unit_rows, stride, fit, align)

    @property
    def num_units(self) -> int:
        return cdiv(self.num_rows, self.unit_rows)

    def rows_of_unit(self, unit: int) -> int:
        return min(self.unit_rows, self.num_rows - unit * self.unit_rows)

    def unit_offsets(self) -> np.ndarray:
        """int64 [num_units]: each unit's offset from the first unit."""
        return np.arange(self.num_units, dtype=np.int64) * self.stride

    def piece_span(self, first_unit: int, units: int) -> int:
        """Bytes from the start of unit ``first_unit`` to the end of the rows
        of the piece's last unit: what one registration covers."""
        last = first_unit + units - 1
        return (units - 1) * self.stride + self.rows_of_unit(last) * self.row_bytes

    def piece_allocation(self, first_unit: int, units: int) -> int:
        """Bytes to allocate for the piece on its own: its span, plus a gap
        after it when the pool has more than one unit, so that no other
        piece's rows can follow its rows directly in the address space."""
        span = self.piece_span(first_unit, units)
        return span if self.num_units == 1 else round_up(span + 1, self.align)

    @property
    def span(self) -> int:
        """Bytes from the first unit's start to the last row's end."""
        return self.piece_span(0, self.num_units)

    @property
    def row_span(self) -> int:
        """Bytes of the rows alone."""
        return self.num_rows * self.row_bytes


@dataclass(frozen=True)
class Piece(Generic[T]):
    """Units ``[first_unit, first_unit + units)``, taken as ``handle``."""

    first_unit: int
    units: int
    nbytes: int
    handle: T


class PiecesRefused(RuntimeError):
    """Not even one unit was taken; ``failures`` says what each call said."""

    def __init__(self, failures: list[str]):
        super().__init__("; ".join(failures))
        self.failures = failures


def take_pieces(
    plan: PiecePlan,
    take: Callable[[int, int], T],
    give_back: Callable[[T], None],
    size_of: Callable[[int, int], int] | None = None,
) -> tuple[list[Piece[T]], list[str]]:
    """Takes every unit of ``plan`` in pieces, the rule of the module
    docstring: ``take(first_unit, units)`` allocates or registers one piece
    and returns its handle, raising RuntimeError when the runtime refuses it.
    Returns the pieces and what each refusal said. If a single unit is
    refused, the pieces taken are given back (``give_back``, last first;
    one that fails, RuntimeError, is named and the others still are) and
    PiecesRefused is raised. ``size_of(first_unit, units)``: the bytes of a
    piece, for the messages (default: its span)."""
    size_of = size_of or plan.piece_span
    pieces: list[Piece[T]] = []
    failures: list[str] = []
    size, unit = plan.units_per_piece, 0
    while unit < plan.num_units:
        units = min(size, plan.num_units - unit)
        try:
            handle = take(unit, units)
        except RuntimeError as e:
            failures.append(f"a piece of {size_of(unit, units)} bytes: {e}")
            if units == 1:
                for piece in reversed(pieces):
                    try:
                        give_back(piece.handle)
                    except RuntimeError as back:
                        failures.append(
                            f"giving back the piece of {piece.nbytes} bytes "
                            f"taken before failed: {back}"
                        )
                raise PiecesRefused(failures) from e
            size = units // 2
            continue
        pieces.append(Piece(unit, units, size_of(unit, units), handle))
        unit += units
    return pieces, failures


def describe(sizes: list[int]) -> str:
    """``3 pieces (64.00, 64.00, 12.00 GiB)``, for the log."""
    unit, name = (2**30, "GiB") if max(sizes) >= 2**30 else (2**20, "MiB")
    shown = [f"{n / unit:.2f}" for n in sizes]
    if len(shown) > 8:
        shown = [*shown[:3], "...", *shown[-2:]]
    noun = "piece" if len(sizes) == 1 else "pieces"
    return f"{len(sizes)} {noun} ({', '.join(shown)} {name})"
