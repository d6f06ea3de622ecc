"""Marks in a shared directory (``/dev/shm``): files that live exactly as
long as the processes holding a ``flock`` on them.

A process creates its mark and holds a lock on it until it closes it or
dies (SIGKILL included: the kernel drops the lock with the last open file
description). A mark no process holds belongs to a run that ended without
cleanup; ``sweep_marks`` removes it (and, through ``on_dead``, whatever it
stood for). Used by the shared regions (``region.py``) and the host-memory
ledger (``host_ledger.py``).

Creating, sweeping and reading marks are serialised by ``dir_lock`` (a
``flock`` on the directory), so a sweep never sees a mark between its
creation and its lock. Only this user's regular files are touched: the
directory is world-writable.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Callable, Iterator

SHM_DIR = "/dev/shm"


@contextlib.contextmanager
def dir_lock(shm_dir: str = SHM_DIR) -> Iterator[None]:
    """Serialises creating, sweeping and reading marks in ``shm_dir``
    between this package's processes."""
    fd = os.open(shm_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def is_users_file(path: str) -> bool:
    """A regular file of this user (not a link, not someone else's)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def open_held(path: str) -> int:
    """Creates (or opens) the mark ``path`` and holds a shared lock on it;
    returns its descriptor, whose closing releases the mark."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def sweep_marks(
    shm_dir: str,
    prefix: str,
    suffix: str,
    on_dead: Callable[[str], None] | None = None,
) -> list[str]:
    """Removes each mark ``prefix<name>suffix`` no process holds, calling
    ``on_dead(name)`` first; returns the paths of the marks still held.
    Call it under ``dir_lock``."""
    live = []
    for entry in sorted(os.listdir(shm_dir)):
        if not (entry.startswith(prefix) and entry.endswith(suffix)):
            continue
        mark = os.path.join(shm_dir, entry)
        try:
            fd = os.open(mark, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile, or a link: not a mark of ours
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live.append(mark)  # a live process holds it
                continue
            if on_dead is not None:
                on_dead(entry[len(prefix) : len(entry) - len(suffix)])
            os.unlink(mark)
        finally:
            os.close(fd)
    return live
