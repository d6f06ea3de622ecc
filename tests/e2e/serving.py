"""The online tests' OpenAI server (``examples/serve_kv_offload.sh`` or
``vllm serve``'s API server module) and what they read of it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import REPO, free_port

# The OpenAI server of examples/serve_kv_offload.sh, for the online tests.
START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60
REQUEST_TIMEOUT_S = 120
MAX_TOKENS = 16  # as the reference fixture
BLOCK_TOKENS = 128  # the guide's block_size (= the device block size here)


def serve_flags(device_blocks: int) -> list[str]:
    """Test-only flags of the online tests' servers."""
    return [
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "1024",
        "--num-gpu-blocks-override",
        str(device_blocks),
        # usage.prompt_tokens_details.cached_tokens in every response.
        "--enable-prompt-tokens-details",
    ]


# The offloading config is the example script's (the guide's); 10 device
# blocks hold one document's questions, not all three.
SERVE_FLAGS = serve_flags(10)


def cpu_block_bytes(model_dir: str) -> int:
    """K and V bytes of one 128-token block across all layers (fp32)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    per_token = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    return cfg["num_hidden_layers"] * BLOCK_TOKENS * per_token


class Server:
    """An OpenAI server on 127.0.0.1 in its own session: the example script
    ``examples/serve_kv_offload.sh`` (the guide's config, ``SERVE_FLAGS``),
    or, given ``transfer_config``, ``vllm serve``'s API server module with it
    as its ``--kv-transfer-config`` (16 device blocks), started through
    ``launcher`` (a command prefix, e.g. ``nsenter``) if given."""

    def __init__(
        self,
        model: str,
        log_path: Path,
        transfer_config: dict | None = None,
        launcher: Sequence[str] = (),
    ):
        self.model = model
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # /reset_prefix_cache
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        if transfer_config is None:
            # The script runs `python` and `vllm` from PATH: this interpreter's.
            env["PATH"] = os.pathsep.join(
                [str(Path(sys.executable).parent), env["PATH"]]
            )
            env.update(HOST="127.0.0.1", PORT=str(self.port))
            script = REPO / "examples" / "serve_kv_offload.sh"
            command = ["bash", str(script), model, *SERVE_FLAGS]
        else:
            command = [
                sys.executable,
                "-m",
                # `vllm serve` (the example script's fallback: the CLI's
                # version check fails where the metadata says vllm-cpu).
                "vllm.entrypoints.launchers.api_server.entry",
                "--model",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *serve_flags(16),
                "--kv-transfer-config",
                json.dumps(transfer_config),
            ]
        self._log = open(log_path, "wb")  # closed in stop()
        self.proc = psutil.Popen(
            [*launcher, *command],
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # Its own session: a Ctrl-C on pytest does not hit it twice.
            start_new_session=True,
        )
        self.children: list[psutil.Process] = []

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self) -> float:
        start = time.monotonic()
        while time.monotonic() - start < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"server exited with {self.proc.returncode} during start-up:\n"
                    f"{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        # The script exec's the server: this pid is the API
                        # server, its descendants the engine core and worker.
                        parent = psutil.Process(self.proc.pid)
                        self.children = parent.children(recursive=True)
                        return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        raise AssertionError(
            f"server not healthy after {START_TIMEOUT_S} s:\n{self.log_tail()}"
        )

    def post(self, path: str) -> dict:
        req = urllib.request.Request(self.base + path, data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return json.loads(r.read())

    def samples(self) -> Iterator[Any]:
        """Every sample on /metrics (prometheus_client's ``Sample``)."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            yield from family.samples

    def metrics(self) -> dict[str, float]:
        """Every sample on /metrics, summed over labels except ``source``."""
        totals: dict[str, float] = {}
        for sample in self.samples():
            name = sample.name
            if "source" in sample.labels:
                name += f"{{source={sample.labels['source']}}}"
            totals[name] = totals.get(name, 0.0) + sample.value
        return totals

    def finished(self) -> dict[str, float]:
        """``vllm:request_success_total`` by ``finished_reason``."""
        out: dict[str, float] = {}
        for sample in self.samples():
            if sample.name == "vllm:request_success_total":
                reason = sample.labels.get("finished_reason", "")
                out[reason] = out.get(reason, 0.0) + sample.value
        return out

    def processes(self) -> list[psutil.Process]:
        return [psutil.Process(self.proc.pid), *self.children]

    def usage(self) -> dict[str, int]:
        """Threads (/proc/<pid>/task) and fds (/proc/<pid>/fd) of the server
        and its engine processes."""
        procs = self.processes()
        return {
            "threads": sum(len(os.listdir(f"/proc/{p.pid}/task")) for p in procs),
            "fds": sum(len(os.listdir(f"/proc/{p.pid}/fd")) for p in procs),
        }

    def stop(self, sig: int = signal.SIGINT) -> dict:
        """``sig`` (SIGKILL: to the whole process group), then wait; returns
        how the server and its children ended."""
        result = {"returncode": self.proc.poll(), "stop_s": 0.0, "orphans": []}
        if result["returncode"] is None:
            start = time.monotonic()
            if sig == signal.SIGKILL:
                # Its own session (start_new_session): the group is its pid.
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
            try:
                result["returncode"] = self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                result["returncode"] = None
            result["stop_s"] = time.monotonic() - start
        # Children get a grace period to notice their parent is gone.
        _, alive = psutil.wait_procs(self.children, timeout=15)
        result["orphans"] = [p.pid for p in alive]
        # Whatever is left was started by this test: end it by pid.
        if result["returncode"] is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self._log.close()
        return result


def reset_device_cache(server: Server) -> None:
    deadline = time.monotonic() + 60
    while not server.post("/reset_prefix_cache")["success"]:
        assert time.monotonic() < deadline, "reset_prefix_cache kept failing"
        time.sleep(0.5)


def wait_for_metric(server: Server, client, model: str, name: str, value: float):
    """Poll /metrics until ``name`` reaches ``value``; short requests drive the
    engine steps that complete transfers and report their stats."""
    deadline = time.monotonic() + 60
    while True:
        metrics = server.metrics()
        if metrics.get(name, 0.0) >= value or time.monotonic() > deadline:
            return metrics
        client.completions.create(model=model, prompt="flush", max_tokens=2)
        time.sleep(0.5)


def complete(client: OpenAI, model: str, prompt: str) -> dict:
    """A greedy completion; its token ids and prompt tokens served by a cache."""
    resp = client.completions.create(
        model=model,
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
