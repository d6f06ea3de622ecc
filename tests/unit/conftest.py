"""Shared helpers of the unit tests."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion


@pytest.fixture
def shared_region() -> Iterator[Callable[..., SharedOffloadRegion]]:
    """Opens tiering regions (``open_region``) under a fresh engine id;
    each is unmapped and removed at teardown if the test did not."""
    from vllm_ascend.kv_offload.tiering.region import open_region

    opened: list[SharedOffloadRegion] = []

    def open_one(
        num_chunks: int, kv_bytes_per_chunk: int, cpu_page_size: int, rank: int = 0
    ) -> SharedOffloadRegion:
        region = open_region(
            engine_id=f"unit-{uuid.uuid4().hex[:8]}",
            num_chunks=num_chunks,
            rank=rank,
            kv_bytes_per_chunk=kv_bytes_per_chunk,
            cpu_page_size=cpu_page_size,
        )
        opened.append(region)
        return region

    yield open_one
    for region in opened:
        region.cleanup()
