"""KV-cache CPU offloading with the Python API (the user guide's example).

The ``kv_transfer_config`` is the guide's, key for key. By default the model
is a tiny Qwen3 generated locally (no model hub needed) and vLLM runs on
whatever platform it finds: an Ascend NPU with vllm-ascend, a GPU, or its CPU
backend. Point ``--model`` at a real checkpoint (e.g. ``Qwen/Qwen3-0.6B`` or a
local path) to run it for real.

After the guide's ``Hello, my name is`` request, the example sends a long
prompt, drops the device prefix cache (``llm.reset_prefix_cache()``) so the
only copy of its KV is in the CPU pool, and sends it again: the second run's
prompt tokens are loaded from the CPU instead of recomputed. It prints the
offloading counters and the time to first token of both runs.
"""

from __future__ import annotations

import argparse
import time

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig


def offload_counters(llm: LLM) -> dict[str, float]:
    """Bytes stored to and loaded from the CPU so far (vLLM's counters)."""
    wanted = {
        "vllm:kv_offload_store_bytes": "stored_bytes",
        "vllm:kv_offload_load_bytes": "loaded_bytes",
    }
    totals = dict.fromkeys(wanted.values(), 0.0)
    for metric in llm.get_metrics():
        name = wanted.get(metric.name)
        if name is not None and hasattr(metric, "value"):
            totals[name] += metric.value
    return totals


def time_to_first_token(llm: LLM, prompt: str) -> tuple[float, int]:
    """Seconds to the first token of ``prompt`` alone, and its cached tokens."""
    start = time.perf_counter()
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    return time.perf_counter() - start, out.num_cached_tokens or 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=None,
        help="model name or path (default: a generated tiny Qwen3)",
    )
    parser.add_argument(
        "--prompt-words",
        type=int,
        default=1024,
        help="length of the long prompt used for the CPU-hit demonstration",
    )
    args = parser.parse_args()

    model = args.model
    long_prompt = "Hello, my name is " * (args.prompt_words // 4)
    if model is None:
        from vllm_ascend.kv_offload.testing.tiny_model import (
            ensure_tiny_model,
            make_prompt,
        )

        model = ensure_tiny_model()
        long_prompt = make_prompt(args.prompt_words, seed=1)

    # The guide's configuration, unchanged.
    kv_transfer_config = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "num_cpu_blocks": 1000,
            "block_size": 128,
            "spec_name": "NPUOffloadingSpec",
            "spec_module_path": "vllm_ascend.kv_offload.npu",
        },
    )

    llm = LLM(
        model=model,
        gpu_memory_utilization=0.5,
        kv_transfer_config=kv_transfer_config,
        # Keeps the metrics that the summary below reads.
        disable_log_stats=False,
    )

    sampling_params = SamplingParams(max_tokens=100, temperature=0.0)
    outputs = llm.generate(["Hello, my name is"], sampling_params)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}")
        print(f"Generated: {output.outputs[0].text!r}")

    # Cold: the long prompt is computed, and its full blocks are offloaded.
    cold_s, _ = time_to_first_token(llm, long_prompt)
    # Offloading completes asynchronously; a short request lets it land.
    llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0.0))
    before = offload_counters(llm)
    # Drop the device prefix cache: only the CPU pool still holds the prefix.
    llm.reset_prefix_cache()
    hit_s, cpu_tokens = time_to_first_token(llm, long_prompt)
    after = offload_counters(llm)

    print("\n--- KV-cache CPU offloading ---")
    print(f"stored to CPU:    {after['stored_bytes'] / 2**20:9.2f} MiB")
    print(
        f"loaded from CPU:  {after['loaded_bytes'] / 2**20:9.2f} MiB "
        f"({after['loaded_bytes'] - before['loaded_bytes']:.0f} bytes for the "
        "CPU-hit run)"
    )
    print(f"prompt tokens served from the CPU cache: {cpu_tokens}")
    print(f"time to first token, cold (computed):   {cold_s * 1e3:8.1f} ms")
    print(f"time to first token, CPU hit (loaded):  {hit_s * 1e3:8.1f} ms")
    if cpu_tokens == 0:
        raise SystemExit("expected the repeated prompt to be served from the CPU")


if __name__ == "__main__":
    main()
