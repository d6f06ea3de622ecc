"""Sizing for the examples, before an engine starts: the CPU pool, the device
KV cache and whether both fit in host memory.

The engine checks the pool itself when its worker allocates it (minutes into
start-up on a large model). This module does the same arithmetic from the
model's ``config.json`` in the first second, so that a configuration that
cannot fit fails at once with the setting to change.

Used by ``offline_inference_kv_offload.py`` and ``serve_kv_offload.sh``::

    python examples/kv_offload_sizing.py --model PATH [--num-cpu-blocks N|auto]
        [--cpu-bytes B] [--kv-cache-bytes B] [--max-model-len N]

prints the ``kv_connector_extra_config`` and the engine arguments as one JSON
object, or exits 2 with one line naming what to set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# The worker's host-memory guard: its arithmetic, applied here ahead of time.
from vllm_ascend.kv_offload import host_guard, host_ledger
from vllm_ascend.kv_offload.host_guard import AUTO_POOL_SHARE, show, size_flag

# The user guide's offloading configuration, key for key.
from vllm_ascend.kv_offload.testing.engine import GUIDE_EXTRA_CONFIG

# What the engine's processes (API process, engine core, worker: torch, the
# tokenizer, activations) take besides the weights, the KV cache and the pool;
# measured about 1.3 GiB on vLLM 0.32's CPU backend with the generated model.
ENGINE_OVERHEAD_BYTES = 2 * 2**30
# Device KV cache on vLLM's CPU backend when none is given: room for this many
# sequences of max_model_len tokens (vLLM needs one), at least the minimum.
KV_CACHE_SEQUENCES = 2
KV_CACHE_MIN_BYTES = 256 * 2**20
# ... and for a model named by its hub id, whose config is not read here.
KV_CACHE_UNKNOWN_MODEL_BYTES = 4 * 2**30


def looks_like_cpu_backend() -> bool:
    """Whether vLLM will run on its CPU backend (the KV cache is then host
    memory), guessed without importing torch: no torch_npu, no NVIDIA device."""
    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        return False
    return not Path("/dev/nvidiactl").exists()


@dataclass(frozen=True)
class ModelKV:
    """What the model's config.json says about its KV cache and weights."""

    kv_bytes_per_token: int  # all layers, K and V (or MLA's latent + rope)
    cpu_block_bytes: int  # the pool's row: page-aligned (cpu_bytes_to_use's unit)
    weights_bytes: int
    max_position_embeddings: int  # vLLM's default max_model_len


def read_model(path: str, block_size: int) -> ModelKV | None:
    """The KV shape of a local model directory and its CPU block of
    ``block_size`` tokens, by the package's sizing (vLLM's ModelConfig of its
    config.json); None for a hub name (its config is not read before the
    engine fetches it) or a model it cannot size."""
    if not Path(path, "config.json").is_file():
        return None
    from vllm_ascend.kv_offload.sizing import (
        SizingError,
        UnsupportedModelError,
        size_model_dir,
    )

    try:
        kv = size_model_dir(path, block_size=block_size)
    except UnsupportedModelError as e:
        print(f"[sizing] cannot size this model: {e}", file=sys.stderr)
        return None
    except SizingError as e:
        raise SystemExit(f"{path}: {e}") from None
    weights = sum(
        f.stat().st_size
        for pattern in ("*.safetensors", "*.bin", "*.pt")
        for f in Path(path).glob(pattern)
    )
    return ModelKV(
        kv_bytes_per_token=kv.kv_bytes_per_token,
        cpu_block_bytes=kv.bytes_per_cpu_block,
        weights_bytes=weights,
        max_position_embeddings=kv.max_model_len,
    )


@dataclass
class Plan:
    """The overrides of the guide's configuration, and what they cost."""

    extra_config: dict
    kv_cache_bytes: int | None  # None: the platform's own sizing
    max_model_len: int | None
    overrides: list[str]
    pool_bytes: int | None
    engine_bytes: int | None  # weights + host KV cache + processes
    available: int


