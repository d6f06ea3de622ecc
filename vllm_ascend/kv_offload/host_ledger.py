"""The host's ledger of CPU pools: one host-memory budget for all workers.

Each worker checks its pool against the host memory available when it is
about to allocate it; 8-16 workers of a host checking at once would each see
memory the others are about to take. So a worker checks and records its
pool in one step, under a lock every worker of the host shares, before it
allocates; a worker checking later sees every pool recorded before it.

* The ledger is a directory all workers of a host share (``LEDGER_DIR_ENV``,
  default ``/dev/shm``: one per host, or per container unless containers
  share the host's IPC namespace). Each live pool is one file,
  ``vllm_ascend_host_pool_<pid>_<id>.json``: its bytes, its engine, whether
  it is allocated yet (``host_guard`` explains why that matters).
* Its worker holds a ``flock`` on the file while the pool lives; releasing
  the pool removes it. A worker that dies (SIGKILL included) leaves an
  unheld file, removed by the next check on the host (``shm_marks``'s
  sweep, which ``region.py`` uses for its marks too).
* Check + record run under ``shm_marks.dir_lock`` on the ledger directory;
  the allocation runs after, outside it (faulting in a large pool takes
  minutes), which is why a pool is recorded before it is allocated.

It imports neither vLLM nor torch (``check`` raises whatever refuses).
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from vllm_ascend.kv_offload.shm_marks import (
    SHM_DIR,
    dir_lock,
    open_held,
    sweep_marks,
)

LEDGER_DIR_ENV = "VLLM_ASCEND_KV_OFFLOAD_LEDGER_DIR"
PREFIX, SUFFIX = "vllm_ascend_host_pool_", ".json"


@dataclass(frozen=True)
class Reserved:
    """A live pool of this host, as its ledger file says."""

    nbytes: int
    allocated: bool  # faulted in: gone from MemAvailable
    engine_id: str
    pid: int


def ledger_dir() -> str:
    """The ledger's directory; ValueError naming the setting if it is none."""
    directory = os.environ.get(LEDGER_DIR_ENV) or SHM_DIR
    if not os.path.isdir(directory):
        raise ValueError(
            f"{LEDGER_DIR_ENV}={directory!r} is not a directory: create it (the "
            f"same for every worker of the host), or unset it ({SHM_DIR})"
        )
    return directory


def live_pools(directory: str | None = None) -> list[Reserved]:
    """The pools of the host's live workers (removing dead workers' files)."""
    directory = directory or ledger_dir()
    with dir_lock(directory):
        return _live(directory)


def reserve(
    nbytes: int,
    engine_id: str,
    check: Callable[[list[Reserved]], None],
    directory: str | None = None,
) -> Reservation:
    """Records a pool of ``nbytes`` once ``check(the other live pools)``
    returned (it raises to refuse), both under the ledger's lock. The
    record lasts until ``Reservation.release``, or until the reservation
    is no longer referenced (or the process ends)."""
    directory = directory or ledger_dir()
    with dir_lock(directory):
        check(_live(directory))
        return Reservation(directory, nbytes, engine_id)


def _live(directory: str) -> list[Reserved]:
    pools = []
    for path in sweep_marks(directory, PREFIX, SUFFIX):
        try:
            with open(path) as f:
                entry = json.load(f)
            pools.append(Reserved(**entry))
        except (OSError, ValueError, TypeError):
            continue  # unreadable: released meanwhile, or not one of ours
    return pools


class Reservation:
    """This worker's pool in the ledger, until ``release`` (or the process
    ends: the lock goes with it, and a clean exit removes the file too)."""

    def __init__(self, directory: str, nbytes: int, engine_id: str):
        self.directory = directory
        self.path = os.path.join(
            directory, f"{PREFIX}{os.getpid()}_{uuid.uuid4().hex[:8]}{SUFFIX}"
        )
        self.entry = Reserved(nbytes, False, engine_id, os.getpid())
        self._fd = open_held(self.path)
        self._write()
        self._release = weakref.finalize(self, _drop, self._fd, self.path)

    def allocated(self) -> None:
        """The pool is faulted in: from now on it is out of MemAvailable."""
        if not self._release.alive:
            return
        with dir_lock(self.directory):
            self.entry = replace(self.entry, allocated=True)
            self._write()

    def release(self) -> None:
        """The pool is gone; idempotent."""
        self._release()

    def _write(self) -> None:
        data = json.dumps(asdict(self.entry)).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)


def _drop(fd: int, path: str) -> None:
    # Unlinked while still held, so that no sweep can take it for dead.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)
