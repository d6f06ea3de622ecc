"""The served model of the serving benchmark, its profile and the online
e2e tests: ``vllm serve`` (or the example script) through the one server
driver (``vllm_ascend.kv_offload.testing.server``) in the environment they
share, and what is read from it: ``/metrics`` samples and totals, RSS, the
OpenMP binding vLLM logged, greedy token ids. The benchmark's servers run
with offloading off or on (the guide's ``--kv-transfer-config``, every
other flag the same).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import REPO
from benchmarks.serving_workloads import BLOCK_TOKENS
from vllm_ascend.kv_offload.testing import server
from vllm_ascend.kv_offload.testing.engine import GUIDE_EXTRA_CONFIG

# /metrics counters recorded per workload (summed over labels but source).
COUNTERS = {
    "device_hit_tokens": "vllm:prompt_tokens_cached_by_source_total{source=device}",
    "cpu_hit_tokens": "vllm:prompt_tokens_cached_by_source_total{source=host}",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
    "load_bytes": "vllm:kv_offload_load_bytes_total",
    "store_bytes": "vllm:kv_offload_store_bytes_total",
}


def prometheus_samples(text: str) -> Iterator[Any]:
    """Every sample of a /metrics page (prometheus_client's ``Sample``)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        yield from family.samples


def prometheus_totals(text: str) -> dict[str, float]:
    """Every sample of a /metrics page, summed over labels except ``source``."""
    totals: dict[str, float] = {}
    for sample in prometheus_samples(text):
        name = sample.name
        if "source" in sample.labels:
            name += f"{{source={sample.labels['source']}}}"
        totals[name] = totals.get(name, 0.0) + sample.value
    return totals


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict:
    return {k: after.get(n, 0.0) - before.get(n, 0.0) for k, n in COUNTERS.items()}


def parse_omp_binding(log_text: str) -> dict | None:
    """Rank 0's OpenMP cores and the reserved cores from vLLM's "OpenMP thread
    binding info" log lines (``OMPProcessManager``), or None if absent."""
    cores = re.search(r"local_rank=0, core ids=\[([0-9, ]*)\]", log_text)
    reserved = re.search(r"reserved_cpus=\[([0-9, ]*)\]", log_text)
    if cores is None or reserved is None:
        return None

    def ids(m):
        return [int(x) for x in m.group(1).replace(" ", "").split(",") if x]

    return {"omp_cores": ids(cores), "reserved_cpus": ids(reserved)}


def offload_config(cpu_blocks: int) -> str:
    """The guide's --kv-transfer-config, with a pool of ``cpu_blocks``."""
    extra = {**GUIDE_EXTRA_CONFIG, "num_cpu_blocks": cpu_blocks}
    assert extra["block_size"] == BLOCK_TOKENS
    return json.dumps(
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": extra}
    )  # fmt: skip


def serve_flags(
    device_blocks: int,
    max_num_seqs: int,
    cpu_blocks: int | None = None,
    dtype: str = "float32",
    max_model_len: int = 2048,
) -> list[str]:
    """``vllm serve`` flags: the same for both servers, plus the guide's
    ``--kv-transfer-config`` (a pool of ``cpu_blocks``) with offloading on
    (``cpu_blocks`` given)."""
    flags = [
        "--dtype", dtype, "--enforce-eager",
        "--block-size", str(BLOCK_TOKENS),
        "--max-model-len", str(max_model_len),
        "--num-gpu-blocks-override", str(device_blocks),
        "--max-num-seqs", str(max_num_seqs),
        "--seed", "0",
    ]  # fmt: skip
    if cpu_blocks is not None:
        flags += ["--kv-transfer-config", offload_config(cpu_blocks)]
    return flags


def server_env() -> dict[str, str]:
    """What every server gets on top of this environment: the checkout first
    on ``PYTHONPATH``, no CPU-thread setting (vLLM and our plugin choose),
    1 GiB ``VLLM_CPU_KVCACHE_SPACE`` unless set (``--num-gpu-blocks-override``
    sizes the device cache), and ``POST /reset_prefix_cache``."""
    return {
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_SERVER_DEV_MODE": "1",
    }


class ServingServer(server.Server):
    """A server of ``command`` (``server.serve_command`` or a script that
    execs it) run from the checkout with ``server_env()`` and ``env``, and
    what is read from it: the one served-model driver of the serving
    benchmark, the profile and the online e2e tests (``tests/e2e/serving.py``)."""

    def __init__(
        self, command: Sequence[str], log: Path, env: dict[str, str] | None = None
    ):
        super().__init__(command, log, {**server_env(), **(env or {})}, REPO)

    def samples(self) -> Iterator[Any]:
        """Every sample on /metrics (prometheus_client's ``Sample``)."""
        return prometheus_samples(self.get("/metrics", timeout=30).decode())

    def metrics(self) -> dict[str, float]:
        """Every sample on /metrics, summed over labels except ``source``."""
        return prometheus_totals(self.get("/metrics", timeout=30).decode())

    def reset_caches(self, external: bool = True) -> None:
        """Empties the device prefix cache and (``external``) the CPU pool or
        tier too (an fs tier keeps its files)."""
        path = "/reset_prefix_cache" + ("?reset_external=true" if external else "")
        deadline = time.monotonic() + 120
        while True:
            body = self.post(path, timeout=60)
            if body["success"]:  # vLLM always answers {"success": bool}
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"reset_prefix_cache kept failing: {body}")
            time.sleep(0.5)  # refused while transfers are in flight

    def rss_bytes(self) -> int:
        """The RSS of the server and all its processes."""
        total = 0
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in [self.proc, *self.proc.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += p.memory_info().rss
        return total

    def complete(self, model: str, prompt: str, max_tokens: int) -> list[int]:
        """The greedy completion's token ids."""
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        return self.post("/v1/completions", body)["choices"][0]["token_ids"]

    def omp_binding(self) -> dict | None:
        return parse_omp_binding(self.log_path.read_text(errors="replace"))
