"""The fs tier's directory is shared, so untrusted: what anyone who can
write it may put there (symlinks, FIFOs, sockets, directories, forged
files, leftovers) never redirects a write, hangs a read, or gets loaded; a
directory the tier cannot use is dropped at start."""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
import zlib

import pytest
from vllm.v1.kv_offload.base import make_offload_key

from tests.unit.conftest import finished_job, fs_job, payload
from tests.unit.tier_helpers import AUTH_KEY, IDENTITY, fs_tier, row_view
from tests.unit.tier_helpers import KEY_ID as KEY
from vllm_ascend.kv_offload.tiering import block_file
from vllm_ascend.kv_offload.tiering.block_file import (
    HEADER_BYTES,
    HEADER_STRUCT,
    key_digest,
    read_block,
    remove_stale_temp_files,
    temp_name,
    write_block,
)
from vllm_ascend.kv_offload.tiering.fs import tier_dir_usable
from vllm_ascend.kv_offload.tiering.tier_paths import BadEntryError, StoredBlockError

# Long enough that anything still blocked is stuck, not slow (2 loaded cores).
STUCK_S = 30.0


def in_thread(fn, *args, **kwargs):
    """Runs ``fn`` in a thread; returns (finished, result or exception)."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(STUCK_S)
    return (not thread.is_alive()), (out[0] if out else None)


def release_fifo(path: str) -> None:
    """Unblocks a reader stuck in open() on FIFO ``path`` (old code)."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


# -- no symlink followed, nothing but regular files opened ------------------


def _symlink_to_a_block_file(path, outside):
    write_block(str(outside / "elsewhere.bin"), payload(), IDENTITY, KEY, 0)
    path.symlink_to(outside / "elsewhere.bin")
    return path


def _socket(path, outside):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
    return path


def _symlinked_directory(path, outside):
    """The directory on the way a symlink to ``outside``, where a block file
    of the same name is."""
    write_block(str(outside / path.name), payload(), IDENTITY, KEY, 0)
    path.parent.rmdir()
    path.parent.symlink_to(outside, target_is_directory=True)
    return path.parent


# What anyone who can write the directory may put in place of block file
# ``path`` or of a directory on its way, ``outside`` the root: the entry
# made, what the tier reports it as.
IN_PLACE = "in place of a block file"
BAD_ENTRIES = {
    "symlink to a valid block file": (_symlink_to_a_block_file, IN_PLACE),
    "FIFO": (lambda path, _: os.mkfifo(path) or path, IN_PLACE),
    "socket": (_socket, IN_PLACE),
    "directory": (lambda path, _: path.mkdir() or path, IN_PLACE),
    "symlink to a device": (lambda p, _: p.symlink_to("/dev/zero") or p, IN_PLACE),
    "symlinked directory": (_symlinked_directory, "a symlink in place of a directory"),
}  # fmt: skip


@pytest.mark.parametrize("first", ["read", "write"])
@pytest.mark.parametrize("make, why", BAD_ENTRIES.values(), ids=BAD_ENTRIES.keys())
def test_a_bad_entry_is_never_followed_a_miss_removed_or_replaced_by_a_write(
    tmp_path, make, why, first
):
    """A read does not block and is a miss that removes the entry; a write
    replaces it instead of skipping it; either reports it once and nothing
    outside the root is read or written."""
    root, outside = tmp_path / "tier", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    path = root / "sub" / "b.bin"
    entry = make(path, outside)
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    seen, hook = [], lambda p, found: seen.append(found)
    if first == "read":
        try:
            finished, result = in_thread(
                read_block, str(path), payload(fill=0), IDENTITY, KEY, 0,
                root=str(root), on_bad_entry=hook,
            )  # fmt: skip
        finally:
            release_fifo(str(path))
        assert finished, "the read blocked"
        assert isinstance(result, BadEntryError) and why in str(result), result
        assert not os.path.lexists(entry)  # removed
        assert write_block(str(path), payload(), IDENTITY, KEY, 0, root=str(root))
    else:
        written = write_block(
            str(path), payload(), IDENTITY, KEY, 0, root=str(root), on_bad_entry=hook
        )
        assert written and not entry.is_symlink()
        assert path.is_file() and not path.is_symlink()
    assert len(seen) == 1 and why in seen[0]
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    read_block(str(path), payload(fill=0), IDENTITY, KEY, 0, root=str(root))


def test_the_tier_counts_a_fifo_as_a_miss_and_shuts_down(tier):
    key = make_offload_key(b"\x05" * 32, 0)
    path = tier.file_mapper.get_file_name(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path)
    try:
        tier.submit_load(fs_job(1, key, True))
        result = finished_job(tier, 1)
    finally:
        release_fifo(path)
    assert result is not None and not result.success
    assert tier.files.bad_entries == 1 and not os.path.lexists(path)
    tier.submit_store(fs_job(2, key, False))
    assert finished_job(tier, 2).success and os.path.isfile(path)
    finished, _ = in_thread(tier.shutdown)
    assert finished


