"""The shared server and engine drivers (``vllm_ascend.kv_offload.testing``)
without vLLM: a stand-in server that answers ``/v1/models`` like vLLM's and
starts a child, as vLLM's API server starts its engine core."""

from __future__ import annotations

import signal
import sys
import textwrap
import time
from types import SimpleNamespace

import psutil
import pytest

from vllm_ascend.kv_offload.testing import engine, server

STAND_IN = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    # SIGINT ends it even where it was started with SIGINT ignored (a
    # background job of a shell): vLLM's server installs its handlers too.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

    class Models(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": sys.argv[1]}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.end_headers()
            self.wfile.write(body)

    HTTPServer(("127.0.0.1", int(sys.argv[2])), Models).serve_forever()
    """
)


def test_the_server_is_ready_once_v1_models_answers_and_stops_with_its_children(
    tmp_path,
):
    srv = server.Server(
        [sys.executable, "-c", STAND_IN, "tiny", "{port}"], tmp_path / "log"
    )
    assert srv.wait_ready(timeout_s=60) >= 0
    assert srv.base == f"http://127.0.0.1:{srv.port}"
    (child,) = srv.children
    result = srv.stop(signal.SIGINT, timeout_s=30, grace_s=1)
    assert result["returncode"] is not None, result  # exited on SIGINT: not killed
    # The stand-in's child ignores its parent's end: killed by pid once the
    # grace period is over, reported.
    assert result["orphans"] == [child.pid]
    assert not psutil.pid_exists(child.pid) or child.status() == "zombie"
    assert not srv.proc.is_running() or srv.proc.status() == "zombie"


def test_a_server_that_exits_during_start_up_is_reported_with_its_log(tmp_path):
    command = [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"]
    srv = server.Server(command, tmp_path / "log")
    with pytest.raises(RuntimeError, match="exited with 3(.|\n)*no such model"):
        srv.wait_ready(timeout_s=60)
    srv.stop()


def test_an_exited_process_not_yet_reaped_counts_as_gone():
    """A zombie is not waited for (an orphan's reaper may be late); a
    running process is, until the timeout."""
    exited = psutil.Popen([sys.executable, "-c", "pass"])
    running = psutil.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        while exited.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.05)
        start = time.monotonic()
        assert server.wait_gone([exited], timeout_s=30) == []
        assert server.wait_gone([exited, running], timeout_s=0.2) == [running]
        assert time.monotonic() - start < 10
    finally:
        running.kill()
        running.wait()
        exited.wait()


def test_serve_command_runs_the_api_server_module_on_the_chosen_port():
    command = server.serve_command("/m", ["--dtype", "float32"])
    assert command[1:4] == ["-m", server.SERVE_MODULE, "--model"]
    assert command[command.index("--port") + 1] == "{port}"
    assert command[-2:] == ["--dtype", "float32"]


def test_free_ports_are_bindable():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", server.free_port()))


def test_ttft_comes_from_the_request_metrics_and_needs_them():
    stats = SimpleNamespace(first_token_latency=0.25)
    assert engine.ttft_s(SimpleNamespace(metrics=stats)) == 0.25
    with pytest.raises(ValueError, match="start the engine with start"):
        engine.ttft_s(SimpleNamespace(metrics=None))


def test_counters_are_floats_summed_over_labels():
    from prometheus_client import CollectorRegistry, Counter, Gauge

    registry = CollectorRegistry()
    c = Counter("vllm:kv_offload_test_seconds", "t", ["kind"], registry=registry)
    c.labels("a").inc(0.25)
    c.labels("b").inc(0.5)
    Gauge("vllm:other", "o", registry=registry).set(3)
    assert engine.counters(("vllm:kv_offload_test",), registry) == {
        "vllm:kv_offload_test_seconds": 0.75
    }
