"""The online tests' OpenAI server (``examples/serve_kv_offload.sh`` or
``vllm serve``'s API server module) and what they read of it; the session's
shared tiering server (``serve_shared``: the ``tiering_server`` fixture)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil
from openai import OpenAI

from benchmarks.serving_server import ServingServer
from examples import kv_events_subscriber
from tests.e2e.conftest import REPO, tiering, zmq_events
from vllm_ascend.kv_offload.testing import server as driver
from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model
from vllm_ascend.kv_offload.tiering.block_file import HEADER_BYTES

# The OpenAI server of examples/serve_kv_offload.sh, for the online tests.
START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60
REQUEST_TIMEOUT_S = 120
MAX_TOKENS = 16  # as the reference fixture
BLOCK_TOKENS = 128  # the guide's block_size (= the device block size here)


def serve_flags(device_blocks: int) -> list[str]:
    """Test-only flags of the online tests' servers."""
    return [
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
        "--num-gpu-blocks-override", str(device_blocks),
        # usage.prompt_tokens_details.cached_tokens in every response.
        "--enable-prompt-tokens-details",
    ]  # fmt: skip


# The offloading config is the example script's (the guide's); 10 device
# blocks hold one document's questions, not all three.
SERVE_FLAGS = serve_flags(10)


def cpu_block_bytes(model_dir: str) -> int:
    """K and V bytes of one 128-token block across all layers (fp32)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    per_token = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    return cfg["num_hidden_layers"] * BLOCK_TOKENS * per_token


class Server(ServingServer):
    """An OpenAI server on 127.0.0.1 in its own session (the served-model
    driver the serving benchmark uses too, ``ServingServer``): the example
    script ``examples/serve_kv_offload.sh`` (the guide's config,
    ``SERVE_FLAGS``), or, given ``transfer_config``, ``vllm serve``'s API
    server module with it as its ``--kv-transfer-config`` (16 device blocks)
    and ``flags``, started through ``launcher`` (a command prefix, e.g.
    ``nsenter``) if given."""

    def __init__(
        self,
        model: str,
        log_path: Path,
        transfer_config: dict | None = None,
        launcher: Sequence[str] = (),
        flags: Sequence[str] = (),
    ):
        self.model = model
        env = {}
        if transfer_config is None:
            # The script runs `python` and `vllm` from PATH: this interpreter's.
            env["PATH"] = os.pathsep.join(
                [str(Path(sys.executable).parent), os.environ["PATH"]]
            )
            env["HOST"] = "127.0.0.1"  # PORT: the driver's
            script = REPO / "examples" / "serve_kv_offload.sh"
            command = ["bash", str(script), model, *SERVE_FLAGS]
        else:
            flags = [
                *serve_flags(16),
                "--kv-transfer-config",
                json.dumps(transfer_config),
                *flags,
            ]
            command = driver.serve_command(model, flags)
        super().__init__([*launcher, *command], log_path, env)
        self.client = OpenAI(
            base_url=self.base + "/v1",
            api_key="unused",
            timeout=REQUEST_TIMEOUT_S,
            max_retries=0,
        )

    def wait_ready(self) -> float:
        return super().wait_ready(START_TIMEOUT_S)

    def stop(self, sig: int = signal.SIGINT) -> dict:
        return super().stop(sig, STOP_TIMEOUT_S)

    def ask(self, prompt: str) -> dict:
        """A greedy completion; its token ids and prompt tokens served by a
        cache."""
        resp = self.client.completions.create(
            model=self.model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        ).model_dump()
        details = resp["usage"].get("prompt_tokens_details") or {}
        return {
            "token_ids": resp["choices"][0]["token_ids"],
            "cached_tokens": details.get("cached_tokens") or 0,
        }

    def flush(self) -> None:
        """A short request: an engine step, which completes transfers and
        reports their stats."""
        self.client.completions.create(model=self.model, prompt="flush", max_tokens=2)

    def wait_for_metric(self, name: str, value: float) -> dict[str, float]:
        """Poll /metrics until ``name`` reaches ``value``; flushes drive the
        engine steps in between."""
        deadline = time.monotonic() + 60
        while True:
            metrics = self.metrics()
            if metrics.get(name, 0.0) >= value or time.monotonic() > deadline:
                return metrics
            self.flush()
            time.sleep(0.5)

    def quiesce(self, flushes: list | None = None) -> dict[str, float]:
        """Flushes (counted in ``flushes``) step the engine until no tier job
        is active and the tier's written bytes stopped changing; returns
        /metrics then."""
        deadline = time.monotonic() + 120
        last, steady = None, 0
        while True:
            self.flush()
            if flushes is not None:
                flushes.append(1)
            time.sleep(0.5)
            metrics = self.metrics()
            idle = all(metrics.get(g, 0.0) == 0 for g in ACTIVE_GAUGES)
            written = metrics.get("vllm:kv_offload_tiering_write_bytes_total", 0.0)
            steady = steady + 1 if idle and written == last else 0
            last = written
            if steady >= 3 or time.monotonic() > deadline:
                return metrics

    def finished(self) -> dict[str, float]:
        """``vllm:request_success_total`` by ``finished_reason``."""
        out: dict[str, float] = {}
        for sample in self.samples():
            if sample.name == "vllm:request_success_total":
                reason = sample.labels.get("finished_reason", "")
                out[reason] = out.get(reason, 0.0) + sample.value
        return out

    def usage(self) -> dict[str, int]:
        """Threads (/proc/<pid>/task) and fds (/proc/<pid>/fd) of the server
        and its engine processes."""
        procs = [psutil.Process(self.proc.pid), *self.children]
        return {
            "threads": sum(len(os.listdir(f"/proc/{p.pid}/task")) for p in procs),
            "fds": sum(len(os.listdir(f"/proc/{p.pid}/fd")) for p in procs),
        }


def delta(record: dict, name: str, since: str = "before", until: str = "end") -> float:
    """How much metric ``name`` grew between two /metrics snapshots of
    ``record`` (by default: the whole scenario, ``before`` to ``end``)."""
    return record[until].get(name, 0.0) - record[since].get(name, 0.0)


ACTIVE_GAUGES = (
    "vllm:kv_offload_tiering_active_promotion_jobs",
    "vllm:kv_offload_tiering_active_cascade_jobs",
)


def offloading(extra: dict, **fields) -> dict:
    """A ``--kv-transfer-config``: the guide's connector around ``extra``
    (its ``kv_connector_extra_config``), ``fields`` added."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
        **fields,
    }