# -- what a block file must be to be loaded: intact, this identity's and
# block's, and keyed with the deployment key where one is set ----------------


def _forge(f, size: int) -> None:
    """Keeps the header (identity, key), puts another payload (fill 9), fixes
    the CRC32: what anyone who can write the directory can do."""
    other = payload(fill=9)
    header = bytearray(f.read(HEADER_BYTES))
    fields = list(HEADER_STRUCT.unpack_from(header, 0))
    fields[3] = zlib.crc32(other)
    HEADER_STRUCT.pack_into(header, 0, *fields)
    f.seek(0)
    f.write(bytes(header) + bytes(other))


OTHER = {"key": key_digest(make_offload_key(b"\x02" * 32, 0))}
KEYED, KEYED_OTHER = {"auth_key": AUTH_KEY}, {"auth_key": b"k" * 32}
# Written with key, damage(file, size), read_block's arguments other than
# (identity, key digest, no key): the payload loaded (its fill) or why the
# file is refused.
BLOCK_FILES = {
    "intact": (None, None, {}, 7),
    "keyed": (AUTH_KEY, None, KEYED, 7),
    "truncated": (None, lambda f, n: f.truncate(n - 1), {}, "size"),
    "extended": (None, lambda f, n: f.truncate(n + 1), {}, "size"),
    "payload-byte-flipped": (
        None, lambda f, n: (f.seek(n - 1), f.write(b"\xff")), {}, "checksum mismatch"
    ),
    "magic-overwritten": (
        None, lambda f, n: (f.seek(0), f.write(b"X")), {}, "not a KV block file"
    ),
    "another-identity": (None, None, {"identity": bytes(32)}, "another identity"),
    "another-block": (None, None, OTHER, "another block"),
    # The documented trust boundary: without a key, write access to the
    # directory is write access to every reader's KV.
    "forged-without-a-key": (None, _forge, {}, 9),
    "forged-with-a-key": (AUTH_KEY, _forge, KEYED, "HMAC"),
    "unkeyed-read-with-a-key": (None, None, KEYED, "HMAC"),
    "unkeyed-read-with-another-key": (None, None, KEYED_OTHER, "HMAC"),
    "keyed-read-with-another-key": (AUTH_KEY, None, KEYED_OTHER, "HMAC"),
}  # fmt: skip


@pytest.mark.parametrize(
    "written_with, damage, read_as, loaded", BLOCK_FILES.values(), ids=BLOCK_FILES
)
def test_a_block_file_is_loaded_only_as_written_for_this_reader(
    tmp_path, written_with, damage, read_as, loaded
):
    """A written block reads back; a second write of it is skipped; a
    damaged, forged or foreign file is refused (a miss), keyed or not."""
    path, data, out = str(tmp_path / "a" / "b.bin"), payload(), payload(fill=0)
    assert write_block(path, data, IDENTITY, KEY, 0, auth_key=written_with)
    assert os.path.getsize(path) == HEADER_BYTES + len(data)
    assert not write_block(path, data, IDENTITY, KEY, 0)  # exists: skipped
    if damage:
        with open(path, "r+b") as f:
            damage(f, os.path.getsize(path))
    read = {"identity": IDENTITY, "key": KEY, "o_direct": 0, **read_as}
    if isinstance(loaded, str):
        with pytest.raises(StoredBlockError, match=loaded):
            read_block(path, out, **read)
    else:
        read_block(path, out, **read)
        assert bytes(out) == bytes(payload(fill=loaded))


def test_a_write_outside_the_root_is_refused_and_a_failed_one_leaves_no_file(
    tmp_path, monkeypatch
):
    root = str(tmp_path / "tier")
    with pytest.raises(StoredBlockError, match="not under the tier root"):
        write_block(str(tmp_path / "x.bin"), payload(), IDENTITY, KEY, 0, root=root)

    def full(fd, buffers):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(block_file.os, "writev", full)
    with pytest.raises(OSError, match="No space"):
        write_block(str(tmp_path / "b.bin"), payload(), IDENTITY, KEY, 0)
    assert os.listdir(tmp_path) == []


# -- a tier directory that cannot be used is dropped at start --------------


