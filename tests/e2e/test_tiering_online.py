"""Online serving with tiering: ``vllm serve`` with a CPU tier too small for
the working set and a bounded fs tier, under a burst of concurrent
streaming clients of which two thirds disconnect: a third before the
engine schedules their requests, a third after their first chunk (while
the other requests' prefix loads are in flight).

Afterwards the server must answer the fixed prompts exactly as offloading
off does (the ``reference`` fixture, greedy), ``/metrics`` must be
consistent (counters only grow, no negative value, no transfer left
active, bytes in whole blocks), and the server must not have leaked: its
processes' threads and file descriptors back within a generous bound of
before the burst, no temp file left in the tier directory. Loopback only.

The server is the session's ``tiering_server`` (tests/e2e/serving.py,
shared with test_kv_events.py): this module empties its CPU tier first,
reads counters as deltas from then on, and the fixture's teardown checks
that SIGINT stops it and every engine process it started.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import ALL_PROMPTS, PROMPTS_BY_DOC, token_ids
from tests.e2e.run_scenario import temp_files
from tests.e2e.serving import (
    ACTIVE_GAUGES,
    REQUEST_TIMEOUT_S,
    Server,
    delta,
)

pytestmark = pytest.mark.e2e

BURST = 24  # concurrent streams: a third each finish, drop early, drop mid-way
BURST_TOKENS = 32
# vLLM does not wait for a streaming client: the engine generates on while
# the disconnect travels client -> API server -> engine core, and the SSE
# chunks fit in loopback socket buffers. A request of this model can
# reach its max_tokens first (on a loaded machine: every one of them, in 2
# of 6 runs), so whether a mid-way drop aborts its request is a race. The
# early drops are made while the engine is paused (vLLM's dev endpoint
# ``/pause?mode=keep``): their aborts reach the engine before it resumes,
# so they can never run. Each kind gets its own max_tokens, so vLLM's
# histogram of generated tokens per finished request tells them apart
# (buckets 1-2-5: 32 in (20, 50], 64 in (50, 100], 256 in (200, 500]).
DROP_TOKENS = 256
EARLY_TOKENS = 64
EARLY_BUCKET = ("50.0", "100.0")
# Generous: a thread or an fd per in-flight request would exceed it.
FD_SLACK = 16
THREAD_SLACK = 8


def completion_calls(server: Server) -> float:
    """``/v1/completions`` calls the API server has ended (its HTTP metrics;
    a dropped stream's call ends once its abort was sent)."""
    return sum(
        s.value
        for s in server.samples()
        if s.name == "http_requests_total"
        and s.labels.get("handler") == "/v1/completions"
    )


def generated_in(server: Server, low: str, high: str) -> float:
    """Finished requests that generated more than ``low`` and at most
    ``high`` tokens (vLLM's histogram buckets)."""
    cumulative = {
        s.labels["le"]: s.value
        for s in server.samples()
        if s.name == "vllm:request_generation_tokens_bucket"
    }
    return cumulative[high] - cumulative[low]


def stream(
    base: str, model: str, prompt: str, how: str, dropped: threading.Event
) -> dict:
    """One streaming completion: ``finish`` reads it all, ``early`` drops the
    connection once the server answered (the engine paused) and sets
    ``dropped``, ``midway`` drops it after the first chunk."""
    max_tokens = {"finish": BURST_TOKENS, "early": EARLY_TOKENS}.get(how, DROP_TOKENS)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out: dict = {"how": how, "chunks": 0, "finish_reason": None, "tokens": None}
    try:
        with (
            httpx.Client(timeout=REQUEST_TIMEOUT_S) as client,
            client.stream("POST", base + "/v1/completions", json=body) as resp,
        ):
            resp.raise_for_status()
            if how == "early":
                return out
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if chunk.get("choices"):
                    out["chunks"] += 1
                    reason = chunk["choices"][0].get("finish_reason")
                    out["finish_reason"] = reason or out["finish_reason"]
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
                if how == "midway" and out["chunks"] >= 1:
                    return out
    finally:
        if how == "early":
            dropped.set()  # the connection is closed (or never opened)
    return out


def burst(server: Server) -> list[dict]:
    """The burst's streams, the early ones dropped while the engine is
    paused: each early request's call has ended in the API server (which
    sent its abort to the engine core first) before the resume is sent on
    the same channel, so the engine drops them before it schedules any."""
    hows = ["finish", "early", "midway"] * (BURST // 3)
    prompts = [ALL_PROMPTS[i % len(ALL_PROMPTS)] for i in range(BURST)]
    random.Random(21).shuffle(prompts)
    ended = completion_calls(server)
    drops = [threading.Event() for _ in hows]
    server.post("/pause?mode=keep&clear_cache=false")
    with ThreadPoolExecutor(BURST) as pool:
        futures = [
            pool.submit(stream, server.base, server.model, p, how, dropped)
            for p, how, dropped in zip(prompts, hows, drops, strict=True)
        ]
        try:
            for how, dropped in zip(hows, drops, strict=True):
                if how == "early":
                    assert dropped.wait(REQUEST_TIMEOUT_S), "an early client hung"
            # No other call can end while the engine is paused.
            deadline = time.monotonic() + REQUEST_TIMEOUT_S
            while completion_calls(server) < ended + BURST // 3:
                assert time.monotonic() < deadline, "disconnects not noticed"
                time.sleep(0.2)
        except BaseException:
            # The other streams wait for the engine: let them end.
            with contextlib.suppress(Exception):
                server.post("/resume")
            raise
        server.post("/resume")
        return [f.result(timeout=300) for f in futures]


@pytest.fixture(scope="module")
def served(tiering_server) -> dict:
    server = tiering_server
    root = server.root
    record: dict = {"block_bytes": server.block_bytes, "root": root}
    # The CPU tier emptied (what earlier tests left there), nothing in flight.
    server.quiesce()
    server.reset_caches()
    record["start"] = server.metrics()

    # Warm: every document stored to the CPU tier and cascaded to fs.
    record["warm"] = [server.ask(p) for p in ALL_PROMPTS]
    record["before"] = server.quiesce()
    record["usage_before"] = server.usage()
    record["finished_before"] = server.finished()

    # The burst: every prefix loaded again (the device cache emptied),
    # from the CPU or the fs tier, while clients drop out.
    record["early_ran_before"] = generated_in(server, *EARLY_BUCKET)
    server.reset_caches(external=False)
    start = time.monotonic()
    record["burst"] = burst(server)
    record["burst_s"] = time.monotonic() - start
    record["flushes"] = []
    record["after_burst"] = server.quiesce(record["flushes"])
    record["finished_after_burst"] = server.finished()
    record["early_ran_after"] = generated_in(server, *EARLY_BUCKET)

    # Afterwards: the fixed prompts, prefixes again from the tiers.
    server.reset_caches(external=False)
    record["after"] = [server.ask(p) for p in ALL_PROMPTS]
    record["first_questions"] = [server.ask(q[0]) for q in PROMPTS_BY_DOC]
    record["end"] = server.quiesce()
    record["usage_after"] = server.usage()
    record["temp_files"] = temp_files(root)
    record["log_text"] = server.log_text()
    print(
        f"\n[test_tiering_online] burst {record['burst_s']:.1f} s, finished "
        f"{record['finished_before']} -> {record['finished_after_burst']}, usage "
        f"{record['usage_before']} -> {record['usage_after']}"
    )
    return record


def test_the_server_runs_with_tiering(served):
    assert "NPUTieringOffloadingSpec" in served["log_text"]
    assert "fs tier at" in served["log_text"]


def test_finished_streams_got_every_token(served):
    finished = [r for r in served["burst"] if r["how"] == "finish"]
    assert len(finished) == BURST // 3
    assert all(r["tokens"] == BURST_TOKENS for r in finished), finished
    assert all(r["finish_reason"] == "length" for r in finished), finished


def test_dropped_clients_aborted_their_requests_and_none_failed(served):
    # Every client that dropped before the engine scheduled its request had
    # it aborted: none of them ran (no finished request generated their
    # token count; vLLM does not count aborted requests as finished).
    assert served["early_ran_after"] == served["early_ran_before"]
    # The finished streams and the flushes ran out; so may a mid-way
    # dropped request that reached its end before its disconnect did.
    before, after = served["finished_before"], served["finished_after_burst"]
    ran_out = after.get("length", 0.0) - before.get("length", 0.0)
    assert ran_out >= BURST // 3, (before, after)
    assert after.get("error", 0.0) == before.get("error", 0.0) == 0
    # No request of a dropped client is left in the engine.
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert served["after_burst"].get(gauge, 0.0) == 0, gauge


def test_answers_after_the_burst_equal_those_without_offloading(
    served, reference, first_answers
):
    assert token_ids(served["warm"]) == reference
    assert token_ids(served["after"]) == reference
    assert token_ids(served["first_questions"]) == first_answers


def test_prefixes_were_loaded_from_the_tiers(served):
    # The device cache was reset: the documents came back from CPU or fs.
    assert all(r["cached_tokens"] >= 512 for r in served["first_questions"])
    read = delta(served, "vllm:kv_offload_tiering_read_bytes_total")
    assert read > 0, "no fs tier load happened"


def test_metrics_are_consistent(served):
    snapshots = [served[k] for k in ("before", "after_burst", "end")]
    for earlier, later in zip(snapshots, snapshots[1:], strict=False):
        for name, value in earlier.items():
            if name.endswith(("_total", "_count", "_sum")):
                assert later.get(name, 0.0) >= value, name
    for snapshot in snapshots:
        for name, value in snapshot.items():
            if name.startswith("vllm:kv_offload"):
                assert value >= 0, (name, value)
        for gauge in ACTIVE_GAUGES:
            assert snapshot.get(gauge, 0.0) == 0, gauge
    end, block = served["end"], served["block_bytes"]
    for name in (
        "vllm:kv_offload_load_bytes_total",
        "vllm:kv_offload_store_bytes_total",
        "vllm:kv_offload_tiering_read_bytes_total",
        "vllm:kv_offload_tiering_write_bytes_total",
    ):
        assert end.get(name, 0.0) % block == 0, name
    # The fs tier holds what the CPU tier stored: it cannot write more.
    assert (
        end["vllm:kv_offload_tiering_write_bytes_total"]
        <= end["vllm:kv_offload_store_bytes_total"]
    )


def test_metrics_tell_a_router_the_cpu_tier_size_and_occupancy(served):
    # The same series as NPUOffloadingSpec's (test_serve.py), for the CPU
    # tier: 8 CPU blocks, filled by three documents of 4 blocks, which must
    # evict at least 4 of them.
    for name in ("before", "end"):
        snapshot = served[name]
        assert snapshot["vllm:kv_offload_cpu_pool_capacity_blocks"] == 8
        assert (
            snapshot["vllm:kv_offload_cpu_pool_capacity_bytes"]
            == 8 * served["block_bytes"]
        )
        assert snapshot["vllm:kv_offload_cpu_pool_blocks_in_use"] == 8
    assert (
        delta(served, "vllm:kv_offload_cpu_pool_evictions_total", "start", "before")
        >= 4
    )
    assert delta(served, "vllm:kv_offload_cpu_pool_evictions_total") > 0


def test_nothing_leaked(served):
    before, after = served["usage_before"], served["usage_after"]
    assert after["threads"] <= before["threads"] + THREAD_SLACK, (before, after)
    assert after["fds"] <= before["fds"] + FD_SLACK, (before, after)
    assert served["temp_files"] == []
