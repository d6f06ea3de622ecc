"""Shared helpers of the unit tests."""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    from vllm_ascend.kv_offload.region import RegionMark


# The doctor's flags that skip its copy checks: sizing only.
NO_COPY_CHECKS = ["--alloc-mib", "0", "--bandwidth-mib", "0"]


def run_doctor(*args: str) -> tuple[int, str]:
    """The doctor's exit status and stdout, run in this process through its
    ``main(argv)`` (what the console script calls)."""
    from vllm_ascend.kv_offload import doctor

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = doctor.main(list(args))
    return rc, out.getvalue()


def new_engine_id(kind: str = "unit") -> str:
    """An engine id no other test uses (it names /dev/shm regions)."""
    return f"{kind}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def shared_region() -> Iterator[Callable[..., tuple[SharedOffloadRegion, RegionMark]]]:
    """Opens tiering regions (``open_region``) under a fresh engine id (or
    the one given); each is closed at teardown if the test did not."""
    from vllm_ascend.kv_offload.region import close_region, open_region

    opened: list[tuple[SharedOffloadRegion, RegionMark]] = []

    def open_one(
        num_chunks: int,
        kv_bytes_per_chunk: int,
        cpu_page_size: int,
        rank: int = 0,
        engine_id: str | None = None,
    ) -> tuple[SharedOffloadRegion, RegionMark]:
        region, mark = open_region(
            engine_id=engine_id or new_engine_id(),
            num_chunks=num_chunks,
            rank=rank,
            kv_bytes_per_chunk=kv_bytes_per_chunk,
            cpu_page_size=cpu_page_size,
        )
        opened.append((region, mark))
        return region, mark

    yield open_one
    for region, mark in opened:
        close_region(region, None, mark)


def kv_offload_threads() -> list[threading.Thread]:
    """The copy threads alive now (``ThreadTransferQueue`` names them)."""
    return [t for t in threading.enumerate() if t.name.startswith("kv-offload")]


def copy_threads_end(before: set[threading.Thread], timeout_s: float = 10.0) -> bool:
    """Whether every copy thread not in ``before`` ends within ``timeout_s``."""
    for thread in set(kv_offload_threads()) - before:
        thread.join(timeout_s)
    return set(kv_offload_threads()) <= before


@pytest.fixture
def available(monkeypatch) -> Callable[[int], None]:
    """Sets the host memory available (the host's MemAvailable, as
    ``host_guard.host_available_bytes`` reads it) from then on."""
    from vllm_ascend.kv_offload import host_guard

    def set_available(nbytes: int) -> None:
        monkeypatch.setattr(host_guard, "host_available_bytes", lambda: nbytes)

    return set_available


@pytest.fixture
def host_ledger_dir(tmp_path, monkeypatch) -> str:
    """A host-memory ledger of the test's own (``host_ledger``), empty:
    the pools of workers outside the test are not on this host."""
    from vllm_ascend.kv_offload.host_ledger import LEDGER_DIR_ENV

    directory = tmp_path / "ledger"
    directory.mkdir()
    monkeypatch.setenv(LEDGER_DIR_ENV, str(directory))
    return str(directory)


# Lists of paths being recorded by ``opened_paths`` fixtures (audit hooks
# cannot be removed, so one hook feeds whichever test is recording).
_RECORDING: list[list[str]] = []
_HOOKED: list[bool] = []


def _record_open(event: str, args: tuple) -> None:
    if event == "open" and _RECORDING and isinstance(args[0], str | bytes):
        _RECORDING[-1].append(os.fsdecode(args[0]))


@pytest.fixture
def opened_paths() -> Iterator[list[str]]:
    """The paths this test opens, by builtins.open or os.open, in order
    (Python's "open" audit event)."""
    if not _HOOKED:
        sys.addaudithook(_record_open)
        _HOOKED.append(True)
    paths: list[str] = []
    _RECORDING.append(paths)
    yield paths
    _RECORDING.remove(paths)


@pytest.fixture(scope="session")
def upstream(tmp_path_factory):
    """Upstream vllm-ascend 0.30.0rc2's KV-cache code, loaded from its sdist
    (downloaded once into the cache of tests/packaging/upstream.py) for
    running on CPU (tests/unit/upstream_runner.py)."""
    from tests.packaging.upstream import (
        PackagingSetupError,
        unpack_sdist,
        upstream_sdist,
    )
    from tests.unit.upstream_runner import load

    try:
        sdist = upstream_sdist()
    except PackagingSetupError as e:
        pytest.skip(f"cannot download upstream vllm-ascend's sdist: {e}")
    return load(unpack_sdist(sdist, tmp_path_factory.mktemp("upstream")))


# A small model's KV cache: layers of 2 KV heads of 32 fp32 values, blocks of
# 16 tokens, one full-attention KV cache group per entry of ``groups``.
CONNECTOR_BLOCK_SIZE = 16
CONNECTOR_DEVICE_BLOCKS = 16


