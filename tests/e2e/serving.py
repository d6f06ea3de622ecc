"""The online tests' OpenAI server (``examples/serve_kv_offload.sh`` or
``vllm serve``'s API server module) and what they read of it."""

from __future__ import annotations

import json
import os
import signal
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

from tests.e2e.conftest import REPO
from vllm_ascend.kv_offload.testing import server as driver

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


class Server(driver.Server):
    """An OpenAI server on 127.0.0.1 in its own session (the one server
    driver, ``testing.server``): the example script
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
        env = {"VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO), os.environ.get("PYTHONPATH", "")]
        )
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
            ]
            command = driver.serve_command(model, flags)
        super().__init__([*launcher, *command], log_path, env, REPO)

    def wait_ready(self) -> float:
        return super().wait_ready(START_TIMEOUT_S)

    def stop(self, sig: int = signal.SIGINT) -> dict:
        return super().stop(sig, STOP_TIMEOUT_S)

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
