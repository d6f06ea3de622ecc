"""Upstream vllm-ascend 0.30.0rc2's CI test of this feature, written here.

Upstream's ``tests/e2e/pull_request/one_card/test_cpu_offloading.py`` (an A2
runner, Qwen3-0.6B) runs two scenarios on one engine per offloading spec,
parametrised over its CPU-only spec and its tiering spec (an fs tier under
``tmp_path``), with vLLM's ZeroMQ KV events on:

* **latency rounds**: per round a long prompt cold, again (a device prefix-
  cache hit), ``reset_prefix_cache()``, then again (a CPU hit); CPU
  ``BlockStored`` events arrive every round; the CPU hit is faster than the
  cold run in >= 80 % of the rounds;
* **accuracy after reload**: a prompt of one full offload chunk + 1 token;
  its greedy 5-token output after ``reset_prefix_cache()`` (its chunk loaded
  back from the CPU) equals the cold one.

Here the same scenarios and assertions run against this repo's specs with
the guide's config (``NPUOffloadingSpec``) and ``NPUTieringOffloadingSpec``
with an fs tier under ``tmp_path``, on vLLM 0.32's CPU backend with
a generated model (``ENGINE``: fp32, eager). Nothing here ran on an NPU.

Scaled from upstream, and why (a 2-core CI machine, engines on CPU):

* the prompt: 10,001 tokens -> ``PROMPT_TOKENS`` (the engine's
  ``max_model_len`` is 2,048; upstream's prompt is 78 full 128-token chunks
  + 17 tokens, this one 15 + 1: enough that a cold prefill costs clearly
  more than loading its chunks back);
* the model: Qwen3-0.6B (no hub here) -> a generated 4-layer Qwen3 of about
  3 M parameters (``MODEL_SPEC``);
* the CPU pool: 1 GiB (``cpu_bytes_to_use``) -> the guide's
  ``num_cpu_blocks: 1000`` for the CPU-only spec, conftest's 64 blocks for
  the tiering spec (each holds one round's 15 chunks);
* the rounds: 10 (kept: the >= 80 % rule needs 8 of them).

Differences, each on purpose:

* upstream's tokenizer turns "Let's count to 10. One, two, three, four,"
  into real ids; the tiny model's word-level tokenizer knows none of those
  words (all would be ``<unk>`` = 0, the padding id, so the prompt would be
  all zeros and its chunk round 0's first block), so its text is a sentence
  of the tiny vocabulary;
* upstream checks the >= 80 % rule for its CPU-only spec only: its tiering
  spec's mmap cannot be pinned on Ascend. This repo's tiering spec registers
  its region with ACL as page-locked memory (``region.py``),
  and on the CPU backend nothing is pinned for either spec, so the rule is
  checked for both;
* upstream forces ``VLLM_USE_V2_MODEL_RUNNER=1`` (its V1 runner reloaded the
  0.6B prompt slower than a cold prefill on the NPU); here that stops the
  engine at start ("Model Runner V2 requires Triton", and this CPU backend
  has no Triton), so vLLM's V1 CPU runner runs;
* added: the CPU hits are checked to be CPU hits (the prompt's full chunks
  counted as cached after the reset), so that no run passes on timing
  alone. Negative control (one run, ``NPUOffloadingSpec``, 2-core VM at
  load 9.5): with the pool emptied at each reset (``reset_connector=True``)
  the "CPU hit" is a recompute, faster than cold in 5 of 10 rounds (the
  rule needs 8), and the cached-token checks fail in every round. With the
  2-layer tiny model that control was faster in 7 of 10, so this test's
  model is larger (``MODEL_SPEC``).

The engines run in-process, one after the other in one process
(``run_scenario``'s driver hook, ``drive`` below); the subscriber runs next
to each there, as upstream's does next to its ``LLM``.
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import (
    GUIDE_OFFLOAD,
    in_process,
    run_sequence,
    tiering,
    zmq_events,
)
from vllm_ascend.kv_offload.testing.server import free_port
from vllm_ascend.kv_offload.testing.tiny_model import (
    DEFAULT_DIR,
    TinyModelSpec,
    ensure_tiny_model,
    make_prompt,
)

pytestmark = pytest.mark.e2e

PROMPT_TOKENS = 1921  # upstream: 10,001 (see the module docstring)
ROUNDS = 10  # upstream: 10
CPU_FASTER_SHARE = 0.8  # upstream: CPU hit faster than cold in >= 80 % of rounds
ACCURACY_MAX_TOKENS = 5  # upstream: 5
CHUNK_TOKENS = 128  # the guide's block_size (upstream's too)
TOPIC = "test"  # upstream's

# Upstream's Qwen3-0.6B scaled down to a generated 4-layer Qwen3 of about
# 3 M parameters: a cold prefill of the prompt costs several times a reload
# (the >= 80 % rule then tells one from the other), and 10 rounds on two
# engines stay within seconds. The tiny model's prefill (2 layers of 64) is
# mostly engine overhead, about as fast as a reload.
MODEL_SPEC = TinyModelSpec(
    hidden_size=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=768,
    initializer_range=0.1,
)


def model() -> str:
    return ensure_tiny_model(DEFAULT_DIR.parent / "upstream-ci-qwen3", MODEL_SPEC)


def cpu_stored_events(sock, decode) -> list:
    """Upstream's ``MockSubscriber.get_new_cpu_stored_events``: the CPU
    ``BlockStored`` events published since the last call, waiting up to 1 s
    for a message, then 100 ms once a CPU store came."""
    from vllm.distributed.kv_events import BlockStored

    events: list = []
    timeout_ms = 1000
    while sock.poll(timeout_ms):
        msg = decode(sock.recv_multipart())
        assert msg.topic == TOPIC
        for event in msg.batch.events:
            if isinstance(event, BlockStored) and event.medium == "CPU":
                events.append(event)
                timeout_ms = 100
    return events


def _stored_blocks(events: list) -> int:
    return sum(len(event.block_hashes) for event in events)


def _timed(llm, prompt_token_ids: list[int], params) -> tuple[float, object]:
    from vllm import TokensPrompt

    start = time.perf_counter()
    (out,) = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt_token_ids)], params, use_tqdm=False
    )
    return time.perf_counter() - start, out


def latency_rounds(llm, events) -> list[dict]:
    """Upstream's ``_latency_test``, recording what it asserts on."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1)
    prompt = [0] * PROMPT_TOKENS
    rounds = []
    for i in range(ROUNDS):
        prompt[0] = i
        cold_s, cold = _timed(llm, prompt, params)
        device_s, device = _timed(llm, prompt, params)
        reset = llm.reset_prefix_cache()
        stored = _stored_blocks(events())
        cpu_s, cpu = _timed(llm, prompt, params)
        rounds.append(
            {
                "cold_s": cold_s,
                "device_hit_s": device_s,
                "cpu_hit_s": cpu_s,
                "cold_cached": cold.num_cached_tokens or 0,
                "device_hit_cached": device.num_cached_tokens or 0,
                "cpu_hit_cached": cpu.num_cached_tokens or 0,
                "reset": reset,
                "cpu_stored_blocks": stored,
            }
        )
    return rounds


