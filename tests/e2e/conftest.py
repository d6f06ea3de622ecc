"""Shared pieces of the end-to-end tests: prompts, the scenario runner, the
OpenAI server of the online tests and the tiering config."""

from __future__ import annotations

import importlib.util
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
from types import ModuleType
from typing import Any

import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from vllm_ascend.kv_offload.testing import server
from vllm_ascend.kv_offload.testing.server import free_port  # noqa: F401 (tests import it from here)
from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model, make_prompt

REPO = Path(__file__).resolve().parents[2]

GUIDE_OFFLOAD = {
    "num_cpu_blocks": 1000,
    "block_size": 128,
    "spec_name": "NPUOffloadingSpec",
    "spec_module_path": "vllm_ascend.kv_offload.npu",
}

# The guide's config with the test-only spec whose worker injects the faults
# named by VLLM_ASCEND_KV_OFFLOAD_FAULTS (tests/fault_injection.py).
FAULTY_OFFLOAD = dict(
    GUIDE_OFFLOAD,
    spec_name="FaultInjectingOffloadingSpec",
    spec_module_path="tests.fault_injection",
)

# fp32 keeps recomputed and reloaded prefixes numerically identical; a small
# KV cache keeps engine start-up cheap.
ENGINE = {"dtype": "float32", "max_model_len": 2048, "enforce_eager": True}

# Three "documents" of 4 full 128-token blocks, three questions each.
DOC_WORDS = 512
DOCS = [make_prompt(DOC_WORDS, seed=100 + d) for d in range(3)]
PROMPTS_BY_DOC = [
    [f"{doc} {make_prompt(40, seed=1000 + 10 * d + q)}" for q in range(3)]
    for d, doc in enumerate(DOCS)
]
ALL_PROMPTS = [p for doc in PROMPTS_BY_DOC for p in doc]


def run_scenario(
    tmp_path: Path, name: str, scenario: dict, timeout_s: float = 600
) -> dict:
    """Run ``scenario`` in its own process; return its JSON result."""
    spec_file = tmp_path / f"{name}.json"
    out_file = tmp_path / f"{name}.result.json"
    spec_file.write_text(json.dumps(scenario))
    env = dict(os.environ)
    # "pythonpath": entries ahead of the repo, from interpreter start on (the
    # vLLM 0.33 overlay's sitecustomize must run before vllm is imported).
    path = [*scenario.get("pythonpath", []), str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.e2e.run_scenario", str(spec_file), str(out_file)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    # Everything the process printed (the error below keeps only the end).
    (tmp_path / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise AssertionError(
            f"scenario {name} failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return json.loads(out_file.read_text())


def scenario_log(tmp_path: Path, name: str) -> str:
    """The whole output (stdout, then stderr) of the last run of ``name``."""
    return (tmp_path / f"{name}.log").read_text()


def token_ids(phase: list[dict]) -> list[list[int]]:
    return [r["token_ids"] for r in phase]


def cached(phase: list[dict]) -> list[int]:
    return [r["num_cached_tokens"] for r in phase]


@pytest.fixture(scope="session")
def scenario_dir(tmp_path_factory) -> Path:
    ensure_tiny_model()
    return tmp_path_factory.mktemp("scenarios")


@pytest.fixture(scope="session")
def reference(scenario_dir) -> list[list[int]]:
    """Greedy outputs of every prompt with offloading off."""
    result = run_scenario(
        scenario_dir,
        "reference",
        {"engine": ENGINE, "offload": None, "phases": [{"prompts": ALL_PROMPTS}]},
    )
    return token_ids(result["phases"][0])


@pytest.fixture(
    scope="module",
    params=["installed", "0.33"],
    ids=["vllm-installed", "vllm-0.33-offloading"],
)
def offloading_code(request) -> dict:
    """Scenario keys that pick vLLM's offloading code: the installed release
    (0.32), or vLLM 0.33's offloading packages over it (tests/vllm033)."""
    if request.param == "installed":
        return {}
    from tests.vllm033.overlay import overlay_dir, skip_unless_core_supported

    skip_unless_core_supported()
    return {"pythonpath": [str(overlay_dir())]}


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


def zmq_events_config(port: int, topic: str):
    """The guide's ``KVEventsConfig``: vLLM publishes on ``tcp://*:port``."""
    from vllm.config import KVEventsConfig

    return KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{port}",
        topic=topic,
    )


def load_subscriber() -> ModuleType:
    """``examples/kv_events_subscriber.py``, imported by path."""
    name = "kv_events_subscriber"
    if name in sys.modules:
        return sys.modules[name]
    path = REPO / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered first: its dataclasses resolve their annotations through it.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def cpu_block_bytes(model_dir: str) -> int:
    """K and V bytes of one 128-token block across all layers (fp32)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    per_token = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    return cfg["num_hidden_layers"] * BLOCK_TOKENS * per_token


class Server(server.Server):
    """``examples/serve_kv_offload.sh`` as a subprocess on 127.0.0.1."""

    def __init__(self, model: str, log_path: Path):
        self.model = model
        env = {
            # The script runs `python` and `vllm` from PATH: this interpreter's.
            "PATH": os.pathsep.join(
                [str(Path(sys.executable).parent), os.environ["PATH"]]
            ),
            "HOST": "127.0.0.1",
            "VLLM_SERVER_DEV_MODE": "1",  # exposes POST /reset_prefix_cache
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        }
        script = str(REPO / "examples" / "serve_kv_offload.sh")
        super().__init__(["bash", script, model, *SERVE_FLAGS], log_path, env, REPO)

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


class TieringServer(Server):
    """``vllm serve``'s API server (module entry point) with
    ``transfer_config`` as its ``--kv-transfer-config``, started through
    ``launcher`` (a command prefix, e.g. ``nsenter``) if given."""

    def __init__(
        self,
        model: str,
        log_path: Path,
        transfer_config: dict,
        launcher: Sequence[str] = (),
    ):
        self.model = model
        env = {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "PYTHONPATH": os.pathsep.join(
                [str(REPO), os.environ.get("PYTHONPATH", "")]
            ),
        }
        flags = [*serve_flags(16), "--kv-transfer-config", json.dumps(transfer_config)]
        command = [*launcher, *server.serve_command(model, flags)]
        server.Server.__init__(self, command, log_path, env, REPO)


def reset_device_cache(server: TieringServer) -> None:
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


# The tiering spec with an fs tier under ``root`` (the tiering e2e tests).
def tiering(root: str, write_threads: int = 2, **changes) -> dict:
    return {
        "num_cpu_blocks": 64,
        "block_size": 128,
        "spec_name": "NPUTieringOffloadingSpec",
        "spec_module_path": "vllm_ascend.kv_offload.tiering",
        "secondary_tiers": [
            {
                "type": "fs",
                "root_dir": root,
                "n_read_threads": 2,
                "n_write_threads": write_threads,
            }
        ],
        **changes,
    }