def plan(
    model: str,
    *,
    num_cpu_blocks: str | None = None,
    cpu_bytes: int | None = None,
    kv_cache_bytes: int | None = None,
    max_model_len: int | None = None,
    kv_cache_in_host: bool = True,
    generated: bool = False,
) -> Plan:
    """Sizes the guide's configuration for ``model``; raises SystemExit with
    one line when it cannot fit in the host memory available now.

    ``kv_cache_in_host``: the device KV cache is host memory (vLLM's CPU
    backend); then it is sized here when not given, since that backend
    otherwise takes half of the host's memory.
    """
    extra = dict(GUIDE_EXTRA_CONFIG)
    overrides: list[str] = []
    kv = read_model(model, extra["block_size"])
    available = host_guard.host_available_bytes()
    try:
        cap = host_guard.budget_cap()
        others = host_ledger.live_pools()  # other engines' pools on this host
    except ValueError as e:
        raise SystemExit(str(e)) from None
    block_bytes = kv.cpu_block_bytes if kv else None

    if kv is not None and max_model_len is None and not generated:
        # vLLM would take the model's own (40 960 for Qwen3) and need a KV
        # cache of that many tokens just to start.
        if kv.max_position_embeddings > 8192:
            max_model_len = 8192
    if max_model_len is not None:
        overrides.append(f"max_model_len={max_model_len}")
    env_kv = os.environ.get(host_guard.CPU_KV_CACHE_ENV)
    counted_kv = None  # sized by the environment: counted, not overridden
    if kv_cache_bytes is None and kv_cache_in_host and env_kv:
        counted_kv = int(env_kv) * 2**30
    elif kv_cache_bytes is None and kv_cache_in_host:
        if kv is None:  # a hub name: its shape is not known yet
            kv_cache_bytes = KV_CACHE_UNKNOWN_MODEL_BYTES
        else:
            tokens = max_model_len or kv.max_position_embeddings
            need = KV_CACHE_SEQUENCES * tokens * kv.kv_bytes_per_token
            kv_cache_bytes = max(KV_CACHE_MIN_BYTES, math.ceil(need / 2**20) * 2**20)
    if kv_cache_bytes is not None:
        overrides.append(
            f"kv_cache_memory_bytes={kv_cache_bytes} ({show(kv_cache_bytes)})"
        )

    engine_bytes = budget = None
    beside = ""  # what the refusals say of the host's other pools
    if kv is not None:
        engine_bytes = kv.weights_bytes + ENGINE_OVERHEAD_BYTES
        if kv_cache_in_host:
            engine_bytes += kv_cache_bytes or counted_kv or 0
        # The worker's budget: the host's other pools count as they will then.
        budget = host_guard.HostBudget(available, others, cap, engine_bytes)
        if n := len(others):
            beside = (
                f"; {n} other CPU pool{'s' if n > 1 else ''} of this host "
                f"({show(budget.others_bytes)}) count{'' if n > 1 else 's'} "
                "against that"
            )

    if cpu_bytes is not None:
        if num_cpu_blocks is not None:
            raise SystemExit(
                "--num-cpu-blocks and --cpu-bytes both size the CPU pool: give one"
            )
        del extra["num_cpu_blocks"]
        extra["cpu_bytes_to_use"] = cpu_bytes
        overrides.append(f"cpu_bytes_to_use={cpu_bytes} ({show(cpu_bytes)})")
    elif num_cpu_blocks == "auto":
        if block_bytes is None or budget is None:
            raise SystemExit(
                f"--num-cpu-blocks auto needs a local model directory with a "
                f"config.json ({model!r} has none): pass --num-cpu-blocks N"
            )
        blocks = host_guard.auto_num_cpu_blocks(block_bytes, budget)
        if blocks < 1:
            raise SystemExit(
                f"--num-cpu-blocks auto: no CPU block ({show(block_bytes)}) fits "
                f"next to the engine ({show(engine_bytes)}) in the "
                f"{show(available)} of host memory available{beside}; free "
                "memory or pass a smaller --kv-cache-bytes"
            )
        extra["num_cpu_blocks"] = blocks
        overrides.append(f"num_cpu_blocks={blocks} (auto)")
    elif num_cpu_blocks is not None:
        try:
            extra["num_cpu_blocks"] = int(num_cpu_blocks)
        except ValueError:
            raise SystemExit(
                f"--num-cpu-blocks {num_cpu_blocks!r}: give a number of blocks or auto"
            ) from None
        if extra["num_cpu_blocks"] != GUIDE_EXTRA_CONFIG["num_cpu_blocks"]:
            overrides.append(f"num_cpu_blocks={extra['num_cpu_blocks']}")

    pool_bytes = None
    if block_bytes is not None:
        pool_bytes = extra.get("cpu_bytes_to_use") or (
            extra["num_cpu_blocks"] * block_bytes
        )
    if pool_bytes is not None and budget is not None:
        # The worker's guard: the pools within 90 % of what the engine leaves.
        if pool_bytes > budget.room():
            fit = host_guard.auto_num_cpu_blocks(block_bytes, budget)
            what = (
                f"cpu_bytes_to_use={extra['cpu_bytes_to_use']}"
                if "cpu_bytes_to_use" in extra
                else f"num_cpu_blocks={extra['num_cpu_blocks']} x {show(block_bytes)}"
            )
            hint = (
                f"pass --num-cpu-blocks {fit} (or auto)"
                if fit >= 1
                else "free host memory or pass a smaller --kv-cache-bytes"
            )
            raise SystemExit(
                f"does not fit: the CPU pool ({what} = {show(pool_bytes)}) and the "
                f"engine ({show(engine_bytes)}: weights, "
                + ("KV cache, " if kv_cache_in_host else "")
                + f"processes) need {show(pool_bytes + engine_bytes)}: the pool "
                f"may take {host_guard.MAX_HOST_MEMORY_FRACTION:.0%} of what the "
                f"engine leaves of the {show(available)} of host memory available"
                + (
                    f", at most {host_guard.HOST_BUDGET_ENV}={show(cap)}"
                    if budget.cap_binds
                    else ""
                )
                + f"{beside}; {hint}"
            )
    return Plan(
        extra_config=extra,
        kv_cache_bytes=kv_cache_bytes,
        max_model_len=max_model_len,
        overrides=overrides,
        pool_bytes=pool_bytes,
        engine_bytes=engine_bytes,
        available=available,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sizing flags, shared by the examples."""
    parser.add_argument(
        "--num-cpu-blocks",
        default=None,
        metavar="N|auto",
        # argparse %-formats help texts: a literal percent sign is "%%".
        help="CPU blocks in the pool (the guide's 1000 when unset); auto: "
        f"{AUTO_POOL_SHARE * 100:.0f}%% of the host memory left next to the engine",
    )
    parser.add_argument(
        "--cpu-bytes",
        type=size_flag,
        default=None,
        metavar="BYTES",
        help="size the CPU pool in bytes instead (cpu_bytes_to_use), e.g. 4GiB",
    )
    parser.add_argument(
        "--kv-cache-bytes",
        type=size_flag,
        default=None,
        metavar="BYTES",
        help="device KV-cache size (kv_cache_memory_bytes), e.g. 1GiB; default "
        "on vLLM's CPU backend: room for 2 sequences of max_model_len tokens "
        "(at least 256 MiB), elsewhere the guide's gpu_memory_utilization=0.5",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: the model's, at most 8192 for a real model",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--kv-cache-on-device",
        action="store_true",
        help="the KV cache is accelerator memory (not vLLM's CPU backend)",
    )
    add_arguments(parser)
    args = parser.parse_args()
    try:
        p = plan(
            args.model,
            num_cpu_blocks=args.num_cpu_blocks,
            cpu_bytes=args.cpu_bytes,
            kv_cache_bytes=args.kv_cache_bytes,
            max_model_len=args.max_model_len,
            kv_cache_in_host=not args.kv_cache_on_device,
        )
    except SystemExit as e:
        print(f"[sizing] {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(
        json.dumps(
            {
                "kv_connector_extra_config": p.extra_config,
                "kv_cache_memory_bytes": p.kv_cache_bytes,
                "max_model_len": p.max_model_len,
                "overrides": p.overrides,
            }
        )
    )


if __name__ == "__main__":
    main()