def accuracy_after_reload(llm, events, chunk_tokens: int) -> dict:
    """Upstream's ``_accuracy_test``: one full chunk + 1 token, greedy."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=ACCURACY_MAX_TOKENS, temperature=0)
    events()
    text_ids = llm.get_tokenizer().encode(make_prompt(9, seed=24))
    # vLLM computes the last prompt token itself, so a prompt of one chunk
    # + 1 token is served from the CPU for its whole first chunk.
    padding = (1 - len(text_ids)) % chunk_tokens
    prompt = [0] * padding + list(text_ids)
    _, cold = _timed(llm, prompt, params)
    stored = _stored_blocks(events())
    reset = llm.reset_prefix_cache()
    _, reload = _timed(llm, prompt, params)
    return {
        "prompt_tokens": len(cold.prompt_token_ids),
        "cold_token_ids": list(cold.outputs[0].token_ids),
        "cpu_stored_blocks": stored,
        "reset": reset,
        "reload_token_ids": list(reload.outputs[0].token_ids),
        "reload_cached": reload.num_cached_tokens or 0,
    }


def drive(scenario: dict) -> dict:
    """The engine side (run by ``run_scenario`` in its own process)."""
    import zmq
    from vllm.config import KVEventsConfig

    from examples import kv_events_subscriber as subscriber
    from tests.e2e.run_scenario import kv_transfer_config
    from vllm_ascend.kv_offload.testing import engine

    port = scenario["port"]
    llm = engine.start(
        scenario["model"],
        kv_transfer_config(scenario),
        kv_events_config=KVEventsConfig(**zmq_events(port, TOPIC)),
        **scenario["engine"],
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    sock.connect(f"tcp://127.0.0.1:{port}")
    dec = subscriber.decoder()

    def events() -> list:
        return cpu_stored_events(sock, lambda f: subscriber.decode_message(f, dec))

    try:
        extra = llm.llm_engine.vllm_config.kv_transfer_config.kv_connector_extra_config
        return {
            "rounds": latency_rounds(llm, events),
            "accuracy": accuracy_after_reload(llm, events, extra["block_size"]),
        }
    finally:
        sock.close(linger=0)
        ctx.term()
        engine.shutdown(llm)


SPECS = ["NPUOffloadingSpec", "NPUTieringOffloadingSpec"]


@pytest.fixture(scope="module")
def runs(scenario_dir, tmp_path_factory) -> dict[str, dict]:
    """One engine per spec (both scenarios run on it, in upstream's order),
    in-process, one after the other in one process."""
    offloads = {
        "NPUOffloadingSpec": GUIDE_OFFLOAD,
        "NPUTieringOffloadingSpec": tiering(
            str(tmp_path_factory.mktemp("native_kv_offload"))
        ),
    }
    scenarios = {
        spec: in_process(
            {
                "driver": "tests.e2e.test_upstream_ci_scenario:drive",
                "model": model(),
                "offload": offloads[spec],
                "port": free_port(),
            }
        )
        for spec in SPECS
    }
    return run_sequence(scenario_dir, "upstream_ci", scenarios)


@pytest.fixture(params=SPECS)
def upstream_run(request, runs) -> dict:
    result = runs[request.param]
    acc = result["accuracy"]
    print(
        f"\n{request.param}: {summary(result['rounds'])}\n"
        f"accuracy: cold {acc['cold_token_ids']}, after the reload "
        f"{acc['reload_token_ids']} ({acc['reload_cached']} tokens cached)"
    )
    return result


def full_chunk_tokens(prompt_tokens: int) -> int:
    """Prompt tokens a cache can serve: its full chunks, never the last token."""
    return (prompt_tokens - 1) // CHUNK_TOKENS * CHUNK_TOKENS


def summary(rounds: list[dict]) -> str:
    faster = sum(r["cpu_hit_s"] < r["cold_s"] for r in rounds)
    ms = {
        k: 1000 * sum(r[k] for r in rounds) / len(rounds)
        for k in ("cold_s", "device_hit_s", "cpu_hit_s")
    }
    return (
        f"CPU hit faster than cold in {faster}/{len(rounds)} rounds; mean cold "
        f"{ms['cold_s']:.1f} ms, device hit {ms['device_hit_s']:.1f} ms, CPU hit "
        f"{ms['cpu_hit_s']:.1f} ms; per round cold/CPU hit (ms): "
        + ", ".join(
            f"{1000 * r['cold_s']:.0f}/{1000 * r['cpu_hit_s']:.0f}" for r in rounds
        )
        + "; CPU blocks stored per round: "
        + ", ".join(str(r["cpu_stored_blocks"]) for r in rounds)
        + "; CPU hit's cached tokens per round: "
        + ", ".join(str(r["cpu_hit_cached"]) for r in rounds)
    )


def test_latency_rounds_cold_device_hit_reset_cpu_hit(upstream_run):
    rounds = upstream_run["rounds"]
    assert len(rounds) == ROUNDS
    served = full_chunk_tokens(PROMPT_TOKENS)
    for i, r in enumerate(rounds):
        assert r["cold_cached"] == 0, (i, r)
        assert r["device_hit_cached"] == served, (i, r)
        assert r["reset"], (i, r)
        # Upstream: CPU BlockStored events every round.
        assert r["cpu_stored_blocks"] > 0, (i, r)
        # Added: after the reset the prompt's full chunks came from the CPU.
        assert r["cpu_hit_cached"] == served, (i, r)
    # Upstream: the CPU hit is faster than cold in >= 80 % of the rounds.
    faster = sum(r["cpu_hit_s"] < r["cold_s"] for r in rounds)
    assert faster >= CPU_FASTER_SHARE * ROUNDS, summary(rounds)


def test_greedy_output_after_a_reload_equals_the_cold_one(upstream_run):
    acc = upstream_run["accuracy"]
    assert acc["prompt_tokens"] % CHUNK_TOKENS == 1
    assert acc["cpu_stored_blocks"] > 0
    assert acc["reset"]
    # Added: the reload was one: its full chunk came from the CPU.
    assert acc["reload_cached"] == CHUNK_TOKENS
    assert len(acc["cold_token_ids"]) == ACCURACY_MAX_TOKENS
    assert acc["reload_token_ids"] == acc["cold_token_ids"]
