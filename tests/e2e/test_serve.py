"""Online serving with offloading: ``examples/serve_kv_offload.sh`` under test.

The example script starts an OpenAI-compatible server with the guide's
``--kv-transfer-config`` on 127.0.0.1 (test-only additions: fp32, eager, a
10-block device cache and the development endpoints, for
``/reset_prefix_cache``). The ``openai`` client sends greedy completions for
prompts that share 512-token document prefixes; CPU hits are forced twice,
once by device-cache eviction and once by resetting the device prefix cache.
The answers must equal those without offloading (the ``reference`` fixture:
same engine, offloading off), ``/metrics`` must count exactly the blocks
moved, and SIGINT must stop the server and all its processes.

One server serves the whole module: the ``served`` fixture runs the scenario
once and records what each test checks. It is not the session's shared
``tiering_server``: what is under test here is the example script, which
serves the guide's ``NPUOffloadingSpec`` with 1000 CPU blocks, where the
shared server needs the tiering spec with a CPU tier smaller than the
working set (test_tiering_online.py, test_kv_events.py's evictions).
"""

from __future__ import annotations

import os
import re
import signal
import sys

import pytest

from tests.conftest import run_serving_doc_flow
from tests.e2e.conftest import (
    ALL_PROMPTS,
    PROMPTS_BY_DOC,
    token_ids,
)
from tests.e2e.serving import (
    BLOCK_TOKENS,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    Server,
    cpu_block_bytes,
    delta,
)
from tests.vllm_version import VLLM_VERSION
from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.e2e

DOC_BLOCKS = 4  # each document is 512 tokens


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    """Start the example server, run the scenario, stop it; record it all."""
    model = ensure_tiny_model()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    server = Server(model, log_path)
    record: dict = {"block_bytes": cpu_block_bytes(model), "log": log_path}
    try:
        record["start_s"] = server.wait_ready()
        block = record["block_bytes"]
        record["before"] = server.metrics()

        # 1. Every question of every document: each document's 4 full blocks
        # are offloaded once; documents 1 and 2 evict document 0 from the
        # 10-block device cache.
        record["first"] = [server.ask(p) for p in ALL_PROMPTS]
        stored = 3 * DOC_BLOCKS * block
        record["after_first"] = server.wait_for_metric(
            "vllm:kv_offload_store_bytes_total", stored
        )

        # 2. Document 0 again: its prefix now lives only in the CPU pool.
        record["evicted"] = server.ask(PROMPTS_BY_DOC[0][0])
        record["after_evicted"] = server.wait_for_metric(
            "vllm:kv_offload_load_bytes_total", 4 * block
        )

        # 3. Empty the device prefix cache (the CPU pool stays), then the
        # first question of each document: all three prefixes from the CPU.
        server.reset_caches(external=False)
        record["after_reset"] = [server.ask(q[0]) for q in PROMPTS_BY_DOC]
        record["end"] = server.wait_for_metric(
            "vllm:kv_offload_load_bytes_total", (DOC_BLOCKS + 3 * DOC_BLOCKS) * block
        )
        record["pool_info"] = [
            s.labels
            for s in server.samples()
            if s.name == "vllm:kv_offload_cpu_pool_info"
        ]
        # The serving doc's curl + jq flow, as a reader runs it (after the
        # snapshots above, which it does not disturb).
        record["doc_flow"] = run_serving_doc_flow(server.port)
    except BaseException:
        record["stop"] = server.stop()
        print(server.log_tail(), file=sys.stderr)
        raise
    record["stop"] = server.stop()
    record["log_text"] = log_path.read_text(errors="replace")
    # Shown with `pytest -s`: what the scenario moved.
    summary = {
        name: delta(record, name)
        for name in sorted(record["end"])
        if name.startswith(("vllm:kv_offload", "vllm:external_prefix", "vllm:prompt"))
        and "_created" not in name
        and "_bucket" not in name
    }
    print(
        f"\n[test_serve] start {record['start_s']:.1f} s, stop {record['stop']}, "
        f"block {record['block_bytes']} B, cached tokens "
        f"{[r['cached_tokens'] for r in record['first']]} / "
        f"{record['evicted']['cached_tokens']} / "
        f"{[r['cached_tokens'] for r in record['after_reset']]}\n"
        + "\n".join(f"  {k} += {v:g}" for k, v in summary.items())
    )
    return record


def test_server_starts_with_the_guide_config(served):
    log = served["log_text"]
    assert "Loading out-of-tree offloading spec 'NPUOffloadingSpec'" in log
    assert "NPUOffloadingSpec: 1000 CPU blocks of 128 tokens" in log
    assert served["start_s"] < START_TIMEOUT_S
    # Said before the engine's start, which can be silent for minutes.
    assert (
        "[serve_kv_offload] starting the server: its engine loads the model "
        "(eager mode: nothing to compile); vLLM's log follows on this terminal"
    ) in log


def test_the_serving_docs_curl_flow_gets_completions(served):
    flow = served["doc_flow"]
    if flow is None:
        pytest.skip("curl or jq is not installed")
    assert len(flow.completions) == 2, flow.output
    for reply in flow.completions:
        assert "error" not in reply, reply  # e.g. a 404 for a model not served
        assert reply["usage"]["prompt_tokens"] == 600  # the doc's prompt
    assert len(flow.resets) == 1
    assert any(m.startswith("vllm:kv_offload_store_bytes_total") for m in flow.metrics)