def tiering_config(root: str, file_bytes: int) -> dict:
    # 8 CPU blocks: two documents of the three; the third comes from the fs
    # tier, bounded to 64 files.
    extra = tiering(root, num_cpu_blocks=8)
    extra["secondary_tiers"][0]["max_bytes"] = 64 * file_bytes
    return offloading(extra, kv_load_failure_policy="recompute")


EVENTS_TOPIC = "kv_events"


class EventLog:
    """Every KV-event message a server publishes on ``port``, decoded by
    ``examples/kv_events_subscriber.py`` in a thread, in arrival order."""

    def __init__(self, port: int, topic: str = EVENTS_TOPIC):
        self.messages: list = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        endpoint = f"tcp://127.0.0.1:{port}"
        self._thread = threading.Thread(
            target=self._collect, args=(endpoint, topic), daemon=True
        )
        # Subscribed before the server binds: ZeroMQ connects once it does.
        self._thread.start()

    def _collect(self, endpoint: str, topic: str) -> None:
        try:
            for message in kv_events_subscriber.subscribe(
                endpoint, topic, stop=self._stop
            ):
                self.messages.append(message)
        except BaseException as exc:  # reported by close()
            self.errors.append(exc)

    def settled(self, server: Server, quiet_s: float = 1.5) -> int:
        """How many messages arrived once the server has published what it
        had: a short request steps the engine (events go out on a step),
        then nothing new for ``quiet_s``."""
        server.flush()
        deadline = time.monotonic() + 60
        count, quiet_since = len(self.messages), time.monotonic()
        while time.monotonic() - quiet_since < quiet_s:
            assert time.monotonic() < deadline, "KV events kept coming"
            time.sleep(0.1)
            if len(self.messages) != count:
                count, quiet_since = len(self.messages), time.monotonic()
        return count

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "subscriber thread did not stop"
        assert not self.errors, f"subscriber failed: {self.errors!r}"


class TieringServer(Server):
    """``vllm serve`` with the tiering spec (``tiering_config``: a CPU tier of
    8 blocks, smaller than the three documents, and an fs tier of 64 files
    under ``root``) and the guide's KV events (``events``)."""

    def __init__(self, tmp: Path):
        model = ensure_tiny_model()
        self.root = str(tmp / "tier")
        self.start_s: float | None = None  # set once ready
        self.block_bytes = cpu_block_bytes(model)
        events_port = driver.free_port()
        self.events = EventLog(events_port)
        config = tiering_config(self.root, HEADER_BYTES + self.block_bytes)
        events = json.dumps(zmq_events(events_port, EVENTS_TOPIC))
        flags = ["--kv-events-config", events]
        super().__init__(model, tmp / "server.log", config, flags=flags)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def serve_shared(tmp: Path) -> Iterator[TieringServer]:
    """The ``tiering_server`` fixture: one ``TieringServer`` for the session;
    afterwards SIGINT must stop it and every engine process it started."""
    server = TieringServer(tmp)
    try:
        server.start_s = server.wait_ready()
        yield server
    finally:
        stop = server.stop()
        server.events.close()
        print(f"\n[tiering_server] start {server.start_s} s, stop {stop}")
    assert stop["returncode"] is not None, "server did not exit after SIGINT"
    assert stop["orphans"] == [], "engine processes outlived the server"
