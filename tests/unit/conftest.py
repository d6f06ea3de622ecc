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


@pytest.fixture
def fs_tier_spec():
    """What the verified fs tier reads of its spec, for a 4 KiB block of a
    model at ``model`` (default a short path), without an engine."""
    import dataclasses
    from types import SimpleNamespace

    from vllm.v1.kv_offload.config import OffloadingModelConfig

    from tests.unit.kv_helpers import make_config
    from vllm_ascend.kv_offload.tiering.identity import storage_identity

    def make(model: str = "/nonexistent/model") -> SimpleNamespace:
        config = make_config({}, worker_kv_bytes_per_block=4096, world_size=1)
        config = dataclasses.replace(
            config, model=OffloadingModelConfig(name=model, dtype="float32")
        )
        return SimpleNamespace(
            config=config,
            storage_identity=storage_identity(config, "cpu"),
            blocks_per_chunk=1,
            kv_events_config=SimpleNamespace(enable_kv_cache_events=False),
        )

    return make