def test_answers_equal_those_without_offloading(served, reference, first_answers):
    assert token_ids(served["first"]) == reference
    assert served["evicted"]["token_ids"] == reference[0]
    assert token_ids(served["after_reset"]) == first_answers


def test_shared_prefixes_are_served_from_a_cache(served):
    cached = [r["cached_tokens"] for r in served["first"]]
    # First question of a document: nothing cached; the other two reuse the
    # document's 4 blocks from the device cache.
    assert cached[0::3] == [0, 0, 0]
    assert all(c == DOC_BLOCKS * BLOCK_TOKENS for i, c in enumerate(cached) if i % 3)


def test_prefix_evicted_from_device_is_loaded_from_cpu(served):
    assert served["evicted"]["cached_tokens"] == DOC_BLOCKS * BLOCK_TOKENS
    # Exactly document 0's 4 blocks were loaded.
    loaded = delta(
        served, "vllm:kv_offload_load_bytes_total", "after_first", "after_evicted"
    )
    assert loaded == DOC_BLOCKS * served["block_bytes"]


def test_after_prefix_cache_reset_prefixes_come_from_cpu(served):
    cached = [r["cached_tokens"] for r in served["after_reset"]]
    assert cached == [DOC_BLOCKS * BLOCK_TOKENS] * len(PROMPTS_BY_DOC)
    loaded = delta(served, "vllm:kv_offload_load_bytes_total", "after_evicted", "end")
    assert loaded == len(PROMPTS_BY_DOC) * DOC_BLOCKS * served["block_bytes"]


def test_metrics_count_the_blocks_moved(served):
    block = served["block_bytes"]
    stored = delta(served, "vllm:kv_offload_store_bytes_total")
    loaded = delta(served, "vllm:kv_offload_load_bytes_total")
    # Each document's 4 full blocks were stored once (later hits re-store
    # nothing); 4 + 12 blocks were loaded back.
    assert stored == 3 * DOC_BLOCKS * block
    assert loaded == 4 * DOC_BLOCKS * block
    assert loaded % block == 0
    assert delta(served, "vllm:kv_offload_store_time_total") > 0
    assert delta(served, "vllm:kv_offload_load_time_total") > 0
    # One store job per document, one load job per CPU hit.
    assert delta(served, "vllm:kv_offload_store_size_count") == 3
    assert delta(served, "vllm:kv_offload_load_size_count") == 4
    # The prompt tokens that the loads served, as vLLM's cache counters see them.
    hit_tokens = 4 * DOC_BLOCKS * BLOCK_TOKENS
    assert delta(served, "vllm:external_prefix_cache_hits_total") == hit_tokens
    if VLLM_VERSION >= (0, 32):  # the per-tier counter is new in vLLM 0.32
        by_source = "vllm:prompt_tokens_cached_by_source_total{source=host}"
        assert delta(served, by_source) == hit_tokens
    # vLLM's deprecated per-direction counters agree.
    assert delta(served, "vllm:kv_offload_total_bytes_total") == stored + loaded


def test_metrics_tell_a_router_the_cpu_pool_size_and_occupancy(served):
    after = served["end"]
    block = served["block_bytes"]
    # The guide's num_cpu_blocks: 1000 CPU blocks of 128 tokens.
    assert after["vllm:kv_offload_cpu_pool_capacity_blocks"] == 1000
    assert after["vllm:kv_offload_cpu_pool_capacity_bytes"] == 1000 * block
    # The three documents' 4 blocks each, nothing evicted from 1000.
    assert after["vllm:kv_offload_cpu_pool_blocks_in_use"] == 3 * DOC_BLOCKS
    assert delta(served, "vllm:kv_offload_cpu_pool_evictions_total") == 0


def test_metrics_tell_an_operator_the_pool_kind_copy_path_and_failures(served):
    # One worker: one info series, with the copy path its self-check logged.
    chosen = re.findall(r"KV offload: copy path (\S+) on", served["log_text"])
    assert len(chosen) == 1, chosen
    assert [
        {k: v for k, v in labels.items() if k not in ("model_name", "engine")}
        for labels in served["pool_info"]
    ] == [
        {
            "memory_kind": "pageable mmap",  # the cpu backend's pool
            "pinned": "false",
            "pieces": "1",
            "copy_path": chosen[0],
        }
    ]
    assert delta(served, "vllm:kv_offload_failed_stores_total") == 0
    assert delta(served, "vllm:kv_offload_failed_loads_total") == 0
    assert "vllm:kv_offload_failed_loads_total" in served["end"]


def test_the_cpu_backend_keeps_a_core_for_the_scheduler(served):
    # vLLM's CPU backend reserves one more core with a KV connector; on two
    # cores that left none and ran OpenMP on both. Our plugin
    # (cpu_threads.py: VLLM_CPU_NUM_OF_RESERVED_CPU=1) must leave one core
    # to the scheduler: what counts is the binding vLLM logs.
    log = served["log_text"]
    assert "should be greater than reserved CPU core" not in log
    if len(os.sched_getaffinity(0)) == 2:
        bound = re.findall(r"local_rank=0, core ids=\[([0-9, ]*)\]", log)
        assert bound, "vLLM logged no OpenMP binding"
        assert all(len(ids.split(",")) == 1 for ids in bound), bound


def test_server_stops_cleanly_on_sigint(served):
    stop = served["stop"]
    assert stop["returncode"] is not None, "server did not exit after SIGINT"
    assert stop["returncode"] in (0, -signal.SIGINT), stop
    assert stop["stop_s"] < STOP_TIMEOUT_S
    assert stop["orphans"] == [], "engine processes outlived the server"
