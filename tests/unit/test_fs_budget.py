"""The fs tier's size bound (``max_bytes``) without an engine: the least
recently used block files go first, only regular block files are removed,
nothing is followed, engines sharing the directory take turns (a lock
file) and tolerate each other's removals, and two writer processes with a
reader stay within the bound without corrupting or losing the newest
files."""

from __future__ import annotations

import fcntl
import os
import random
import threading
import time

import pytest

from tests.e2e.run_scenario import block_files
from tests.unit.conftest import TIERING, payload
from tests.unit.tier_helpers import FORK, IDENTITY
from vllm_ascend.kv_offload.config import OffloadConfigError
from vllm_ascend.kv_offload.tiering import fs_budget
from vllm_ascend.kv_offload.tiering.block_file import (
    HEADER_BYTES,
    read_block,
    write_block,
)
from vllm_ascend.kv_offload.tiering.fs_budget import (
    EVICTED_BLOCKS,
    EVICTED_BYTES,
    LOCK_FILE,
    TIER_BYTES,
    FsTierBudget,
    budget_metric_definitions,
)
from vllm_ascend.kv_offload.tiering.spec import (
    NPUTieringOffloadingSpec,
    check_tiering_config,
)
from vllm_ascend.kv_offload.tiering.tier_paths import StoredBlockError

PAYLOAD_BYTES = 2 * 4096
FILE_BYTES = HEADER_BYTES + PAYLOAD_BYTES
BOUND_FILES = 24  # the bound of the tests of several writers


def key_of(name: str) -> bytes:
    return name.encode().ljust(32, b"\0")[:32]


def block_path(root: str, name: str) -> str:
    return os.path.join(root, name[:2], f"{name}.bin")


def store(root: str, name: str, fill: int = 7) -> str:
    path = block_path(root, name)
    write_block(path, payload(PAYLOAD_BYTES, fill), IDENTITY, key_of(name), 0)
    return path


