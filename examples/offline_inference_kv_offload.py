"""KV-cache CPU offloading with the Python API (the user guide's example).

The ``kv_transfer_config`` is the guide's; what this example changes is
printed at start (the flags below, and on vLLM's CPU backend a device KV
cache sized for the model instead of half the host's memory). By default the
model is a small Qwen3 generated locally (no model hub needed; written once,
in seconds) and vLLM runs on whatever platform it finds: an Ascend NPU with
vllm-ascend, a GPU, or its CPU backend. Point ``--model`` at a real
checkpoint (a local path or a hub name) to run it for real.

After the guide's ``Hello, my name is`` request, each round sends a long
prompt three times: cold (computed), again (served by the device prefix
cache), and, after ``llm.reset_prefix_cache()`` has dropped the device copy,
once more: its KV then comes back from the CPU pool instead of being
recomputed. It prints the offloading counters and the median time to first
token of the three cases.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_offload_sizing as sizing  # noqa: E402 (the examples' own module)

# Starts the engine, times requests, shuts it down (shared with the tests).
from vllm_ascend.kv_offload.testing import engine  # noqa: E402


def offload_counters() -> dict[str, float]:
    """Bytes stored to and loaded from the CPU so far (vLLM's counters)."""
    totals = engine.counters()
    return {
        "stored_bytes": totals.get("vllm:kv_offload_store_bytes", 0.0),
        "loaded_bytes": totals.get("vllm:kv_offload_load_bytes", 0.0),
    }


def time_to_first_token(
    llm, prompt: str, loads: dict[str, float] | None = None, kind: str = ""
) -> tuple[float, int, int]:
    """Seconds to the first token of ``prompt`` alone (vLLM's request
    metrics), its cached tokens and its length in tokens; the bytes it loaded
    from the CPU are added to ``loads[kind]``."""
    before = offload_counters()["loaded_bytes"]
    out = engine.generate(llm, prompt, max_tokens=1)
    if loads is not None:
        loads[kind] += offload_counters()["loaded_bytes"] - before
    return engine.ttft_s(out), out.num_cached_tokens or 0, len(out.prompt_token_ids)


def print_completions(outputs, generated: bool) -> None:
    """The guide's ``Prompt:`` / ``Generated:`` lines; for the generated
    model, what its text means (nothing)."""
    for output in outputs:
        print(f"Prompt: {output.prompt!r}")
        print(f"Generated: {output.outputs[0].text!r}")
    if generated:
        print(
            "[example] the generated model has random weights, so its text is "
            "meaningless; what this example shows is the time to first token "
            "printed at the end (cold, device hit, CPU hit)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default=None,
        help="model name or path (default: the generated Qwen3 of "
        "vllm_ascend.kv_offload.testing.tiny_model --preset demo)",
    )
    parser.add_argument(
        "--prompt-words",
        type=int,
        default=1536,
        help="length of the long prompt (words; tokens for the generated model)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="prompts measured cold / device hit / CPU hit (medians printed)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="on vLLM's CPU backend, keep torch.compile (the example runs "
        "eager there: compiling takes minutes on a small machine)",
    )
    sizing.add_arguments(parser)
    args = parser.parse_args()
    # vLLM forks its engine processes: a line still in the buffer then would
    # be printed again by the child.
    sys.stdout.reconfigure(line_buffering=True)

    generated = args.model is None
    if generated:
        from vllm_ascend.kv_offload.testing.tiny_model import (
            ensure_demo_model,
            make_prompt,
        )

        start = time.perf_counter()
        model = ensure_demo_model()
        print(f"[example] model: {model} ({time.perf_counter() - start:.1f} s)")

        def long_prompt(seed: int) -> str:
            return make_prompt(args.prompt_words, seed=seed)
    else:
        model = args.model

        def long_prompt(seed: int) -> str:
            return f"Document {seed}. " + "Hello, my name is " * (
                args.prompt_words // 4
            )

    # Time for the engine's worker to exit on its own: longer than vLLM's 5 s
    # on a busy machine (interpreter finalization, see testing/engine.py).
    os.environ.setdefault(
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", engine.WORKER_SHUTDOWN_TIMEOUT_S
    )

    def sized(kv_cache_in_host: bool):
        try:
            return sizing.plan(
                model,
                num_cpu_blocks=args.num_cpu_blocks,
                cpu_bytes=args.cpu_bytes,
                kv_cache_bytes=args.kv_cache_bytes,
                max_model_len=args.max_model_len,
                kv_cache_in_host=kv_cache_in_host,
                generated=generated,
            )
        except SystemExit as e:
            raise SystemExit(f"[example] {e}") from None

    # Sized, and checked against host memory, before vLLM is even imported
    # (tens of seconds on a busy machine), on a guess of the platform that
    # is checked once it is.
    guess_cpu = sizing.looks_like_cpu_backend()
    plan = sized(guess_cpu)
    from vllm.platforms import current_platform

    if current_platform.is_cpu() != guess_cpu:
        plan = sized(current_platform.is_cpu())
    # torch.compile's warm-up takes minutes on 2 cores; eager mode with an
    # explicit KV-cache size also skips vLLM's profiling run.
    eager = current_platform.is_cpu() and not args.compile
    if eager:
        plan.overrides.append("enforce_eager=True")
    print(
        "[example] the guide's configuration"
        + (f", overridden: {', '.join(plan.overrides)}" if plan.overrides else "")
    )
    if plan.pool_bytes is not None:
        print(
            f"[example] host memory: CPU pool {sizing.show(plan.pool_bytes)}, "
            f"engine ~{sizing.show(plan.engine_bytes)}, "
            f"{sizing.show(plan.available)} available"
        )

    from vllm import SamplingParams

    # KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
    # kv_connector_extra_config=...): the guide's, with the plan's overrides.
    kv_transfer_config = engine.transfer_config(plan.extra_config)
    engine_args = {"enforce_eager": True} if eager else {}
    if plan.kv_cache_bytes is not None:
        engine_args["kv_cache_memory_bytes"] = plan.kv_cache_bytes
    if plan.max_model_len is not None:
        engine_args["max_model_len"] = plan.max_model_len

    start = time.perf_counter()
    # LLM(model=..., kv_transfer_config=..., disable_log_stats=False, ...):
    # the statistics kept are where the times and counters below come from.
    llm = engine.start(
        model, kv_transfer_config, gpu_memory_utilization=0.5, **engine_args
    )
    engine_start_s = time.perf_counter() - start
    try:
        sampling_params = SamplingParams(max_tokens=100, temperature=0.0)
        outputs = llm.generate(["Hello, my name is"], sampling_params)
        print_completions(outputs, generated)

        # Warm-up: the first long prompt pays one-time costs (buffers of the
        # new shapes) that are neither computing nor loading.
        time_to_first_token(llm, long_prompt(0))
        cold, device, cpu = [], [], []
        # Bytes loaded from the CPU by each kind of request, summed over rounds.
        loads = {"device": 0.0, "cpu": 0.0}
        cpu_tokens = prompt_tokens = 0
        for r in range(1, args.rounds + 1):
            prompt = long_prompt(r)
            # Cold: computed; its full blocks are offloaded in the background.
            seconds, _, prompt_tokens = time_to_first_token(llm, prompt)
            cold.append(seconds)
            # Device hit: the prefix is still in the device cache.
            device.append(time_to_first_token(llm, prompt, loads, "device")[0])
            # Drop the device prefix cache: only the CPU pool holds the prefix.
            engine.reset_prefix_cache(llm)
            seconds, cpu_tokens, _ = time_to_first_token(llm, prompt, loads, "cpu")
            cpu.append(seconds)
        counters = offload_counters()
    finally:
        engine.shutdown(llm)
        del llm
        gc.collect()

    cold_s, device_s, cpu_s = (statistics.median(x) for x in (cold, device, cpu))
    print("\n--- KV-cache CPU offloading ---")
    print(f"engine start: {engine_start_s:.1f} s")
    print(f"stored to CPU:   {counters['stored_bytes'] / 2**20:9.2f} MiB")
    print(
        f"loaded from CPU: {counters['loaded_bytes'] / 2**20:9.2f} MiB "
        f"({loads['cpu'] / args.rounds / 2**20:.2f} MiB per CPU hit)"
    )
    if loads["device"]:
        # vLLM's device prefix cache matches at most the prompt less one
        # token, so a full-block prompt's last block comes from the CPU pool.
        print(
            f"  of which device hits: {loads['device'] / args.rounds / 2**20:.2f} "
            "MiB each (the prompt's last block, which the device prefix cache "
            "does not match)"
        )
    print(f"long prompt: {prompt_tokens} tokens")
    print(f"prompt tokens served from the CPU cache: {cpu_tokens}")
    print(f"time to first token (median of {args.rounds}):")
    print(f"  cold (computed):               {cold_s * 1e3:8.1f} ms")
    print(f"  device hit (prefix cache):     {device_s * 1e3:8.1f} ms")
    print(f"  CPU hit (loaded from the pool):{cpu_s * 1e3:8.1f} ms")
    print(
        f"A CPU hit is what offloading adds: once the device cache has dropped "
        f"the prefix, loading it back took {cold_s / cpu_s:.1f}x less time than "
        f"recomputing it ({cpu_s / device_s:.2f}x a device hit)."
    )
    if cpu_tokens == 0:
        raise SystemExit("expected the repeated prompt to be served from the CPU")


if __name__ == "__main__":
    main()
