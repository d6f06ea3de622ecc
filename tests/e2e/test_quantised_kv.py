"""Quantised KV end to end on vLLM's CPU backend (ran on CPU only, no NPU).

For each fp8 ``kv_cache_dtype`` vLLM's CPU attention backend declares
(``CPUAttentionBackend.supported_kv_cache_dtypes``; ``fp8`` is vLLM's name
for ``fp8_e4m3``, the same bytes and kernel, so it stands for both), the
same prompts run with offloading off, then on with the guide's config
(every dtype's two engines one after the other in one process): greedy
outputs must be equal, the device and CPU hits must be served, and sizing,
the doctor, the pool's capacity gauge and the pool the worker allocated
must agree on the quantised bytes per CPU block.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.e2e.conftest import (
    ENGINE,
    FULL_DOC_TOKENS,
    GUIDE_OFFLOAD,
    PROMPTS_BY_DOC,
    cached,
    in_process,
    run_scenario,
    scenario_log,
    token_ids,
)
from vllm_ascend.kv_offload import doctor
from vllm_ascend.kv_offload.pool_metrics import CAPACITY_BYTES
from vllm_ascend.kv_offload.sizing import size_model_dir
from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.e2e

PROMPTS = PROMPTS_BY_DOC[0]
LOAD_BYTES = "vllm:kv_offload_load_bytes"
STORE_BYTES = "vllm:kv_offload_store_bytes"
POOL_LINE = re.compile(r"CPU block pool of (\d+) blocks x (\d+) bytes")


KV_CACHE_DTYPES = ["fp8", "fp8_e5m2"]


def dtype_engines(kv_cache_dtype: str) -> list[dict]:
    """Offloading off, then on (cold; again: device hit; after a device
    prefix-cache reset: CPU hit), in-process."""
    engine = dict(ENGINE, kv_cache_dtype=kv_cache_dtype)
    return [
        in_process(
            {"engine": engine, "offload": None, "phases": [{"prompts": PROMPTS}]}
        ),
        in_process(
            {
                "engine": engine,
                "offload": GUIDE_OFFLOAD,
                "phases": [
                    {"prompts": PROMPTS},
                    {"prompts": PROMPTS},
                    {"prompts": PROMPTS, "reset_prefix_cache": True},
                ],
            }
        ),
    ]


@pytest.fixture(scope="module")
def all_runs(scenario_dir) -> dict:
    """Every dtype's engines (``dtype_engines``) one after the other in one
    process (one interpreter and vLLM import for all); its whole log."""
    sequence = [e for dtype in KV_CACHE_DTYPES for e in dtype_engines(dtype)]
    result = run_scenario(scenario_dir, "quantised", {"sequence": sequence})
    return {"runs": result["runs"], "log": scenario_log(scenario_dir, "quantised")}


@pytest.fixture(scope="module", params=KV_CACHE_DTYPES)
def kv_cache_dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def runs(all_runs, kv_cache_dtype) -> dict:
    """This dtype's two engines: ``off``, ``on``; ``index``: its place in
    the sequence."""
    index = KV_CACHE_DTYPES.index(kv_cache_dtype)
    off, on = all_runs["runs"][2 * index : 2 * index + 2]
    return {"off": off, "on": on, "log": all_runs["log"], "index": index}


def test_the_engine_ran_the_quantised_kv_cache(runs, kv_cache_dtype):
    # vLLM logs the dtype it stores KV in: the engines did not fall back.
    assert f"Using {kv_cache_dtype} data type to store kv cache" in runs["log"]


def test_outputs_with_offloading_equal_outputs_without(runs):
    reference = token_ids(runs["off"]["phases"][0])
    for phase in runs["on"]["phases"]:
        assert token_ids(phase) == reference


def test_cold_then_device_hit_then_cpu_hit(runs):
    cold, device, cpu = runs["on"]["phases"]
    after_cold, after_device, after_cpu = runs["on"]["phase_counters"]
    # Cold: the first question computes the document; the stores happen.
    assert cached(cold)[0] == 0
    assert after_cold[STORE_BYTES] > 0
    # Device hit: the document is served without loading anything.
    assert cached(device)[0] >= FULL_DOC_TOKENS
    # (vLLM reports a counter once it moved.)
    assert after_device.get(LOAD_BYTES, 0) == after_cold.get(LOAD_BYTES, 0)
    # CPU hit: after the device cache was reset, the document comes back
    # from the CPU pool.
    assert cached(cpu)[0] >= FULL_DOC_TOKENS
    assert after_cpu.get(LOAD_BYTES, 0) > after_device.get(LOAD_BYTES, 0)


def test_sizing_doctor_gauge_and_pool_agree_on_quantised_bytes(
    runs, kv_cache_dtype, capsys
):
    model = ensure_tiny_model()
    dtype = ENGINE["dtype"]
    ours = size_model_dir(model, kv_cache_dtype=kv_cache_dtype, dtype=dtype)
    # The pool the worker allocated, as it logs it: one per dtype, by its
    # engine with offloading on (in the sequence's order).
    pools = POOL_LINE.findall(runs["log"])
    assert len(pools) == len(KV_CACHE_DTYPES)
    assert pools[runs["index"]] == (
        str(GUIDE_OFFLOAD["num_cpu_blocks"]),
        str(ours.worker_bytes_per_cpu_block),
    )
    # The capacity gauge on /metrics (all workers, padded blocks).
    capacity = runs["on"]["counters"][CAPACITY_BYTES]
    assert capacity == GUIDE_OFFLOAD["num_cpu_blocks"] * ours.bytes_per_cpu_block
    # The doctor sizes the same block from the same flags.
    capsys.readouterr()
    flags = ["--model", model, "--kv-cache-dtype", kv_cache_dtype, "--dtype", dtype]
    doctor.main([*flags, "--alloc-mib", "0", "--bandwidth-mib", "0", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["bytes_per_cpu_block"] == ours.bytes_per_cpu_block
    # One byte per element: a quarter of the unquantised (float32) block.
    full = size_model_dir(model, kv_cache_dtype="auto", dtype=dtype)
    assert 4 * ours.worker_bytes_per_cpu_block == full.worker_bytes_per_cpu_block