def make_connector(
    role: str,
    extra: dict | None = None,
    num_groups: int = 1,
    num_blocks: int = CONNECTOR_DEVICE_BLOCKS,
    kv_load_failure_policy: str = "recompute",
    kv_cache_config=None,
    kv_caches: dict | None = None,
):
    """``AscendOffloadingConnector`` built by its constructor, as vLLM builds
    it (``role``: "worker" or "scheduler"), for the tiny test model. A worker
    side gets zero-filled KV caches registered, or ``kv_caches`` (with their
    ``kv_cache_config``) when given. ``extra``: the
    ``kv_connector_extra_config``; default: 8 CPU blocks of the test-only
    fault-injecting spec (tests/fault_injection.py)."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    from vllm_ascend.kv_offload.connector import AscendOffloadingConnector
    from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model

    spec = FullAttentionSpec(
        block_size=CONNECTOR_BLOCK_SIZE,
        num_kv_heads=2,
        head_size=32,
        dtype=torch.float32,
    )
    groups = [[f"layers.{g}.attn"] for g in range(num_groups)]
    page = spec.page_size_bytes
    kv_cache_config = kv_cache_config or KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * num_blocks,
                layers=layers,
                layer_stride=page * num_blocks,
                block_stride=page,
            )
            for layers in groups
        ],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec) for layers in groups],
    )
    if extra is None:
        extra = {
            "num_cpu_blocks": 8,
            "block_size": CONNECTOR_BLOCK_SIZE,
            "spec_name": "FaultInjectingOffloadingSpec",
            "spec_module_path": "tests.fault_injection",
        }
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=str(ensure_tiny_model()), dtype="float32", max_model_len=256
        ),
        cache_config=CacheConfig(block_size=CONNECTOR_BLOCK_SIZE),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy=kv_load_failure_policy,
        ),
    )
    roles = {"worker": KVConnectorRole.WORKER, "scheduler": KVConnectorRole.SCHEDULER}
    connector = AscendOffloadingConnector(vllm_config, roles[role], kv_cache_config)
    if role == "worker":
        connector.register_kv_caches(
            kv_caches
            or {
                layer: torch.zeros(num_blocks, 2, CONNECTOR_BLOCK_SIZE, 2, 32)
                for layers in groups
                for layer in layers
            }
        )
    return connector


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
            storage_identity=storage_identity(config, "cpu", None),
            blocks_per_chunk=1,
            kv_events_config=SimpleNamespace(enable_kv_cache_events=False),
        )

    return make


@pytest.fixture
def tier(tmp_path, fs_tier_spec):
    """A verified fs tier (one read and one write thread) on a 4-row view."""
    from vllm_ascend.kv_offload.tiering.fs import (
        VerifiedFileSystemTier,
        tier_dir_usable,
    )

    buf = mmap.mmap(-1, 4 * 4096)
    view = memoryview(buf).cast("B", shape=(4, 4096))
    spec = fs_tier_spec()
    root = tmp_path / "kv"
    assert tier_dir_usable({"root_dir": str(root)}, spec)
    tier = VerifiedFileSystemTier(
        spec, view, "ascend_fs", str(root), n_read_threads=1, n_write_threads=1
    )
    yield tier
    tier.shutdown()


def fs_job(job_id: int, key, promotion: bool):
    """A one-block job of an fs tier on row 0 (``promotion``: a load)."""
    import numpy as np
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    return TransferJob(job_id, [key], np.array([0]), promotion, ReqContext("r"))


# Long enough that a job still unfinished is stuck, not slow (2 loaded cores).
FS_JOB_TIMEOUT_S = 30.0


def finished_job(tier, job_id: int):
    """The tier's result of job ``job_id`` (None if it never finished)."""
    deadline = time.monotonic() + FS_JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        for result in tier.get_finished_jobs():
            if result.job_id == job_id:
                return result
        time.sleep(0.01)
    return None


# The tiering spec's name and module (the tiering and fs budget tests).
TIERING = {
    "spec_name": "NPUTieringOffloadingSpec",
    "spec_module_path": "vllm_ascend.kv_offload.tiering",
}


def payload(size: int = 2 * mmap.PAGESIZE, fill: int = 7) -> memoryview:
    """``size`` bytes equal to ``fill`` in an anonymous mapping (page-aligned,
    like a region row)."""
    buf = mmap.mmap(-1, size)
    buf[:] = bytes([fill]) * size
    return memoryview(buf)


@pytest.fixture(scope="module")
def vllm_model_config():
    """vLLM's own ModelConfig from a config.json-only directory (no
    weights, no tokenizer). Slow: its first use of an architecture inspects
    vLLM's model registry."""
    from vllm.config import ModelConfig

    def build(model_dir, **kwargs):
        return ModelConfig(model=str(model_dir), skip_tokenizer_init=True, **kwargs)

    return build


@pytest.fixture
def size_kv(tmp_path):
    """``sizing.size_model_dir`` of a fresh directory holding ``config`` (a
    dict) as its config.json: sizing reads a model through vLLM's
    ModelConfig, which loads a directory."""
    from tests.unit.model_configs import write_model
    from vllm_ascend.kv_offload.sizing import size_model_dir

    made = iter(range(1 << 30))

    def size(config: dict, **kwargs):
        model = write_model(tmp_path, config, name=f"model{next(made)}")
        return size_model_dir(model, **kwargs)

    return size


@pytest.fixture
def buffers() -> tuple[torch.Tensor, torch.Tensor]:
    """A source of 4 KiB of random bytes and a poisoned 4 KiB destination
    for swap_blocks_batch (tests/unit/swap_helpers.py)."""
    from tests.unit.swap_helpers import poisoned, random_bytes

    return random_bytes(4096), poisoned(4096)
