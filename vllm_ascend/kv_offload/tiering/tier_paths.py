"""Paths below an untrusted tier directory, reached without following a
symlink: every component is opened with ``O_NOFOLLOW`` from its parent's
fd (``dir_fd``), and only directories and regular files are opened.
Anything else where a directory or a block file should be (a symlink,
FIFO, device, socket, or a directory in place of a file) is a *bad entry*:
reported to ``on_bad_entry``, removed (a directory only if empty) and, where
the caller creates, replaced. The block file format on top of it is
``block_file.py``; the size bound's scan walks with ``open_dirs`` too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator


class StoredBlockError(OSError):
    """A stored file that must not be loaded (short, foreign, corrupted)."""


class BadEntryError(StoredBlockError):
    """Something other than a regular file where a block file should be (or
    other than a directory on the path to one)."""


BadEntryHook = Callable[[str, str], None]  # (path, what was found there)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = (
    (stat.S_ISLNK, "symlink"),
    (stat.S_ISDIR, "directory"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISREG, "regular file"),
)


def bad_entry(
    dir_fd: int,
    name: str,
    mode: int,
    expected: str,
    path: str,
    on_bad_entry: BadEntryHook | None,
    err: int = errno.EIO,
) -> BadEntryError:
    """Removes the bad entry ``name`` (a ``mode`` where ``expected`` should be)
    without following it, a directory only if empty (nothing is removed
    recursively from a shared directory), and reports it to ``on_bad_entry``;
    returns the error for a caller that does not replace it."""
    kind = next((kind for test, kind in _KINDS if test(mode)), "special file")
    found = f"a {kind} in place of {expected}"
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            os.rmdir(name, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)
    if on_bad_entry is not None:
        on_bad_entry(path, found)
    return BadEntryError(err, found, path)


def split_under(root: str, path: str) -> tuple[list[str], str]:
    rel = os.path.relpath(path, root)
    parts = rel.split(os.sep)
    if os.path.isabs(rel) or any(p in ("", os.curdir, os.pardir) for p in parts):
        raise StoredBlockError(errno.EINVAL, f"not under the tier root {root}", path)
    return parts[:-1], parts[-1]


@contextlib.contextmanager
def open_dirs(
    root: str,
    dirs: list[str] | tuple[str, ...],
    create: bool = False,
    path: str = "",
    on_bad_entry: BadEntryHook | None = None,
) -> Iterator[int]:
    """An fd of ``root/dirs...``, closed when the context ends, reached
    without following a symlink below ``root`` (configured, so trusted;
    made if ``create``): the one walk of the tier's directories (block
    files here, the size bound's scan in ``fs_budget``). A non-directory on
    the way is a bad entry: removed, and replaced by a directory if
    ``create``. ``path``: the file the walk is for, in errors."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    try:
        fd = os.open(root, flags)
    except FileNotFoundError:
        if not create:
            raise
        os.makedirs(root, exist_ok=True)  # only when missing: not per write
        fd = os.open(root, flags)
    try:
        for name in dirs:
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
                    error = bad_entry(
                        fd, name, mode, "a directory", path, on_bad_entry, errno.ENOTDIR
                    )
                    if not create:
                        raise error from e
                elif e.errno != errno.ENOENT or not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = sub
        yield fd
    finally:
        os.close(fd)


def walk_files(
    root: str, top: tuple[str, ...] = ()
) -> Iterator[tuple[int, tuple[str, ...], str, os.stat_result]]:
    """Every regular file under ``root/top``: its directory's fd (open until
    the next item), its directories under ``root`` (``top`` first), its name
    and its ``lstat``. Walked by directory fds (``open_dirs``): symlinks are
    neither followed nor listed, ``top`` included; a directory removed or
    unreadable meanwhile is skipped."""
    stack: list[tuple[str, ...]] = [tuple(top)]
    while stack:
        dirs = stack.pop()
        try:
            with open_dirs(root, dirs) as fd:
                with os.scandir(fd) as it:
                    entries = list(it)
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        stack.append((*dirs, entry.name))
                    elif stat.S_ISREG(st.st_mode):
                        yield fd, dirs, entry.name, st
        except OSError:
            continue


def open_regular(
    dir_fd: int,
    name: str,
    path: str,
    o_direct: int,
    on_bad_entry: BadEntryHook | None,
) -> int:
    """An fd of the regular file ``name``; nothing else is opened (no
    symlink followed, no FIFO or device opened, so no open blocks): anything
    else there, before the open or after it, is a bad entry."""
    mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    if stat.S_ISREG(mode):
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags | o_direct, dir_fd=dir_fd)
        except OSError as e:  # replaced since the stat: look again
            if e.errno == errno.ENOENT:
                raise
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
            if stat.S_ISREG(mode):
                raise
        else:
            mode = os.fstat(fd).st_mode
            if stat.S_ISREG(mode):
                return fd
            os.close(fd)
    raise bad_entry(dir_fd, name, mode, "a block file", path, on_bad_entry)


def remove_file(
    root: str, dirs: tuple[str, ...] | list[str], name: str, listed=None
) -> bool | None:
    """Removes the regular file ``name`` in ``root/dirs``, following no
    symlink: True if removed, False if already gone, None if kept (not a
    regular file, a bad entry on the way, or, given its ``listed`` stat,
    another file or one used since: another inode or mtime). Raises the
    ``OSError`` of a failed unlink."""
    with contextlib.ExitStack() as stack:
        try:
            dir_fd = stack.enter_context(open_dirs(root, dirs))
        except FileNotFoundError:
            return False
        except OSError:
            return None
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or (
                listed is not None
                and (st.st_ino, st.st_dev, st.st_mtime_ns)
                != (listed.st_ino, listed.st_dev, listed.st_mtime_ns)
            ):
                return None
            os.unlink(name, dir_fd=dir_fd)
            return True
        except FileNotFoundError:
            return False
