"""Shared helpers of the tiering tests (block files, fs tiers, key files,
tiering specs) without an engine."""

from __future__ import annotations

import dataclasses
import mmap
import multiprocessing
import signal
from collections.abc import Callable

import pytest
from vllm.v1.kv_offload.base import make_offload_key

from tests.unit.conftest import TIERING
from tests.unit.kv_helpers import make_config
from vllm_ascend.kv_offload.config import OffloadConfigError
from vllm_ascend.kv_offload.tiering.block_file import key_digest
from vllm_ascend.kv_offload.tiering.fs import VerifiedFileSystemTier
from vllm_ascend.kv_offload.tiering.spec import NPUTieringOffloadingSpec

FORK = multiprocessing.get_context("fork")
# A block file's storage identity and key digest.
IDENTITY = bytes(range(32))
KEY_ID = key_digest(make_offload_key(b"\x01" * 32, 0))
# What `openssl rand -base64 32` writes (without its newline).
AUTH_KEY = b"q3Zk9Vx0bT7mLwR2sYc8nHfJ4pGd1aUeKiXoN6vQ5yM="


def key_file(tmp_path, data: bytes = AUTH_KEY + b"\n", name="kv.key", mode=0o600):
    """The path of a key file ``name`` in ``tmp_path`` holding ``data``."""
    path = tmp_path / name
    path.write_bytes(data)
    path.chmod(mode)
    return str(path)


def row_view(rows: int = 4, row_bytes: int = 4096) -> memoryview:
    """A primary tier's view: ``rows`` rows of an anonymous mapping."""
    buf = mmap.mmap(-1, rows * row_bytes)
    return memoryview(buf).cast("B", shape=(rows, row_bytes))


def fs_tier(spec, root, view: memoryview | None = None, **kwargs):
    """A verified fs tier at ``root`` (one read and one write thread) on
    ``view`` (default: a fresh ``row_view()``)."""
    return VerifiedFileSystemTier(
        spec, row_view() if view is None else view, "ascend_fs", str(root),
        n_read_threads=1, n_write_threads=1, **kwargs,
    )  # fmt: skip


def tiering_spec(
    engine_id: str, row_bytes: int, num_chunks: int = 4, **extra
) -> NPUTieringOffloadingSpec:
    """A tiering spec built as vLLM builds it: a region of ``num_chunks``
    rows of one block of ``row_bytes`` (one rank), no secondary tier;
    ``extra``: more extra-config keys."""
    keys = {**TIERING, "num_cpu_blocks": num_chunks, "secondary_tiers": [], **extra}
    config = make_config(keys, worker_kv_bytes_per_block=row_bytes)
    spec = NPUTieringOffloadingSpec(dataclasses.replace(config, engine_id=engine_id))
    assert (spec.num_chunks, spec.kv_bytes_per_chunk) == (num_chunks, row_bytes)
    return spec


def refusal(start: Callable[[], object], error: type = OffloadConfigError) -> str:
    """The message of the ``error`` that ``start()`` must raise."""
    with pytest.raises(error) as info:
        start()
    return str(info.value)


def _hold(hold, ready) -> None:
    held = hold()  # kept until the process is killed
    ready.set()
    signal.pause()
    del held


def forked(hold: Callable[[], object]) -> multiprocessing.Process:
    """Another process (forked: this one's imports and environment) that
    runs ``hold()``, keeps what it returned and waits to be killed."""
    ready = FORK.Event()
    proc = FORK.Process(target=_hold, args=(hold, ready), daemon=True)
    proc.start()
    assert ready.wait(120)
    return proc


def smaps(addr: int, starting: bool = False) -> dict[str, str] | None:
    """The fields (name: first value; sizes in kB) of this process's mapping
    holding ``addr`` (``starting``: starting at it), from /proc/self/smaps;
    None if there is none."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head, *values = line.split()
            if "-" in head and not head.endswith(":"):
                if found is not None:
                    return found
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = {} if (lo == addr if starting else lo <= addr < hi) else None
            elif found is not None:
                found[head.rstrip(":")] = values[0] if values else ""
    return found