@pytest.mark.parametrize(
    "model, under_a_file, why",
    [
        ("/models/" + "m" * 250, False, "File name too long"),
        ("/nonexistent/model", True, "Not a directory"),
    ],
    ids=["model-path-too-long-for-vllms-directory", "root-under-a-file"],
)
def test_a_tier_directory_that_cannot_be_created_drops_the_tier_with_one_line(
    tmp_path, fs_tier_spec, caplog, model, under_a_file, why
):
    spec = fs_tier_spec(model=model)
    root = tmp_path
    if under_a_file:
        (tmp_path / "file").write_text("")
        root = tmp_path / "file" / "kv"
    with caplog.at_level(logging.ERROR):
        assert not tier_dir_usable({"root_dir": str(root)}, spec)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "CPU tier only" in errors[0].getMessage()
    assert why in errors[0].getMessage() and "cannot be used" in caplog.text
    if under_a_file:  # the same spec with a directory that can be created
        assert tier_dir_usable({"root_dir": str(tmp_path / "kv")}, spec)


def test_a_read_only_root_is_read_its_stores_fail_without_vllms_dirs_dropped(
    tmp_path, fs_tier_spec, caplog
):
    """Root ignores permission bits, so only a read-only mount (a tmpfs
    remounted read-only) stops a write: a root there that holds vLLM's
    directories is read and its stores fail; an empty one drops the tier."""
    mount, empty = tmp_path / "ro", tmp_path / "ro" / "empty"
    mount.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)]
    if subprocess.run(command, capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs CAP_SYS_ADMIN)")
    try:
        empty.mkdir()
        spec, view = fs_tier_spec(), row_view()
        buf = view.obj  # the mapping under the view's rows
        assert tier_dir_usable({"root_dir": str(mount)}, spec)
        writer = fs_tier(spec, mount, view)
        stored, fresh = (make_offload_key(bytes([i]) * 32, 0) for i in (6, 7))
        buf[:4096] = b"\x03" * 4096
        writer.submit_store(fs_job(1, stored, False))
        assert finished_job(writer, 1).success
        writer.shutdown()
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        assert not tier_dir_usable({"root_dir": str(empty)}, spec)
        assert "Read-only file system" in caplog.text
        assert tier_dir_usable({"root_dir": str(mount)}, spec)  # a reader
        reader = fs_tier(spec, mount, view)
        try:
            buf[:4096] = bytes(4096)
            reader.submit_load(fs_job(2, stored, True))
            assert finished_job(reader, 2).success and buf[:4096] == b"\x03" * 4096
            reader.submit_store(fs_job(3, fresh, False))
            assert not finished_job(reader, 3).success  # the store: EROFS, counted
        finally:
            reader.shutdown()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


# -- temp files ---------------------------------------------------------------


def test_stale_temp_files_are_removed_live_ones_kept(tmp_path):
    """Temp files are hidden and not ``*.bin`` (no reader takes them for
    blocks); one no writer holds (flock) is removed once it is old."""
    name = temp_name("0123abcd.bin")
    assert name.startswith(".") and name.endswith(".tmp")
    assert not fnmatch.fnmatch(name, "*.bin")
    old = time.time() - 3600
    stale, live, fresh = (tmp_path / temp_name(f"{n}.bin") for n in "abc")
    for path in (stale, live, fresh):
        path.write_bytes(b"partial")
    for path in (stale, live):
        os.utime(path, (old, old))
    holder = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # its writer is still writing
        assert remove_stale_temp_files(str(tmp_path)) == 1
    finally:
        os.close(holder)
    assert not stale.exists() and live.exists() and fresh.exists()


def test_an_identity_directory_swapped_for_a_symlink_is_not_walked(
    tmp_path, fs_tier_spec
):
    """The size bound (its scan, lock and a read's touch) and the temp-file
    sweep start from the configured ``root_dir``: the identity directory
    below it is untrusted like the rest (they followed a symlink there, and
    evicted, swept and touched another directory's files)."""
    spec, root, outside = fs_tier_spec(), tmp_path / "kv", tmp_path / "outside"
    tier = fs_tier(spec, root, max_bytes=4 * (HEADER_BYTES + 4096))
    budget, ident = tier.budget, tier.root_dir
    outside.mkdir()
    for name in [f"{i}.bin" for i in range(8)] + [temp_name("0.bin")]:
        (outside / name).write_bytes(b"x" * (HEADER_BYTES + 4096))
        os.utime(outside / name, (time.time() - 3600,) * 2)
    before = {p.name: p.stat().st_mtime_ns for p in outside.iterdir()}
    try:
        for act in (
            lambda: budget.touch(os.path.join(ident, "0.bin")),
            budget.scan,
            lambda: remove_stale_temp_files(str(root), top=budget.top),
        ):
            if not os.path.islink(ident):  # a directory, or removed as a bad entry
                shutil.rmtree(ident, ignore_errors=True)
                os.symlink(outside, ident, target_is_directory=True)
            act()
    finally:
        tier.shutdown()
    assert {p.name: p.stat().st_mtime_ns for p in outside.iterdir()} == before