def age(path: str, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(path, (t, t), follow_symlinks=False)


def aged_blocks(root, n: int = 10, name: str = "b{:02d}") -> list[str]:
    """n block files under ``root``, the first the least recently used."""
    paths = [store(str(root), name.format(i)) for i in range(n)]
    for i, path in enumerate(paths):
        age(path, 100 - i)
    return paths


def bounded(root, files: int = 6) -> FsTierBudget:
    """The budget of ``root`` bounded to ``files`` block files."""
    return FsTierBudget(str(root), max_bytes=files * FILE_BYTES, file_bytes=FILE_BYTES)


def counter(stats, name: str) -> float:
    return stats.reduce().get(name, 0.0) if stats else 0.0


def store_noted(root: str, budget: FsTierBudget, n: int) -> int:
    """Stores ``n`` blocks, each newer, noted as a writer notes them; the
    bytes of the block files then under ``root``."""
    for i in range(n):
        age(store(root, f"s{i:03d}"), 1000 - i)
        budget.note_stored(FILE_BYTES)
    return sum(os.path.getsize(p) for p in block_files(root))


# -- configuration ------------------------------------------------------------


def test_a_bound_too_small_for_a_few_blocks_is_refused(tmp_path):
    with pytest.raises(OffloadConfigError, match="max_bytes.*block files"):
        FsTierBudget(str(tmp_path), max_bytes=2 * FILE_BYTES, file_bytes=FILE_BYTES)


@pytest.mark.parametrize("tier_type", ["fs", "ascend_fs"])
def test_the_spec_defines_the_eviction_metrics_for_an_fs_tier(tier_type):
    """``max_bytes`` (on the fs tier only, a positive integer: the spec's
    refusals, test_tiering.py) is accepted; vLLM registers a Prometheus
    metric only for names the spec defines."""
    tiers = [{"type": tier_type, "root_dir": "/x", "max_bytes": 2**30}]
    extra = {**TIERING, "secondary_tiers": tiers}
    check_tiering_config(extra)
    definitions = NPUTieringOffloadingSpec.build_metric_definitions(extra)
    assert set(budget_metric_definitions()) <= set(definitions)
    assert {EVICTED_BLOCKS, EVICTED_BYTES, TIER_BYTES} <= set(definitions)


# -- eviction -----------------------------------------------------------------


def test_the_least_recently_used_files_go_first_and_a_read_counts_as_use(
    tmp_path,
):
    root = str(tmp_path)
    paths = aged_blocks(root)  # b00 oldest ... b09 newest
    bounded(root, 11).scan()  # under the bound: nothing is removed
    assert block_files(root) == paths
    budget = bounded(root)
    budget.touch(paths[0])  # a read of the oldest one: now the newest

    budget.scan()

    # Down to 90 % of the bound: 5 files; the one read and the 4 newest left.
    kept = block_files(root)
    assert kept == sorted([paths[0], *paths[6:]])
    stats = budget.take_stats()
    assert counter(stats, EVICTED_BLOCKS) == 5
    assert counter(stats, EVICTED_BYTES) == 5 * FILE_BYTES
    assert budget.take_stats() is None  # taken: reported once


def test_stores_trigger_the_scan_amortized(tmp_path):
    root = str(tmp_path)
    budget = bounded(root, 64)
    scans = []
    real_scan = budget.scan
    budget.scan = lambda wait=False: scans.append(1) or real_scan(wait)
    assert store_noted(root, budget, 256) < 64 * FILE_BYTES
    # Not a scan per store: at the bound, or an eighth of it written.
    assert 1 <= len(scans) <= 256 // 4


def test_only_regular_block_files_are_removed_and_nothing_is_followed(tmp_path):
    root = tmp_path / "tier"
    outside = tmp_path / "outside"
    outside.mkdir()
    store(str(outside), "o1")
    store(str(outside), "o2")
    regular = [store(str(root), f"r{i}") for i in range(6)]
    (root / "ln").symlink_to(outside, target_is_directory=True)
    (root / "file-link.bin").symlink_to(block_path(str(outside), "o1"))
    os.mkfifo(root / "fifo.bin")
    (root / "dir.bin").mkdir()
    tmp_file = root / "r0" / "half-written.bin.123.tmp"
    tmp_file.parent.mkdir(exist_ok=True)
    tmp_file.write_bytes(b"x" * FILE_BYTES)
    bounded(root, 4).scan()  # must not block on the FIFO

    assert len(block_files(str(outside))) == 2
    assert (root / "file-link.bin").is_symlink()
    assert (root / "fifo.bin").exists() and (root / "dir.bin").is_dir()
    assert tmp_file.exists()
    assert sum(os.path.exists(p) for p in regular) == 3  # 90 % of 4 files


def test_a_file_removed_by_another_evictor_is_tolerated(tmp_path, monkeypatch):
    root = str(tmp_path)
    paths = aged_blocks(root)
    real_unlink = os.unlink

    def another_engine_was_faster(name, *args, **kw):
        if name == os.path.basename(paths[0]):
            real_unlink(paths[0])  # the other engine removes it first
        return real_unlink(name, *args, **kw)

    monkeypatch.setattr(fs_budget.os, "unlink", another_engine_was_faster)
    budget = bounded(root)
    budget.scan()
    assert len(block_files(root)) == 5
    assert counter(budget.take_stats(), EVICTED_BLOCKS) == 4  # ours only


@pytest.mark.parametrize("meanwhile", ["read", "swapped"])
def test_what_another_engine_does_after_the_listing_is_seen(
    tmp_path, monkeypatch, meanwhile
):
    """The oldest file read again during the scan (after the listing) is
    kept; its directory swapped for a symlink then is not followed."""
    root, outside = tmp_path / "tier", tmp_path / "outside"
    outside.mkdir()
    paths = aged_blocks(root, name="b{}")  # one file in each of root/b0 ... b9
    budget = bounded(root)

    def swap():
        # Same files (same inodes, same mtimes), now reached through a link.
        os.rename(root / "b0", outside / "b0")
        (root / "b0").symlink_to(outside / "b0", target_is_directory=True)

    after_listing = {"read": lambda: budget.touch(paths[0]), "swapped": swap}[meanwhile]
    real_list = fs_budget.block_files
    monkeypatch.setattr(
        fs_budget, "block_files", lambda *a: (real_list(*a), after_listing())[0]
    )
    budget.scan()
    assert os.path.exists(paths[0] if meanwhile == "read" else outside / "b0/b0.bin")


def test_an_engine_that_stalls_holding_the_lock_does_not_let_others_pass_the_bound(
    tmp_path,
):
    """Another engine holds the scan lock and stalls (a busy host): this
    engine's stores skip the scan only until it has written an eighth of the
    bound, then wait for the lock and make the room themselves."""
    root = str(tmp_path)
    budget = bounded(root, BOUND_FILES)
    other = open(os.path.join(root, LOCK_FILE), "a+")  # noqa: SIM115
    fcntl.flock(other.fileno(), fcntl.LOCK_EX)
    stalled = threading.Timer(0.5, other.close)  # releases the flock
    stalled.start()
    try:
        total = store_noted(root, budget, 4 * BOUND_FILES)
    finally:
        stalled.join()
    assert total <= BOUND_FILES * FILE_BYTES + (BOUND_FILES // 8) * FILE_BYTES


def test_a_scan_running_in_another_engine_is_not_repeated(tmp_path):
    root = str(tmp_path)
    aged_blocks(root)
    budget = bounded(root)
    with open(os.path.join(root, LOCK_FILE), "a+") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)
        budget.scan()
        assert len(block_files(root)) == 10
    budget.scan()
    assert len(block_files(root)) == 5


def test_a_symlink_in_place_of_the_lock_file_is_refused(tmp_path, caplog):
    root = tmp_path / "tier"
    root.mkdir()
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (root / LOCK_FILE).symlink_to(target)
    aged_blocks(root)
    bounded(root).scan()
    assert target.read_text() == "keep"
    assert len(block_files(str(root))) == 10  # no lock, no eviction
    assert LOCK_FILE in caplog.text


# -- several engines at once --------------------------------------------------

WRITES = 80


def _writer(root: str, who: str, shared: int, log: str) -> None:
    budget = bounded(root, BOUND_FILES)
    rng = random.Random(who)
    with open(log, "w") as written:
        for i in range(WRITES):
            # Some blocks both writers store (the same prefix on two engines).
            name = f"sh{rng.randrange(shared):02d}" if i % 4 == 0 else f"{who}{i:03d}"
            path = block_path(root, name)
            if write_block(path, payload(PAYLOAD_BYTES, 3), IDENTITY, key_of(name), 0):
                written.write(f"{time.time_ns()} {path}\n")
                written.flush()
                budget.note_stored(FILE_BYTES)


def _reader(root: str, stop, bad) -> None:
    buf = payload(PAYLOAD_BYTES, 0)
    while not stop.is_set():
        for path in block_files(root):
            name = os.path.basename(path)[: -len(".bin")]
            try:
                read_block(path, buf, IDENTITY, key_of(name), 0)
            except FileNotFoundError:
                continue  # evicted between listing and reading: a miss
            except StoredBlockError as e:
                bad.put(f"{path}: {e}")
                return
            if bytes(buf[:1]) != b"\3":
                bad.put(f"{path}: wrong payload")
                return


def test_two_writers_and_a_reader_share_one_bounded_directory(tmp_path):
    root = str(tmp_path / "tier")
    logs = [str(tmp_path / f"{w}.log") for w in "ab"]
    stop, bad = FORK.Event(), FORK.Queue()
    reader = FORK.Process(target=_reader, args=(root, stop, bad))
    writers = [
        FORK.Process(target=_writer, args=(root, w, 8, log))
        for w, log in zip("ab", logs, strict=True)
    ]
    reader.start()
    for w in writers:
        w.start()
    for w in writers:
        w.join(120)
    stop.set()
    reader.join(60)
    assert [w.exitcode for w in writers] == [0, 0]
    assert reader.exitcode == 0
    assert bad.empty(), bad.get()

    files = block_files(root)
    total = sum(os.path.getsize(p) for p in files)
    # Within the bound, but for what a writer stored since its last scan
    # (an eighth of the bound each); never emptied by racing evictors.
    slack = 2 * (BOUND_FILES // 8) * FILE_BYTES
    assert total <= BOUND_FILES * FILE_BYTES + slack
    assert total >= (BOUND_FILES // 2) * FILE_BYTES
    # Only the least recently used went: the newest blocks of both writers
    # together survived every writer's evictions.
    writes = sorted(line.split() for log in logs for line in open(log))
    newest = {path for _, path in writes[-(BOUND_FILES // 2) :]}
    assert newest <= set(files)
    assert not [p for d, _, n in os.walk(root) for p in n if p.endswith(".tmp")]
    buf = payload(PAYLOAD_BYTES, 0)
    for path in files:
        read_block(path, buf, IDENTITY, key_of(os.path.basename(path)[:-4]), 0)


def _write_and_verify(root: str, who: str, n: int) -> None:
    buf = payload(PAYLOAD_BYTES, 0)
    for i in range(n):
        name = f"{who}{i:04d}"
        read_block(store(root, name, fill=3), buf, IDENTITY, key_of(name), 0)


def test_processes_forked_after_a_write_keep_their_own_buffers(tmp_path):
    # An engine process forked from one that already wrote blocks (vLLM
    # forks its workers) must not share the header page with its parent.
    root = str(tmp_path)
    store(root, "parent")
    children = [
        FORK.Process(target=_write_and_verify, args=(root, w, 300)) for w in "xy"
    ]
    for c in children:
        c.start()
    _write_and_verify(root, "z", 300)
    for c in children:
        c.join(120)
    assert [c.exitcode for c in children] == [0, 0]
