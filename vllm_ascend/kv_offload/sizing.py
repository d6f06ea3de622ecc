"""How big one CPU block is for a model, and how many fit in host memory.

Reads a local Hugging Face model directory's ``config.json`` only (no
weights, no tokenizer, no vLLM engine, no vLLM import) and derives what
vLLM's KV-cache spec would give each attention layer:

* standard / grouped-query attention: per token and layer,
  ``2 (K and V) * kv_heads_per_rank * head_size * dtype_bytes``, with
  ``kv_heads_per_rank = max(1, total_kv_heads // tensor_parallel_size)``
  (vLLM's ``get_num_kv_heads``) and ``head_size = head_dim`` or
  ``hidden_size // num_attention_heads`` (``get_head_size``);
* MLA (DeepSeek-V2/V3 style, ``kv_lora_rank`` set): one latent of
  ``kv_lora_rank + qk_rope_head_dim`` per token and layer, the same on every
  tensor-parallel rank (vLLM's ``MLAAttentionSpec`` with one KV head), and
  stored once for all of them;
* hybrid models (``layer_types``, ``layers_block_type`` or
  ``full_attention_interval``): attention layers as above; the
  linear-attention / Mamba layers hold per-request state instead, and vLLM
  pads every layer's page to one size for such models, which is not
  reproduced here: the result is then a lower bound (``exact=False``).

A CPU block holds ``block_size`` tokens (the guide's key) of every offloaded
layer; its bytes over all tensor-parallel workers (one copy for MLA under
tensor parallelism, which the workers of a host share: ``replication``),
rounded up to the page size, is the unit of ``cpu_bytes_to_use``
(``config.cpu_block_bytes``). Every
size read is validated first (``config_sizes``: a positive integer within a
bound, or ``SizingError`` naming the key and value); a config missing a key
is refused naming it, one of a layout not covered with
``UnsupportedModelError``.

``fit_host_memory`` (``host_fit``, re-exported here) then applies the
worker's host-memory guard to give the largest ``num_cpu_blocks`` it would
accept, and the equivalent ``cpu_bytes_to_use``.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_ascend.kv_offload.config_sizes import (
    MAX_HEAD_SIZE,
    SizingError,
    UnsupportedModelError,
    check_layout,
    check_sizes,
    modelslim_kv_dtype,
)
from vllm_ascend.kv_offload.host_fit import HostFit, fit_host_memory
from vllm_ascend.kv_offload.host_guard import AUTO_POOL_SHARE, auto_num_cpu_blocks
from vllm_ascend.kv_offload.replication import predicts_replicated, stored_copies

__all__ = [
    "AUTO_POOL_SHARE",
    "HostFit",
    "KVSizing",
    "SizingError",
    "UnsupportedModelError",
    "auto_num_cpu_blocks",
    "fit_host_memory",
    "load_config",
    "size_kv",
    "size_model_dir",
]

# vLLM's CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT (mmap.PAGESIZE): a CPU block
# over all workers is padded to it.
CPU_BLOCK_ALIGNMENT = mmap.PAGESIZE

# Bytes per element of the KV cache, by the names vLLM accepts for
# --kv-cache-dtype (and the checkpoint dtypes "auto" resolves to).
_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "int8": 1,
}
# vLLM's DeepSeek sparse-MLA fp8 cache: 656 bytes per token and layer
# (512 fp8 latent values, 4 float32 scales, 64 bf16 rope values).
_FP8_DS_MLA_TOKEN_BYTES = 656

# layer_types / layers_block_type entries that hold KV pages.
_ATTENTION_LAYER_TYPES = {"attention", "full_attention", "sliding_attention"}


@dataclass(frozen=True)
class KVSizing:
    """One model's KV pages as vLLM would lay them out, and its CPU block."""

    model_type: str
    attention: str  # "mha", "gqa" or "mla"
    num_layers: int  # all decoder layers
    num_attention_layers: int  # layers holding KV pages
    num_state_layers: int  # linear-attention / Mamba layers (hybrid models)
    kv_heads_per_worker: int
    head_size: int
    kv_cache_dtype: str
    dtype_bytes: int
    tensor_parallel_size: int
    block_size: int  # tokens per CPU block (the guide's block_size)
    device_block_size: int  # tokens per device block (vLLM's block_size)
    bytes_per_token_per_layer: int  # one worker
    # Bytes of one layer's cache parts per device block, one worker: the
    # fragments a copy moves (K and V, or MLA's nope and rope parts, as the
    # Ascend layout holds them).
    fragment_bytes: tuple[int, ...]
    worker_bytes_per_cpu_block: int  # one worker's pool row
    stored_copies: int  # of each block: one per worker, or one (replication)
    bytes_per_cpu_block: int  # every copy, padded: cpu_bytes_to_use's unit
    exact: bool  # False: a lower bound (hybrid models)
    notes: tuple[str, ...] = field(default=())

    @property
    def blocks_per_chunk(self) -> int:
        return self.block_size // self.device_block_size

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fragment_bytes"] = list(self.fragment_bytes)
        d["notes"] = list(self.notes)
        return d


def load_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` of a local model directory (or the file itself)."""
    path = Path(model_dir)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SizingError(
            f"no config.json at {path}: --model must be a local Hugging Face "
            "model directory (its config.json alone is enough)"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SizingError(f"{path} is not readable JSON ({e})") from e
    if not isinstance(config, dict):
        raise SizingError(f"{path} holds {type(config).__name__}, not a JSON object")
    return config


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's part, as vLLM's hf_text_config picks it."""
    text = config.get("text_config")
    if isinstance(text, Mapping):
        merged = dict(text)
        for key in ("torch_dtype", "dtype"):
            merged.setdefault(key, config.get(key))
        return merged
    return dict(config)


def _required(cfg: Mapping[str, Any], key: str, why: str) -> int:
    """``cfg[key]``, a size ``check_sizes`` has validated if present."""
    value = cfg.get(key)
    if value is None:
        raise SizingError(
            f"config.json: {key} is missing, but {why} needs a positive integer"
        )
    return int(value)


def _first_key(cfg: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str, Any]:
    for key in keys:
        if cfg.get(key) is not None:
            return key, cfg[key]
    return "", None


def _model_dtype(cfg: Mapping[str, Any], dtype: str) -> str:
    """vLLM's --dtype auto: the checkpoint's dtype, float32 served as
    bfloat16 (the first dtype npu and cuda platforms support)."""
    if dtype != "auto":
        return dtype
    key, value = _first_key(cfg, ("dtype", "torch_dtype"))
    if value is None:
        return "bfloat16"  # transformers' default float32, downcast by vLLM
    name = str(value).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise SizingError(
            f"config.json: {key}={value!r} is not a dtype vLLM serves; pass "
            "--dtype bfloat16 (or float16, float32)"
        )
    return "bfloat16" if _DTYPE_BYTES[name] == 4 else name


def _layer_kinds(cfg: Mapping[str, Any], num_layers: int) -> tuple[int, int]:
    """(attention layers, state layers) of a possibly hybrid model."""
    for key in ("layer_types", "layers_block_type"):
        kinds = cfg.get(key)
        if kinds is None:
            continue
        if not isinstance(kinds, list) or len(kinds) != num_layers:
            raise SizingError(
                f"config.json: {key} must list one type per layer "
                f"({num_layers} layers, num_hidden_layers)"
            )
        attention = sum(str(k) in _ATTENTION_LAYER_TYPES for k in kinds)
        return attention, num_layers - attention
    interval = cfg.get("full_attention_interval")
    if interval is not None:  # check_sizes: a positive integer
        # Qwen3-Next: layer i is full attention iff (i + 1) % interval == 0.
        attention = num_layers // interval
        return attention, num_layers - attention
    return num_layers, 0


def _head_size(cfg: Mapping[str, Any], heads_key: str, heads: int) -> int:
    """vLLM's get_head_size: head_dim, else hidden_size // heads."""
    for key in ("head_dim", "hidden_size_per_head"):
        if cfg.get(key) is not None:
            return int(cfg[key])
    hidden = _required(cfg, "hidden_size", "the head size (no head_dim)")
    if not 0 < hidden // heads <= MAX_HEAD_SIZE:
        raise SizingError(
            f"config.json: hidden_size={hidden} // {heads_key}={heads} gives a "
            f"head size of {hidden // heads}, not in 1..{MAX_HEAD_SIZE}; set "
            "head_dim to the model's head size"
        )
    return hidden // heads


def size_kv(
    config: Mapping[str, Any],
    *,
    block_size: int = 128,
    device_block_size: int = 128,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
) -> KVSizing:
    """The KV pages and CPU block of the model ``config`` (a parsed
    config.json). ``block_size``: tokens per CPU block, a multiple of
    ``device_block_size`` (vLLM's KV block size on the device)."""
    for name, value in (
        ("--block-size", block_size),
        ("--device-block-size", device_block_size),
        ("--tensor-parallel-size", tensor_parallel_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SizingError(f"{name}={value!r} must be a positive integer")
    if block_size % device_block_size:
        raise SizingError(
            f"--block-size={block_size} (tokens per CPU block) must be a multiple "
            f"of the device block size {device_block_size} (--device-block-size)"
        )
    cfg = _text_config(config)
    model_type = str(cfg.get("model_type") or config.get("model_type") or "unknown")
    check_sizes(cfg)
    check_layout(config, cfg, model_type)

    num_layers = _required(cfg, "num_hidden_layers", "the number of layers")
    attention_layers, state_layers = _layer_kinds(cfg, num_layers)
    if attention_layers == 0:
        raise UnsupportedModelError(
            f"config.json: model_type {model_type!r} has no attention layers "
            "(layer_types / full_attention_interval): nothing holds KV pages "
            "to offload"
        )

    kv_dtype = kv_cache_dtype
    if kv_dtype == "auto":
        kv_dtype = _model_dtype(cfg, dtype)
    if kv_dtype not in _DTYPE_BYTES and kv_dtype != "fp8_ds_mla":
        raise SizingError(
            f"--kv-cache-dtype={kv_cache_dtype!r} is not known here; use auto, "
            f"{', '.join(k for k in _DTYPE_BYTES if k != 'float')} or fp8_ds_mla"
        )
    elem = _DTYPE_BYTES.get(kv_dtype, 1)
    tp = tensor_parallel_size
    notes: list[str] = []

    kv_lora_rank = cfg.get("kv_lora_rank")
    if kv_lora_rank is not None:
        kv_lora_rank = _required(cfg, "kv_lora_rank", "MLA's latent size")
        rope = _required(cfg, "qk_rope_head_dim", "MLA's rope part")
        attention = "mla"
        kv_heads = 1  # one latent, replicated on every tensor-parallel rank
        head_size = kv_lora_rank + rope
        if kv_dtype == "fp8_ds_mla":
            per_token = _FP8_DS_MLA_TOKEN_BYTES
            fragments = (per_token * device_block_size,)
        else:
            per_token = head_size * elem
            # The Ascend layout holds the latent as two tensors (nope, rope).
            fragments = (
                kv_lora_rank * elem * device_block_size,
                rope * elem * device_block_size,
            )
        if predicts_replicated(True, tp):
            notes.append(
                f"MLA: each of the {tp} tensor-parallel workers holds the same "
                "latent; vLLM stores it once (one region the workers of the host "
                "share) where they run on one node without pipeline or context "
                "parallelism, else once per worker"
            )
    else:
        if kv_dtype == "fp8_ds_mla":
            raise SizingError(
                "--kv-cache-dtype=fp8_ds_mla is for MLA models (kv_lora_rank "
                "set); this config has standard attention"
            )
        heads_key, total_heads = _first_key(cfg, ("num_attention_heads", "n_head"))
        if total_heads is None:
            raise SizingError(
                "config.json: num_attention_heads is missing; it is needed for "
                "the number of KV heads and the head size"
            )
        kv_key, total_kv = _first_key(
            cfg,
            (
                "n_head_kv",
                "num_kv_heads",
                "num_key_value_heads",
                "multi_query_group_num",
                "num_attention_groups",
            ),
        )
        if total_kv is None:
            total_kv = total_heads  # no grouping: one KV head per head
        head_size = _head_size(cfg, heads_key, total_heads)
        if total_heads % tp:
            raise SizingError(
                f"--tensor-parallel-size={tp} does not divide the "
                f"{total_heads} attention heads ({heads_key}); vLLM refuses it too"
            )
        if total_kv % tp and tp % total_kv:
            raise SizingError(
                f"--tensor-parallel-size={tp} and the {total_kv} KV heads "
                f"({kv_key}) do not divide one another; vLLM refuses it too"
            )
        attention = "gqa" if total_kv < total_heads else "mha"
        kv_heads = max(1, total_kv // tp)
        if total_kv < tp:
            notes.append(
                f"{total_kv} KV heads on {tp} workers: each worker holds a "
                "replica of one head"
            )
        per_token = 2 * kv_heads * head_size * elem
        fragments = (kv_heads * head_size * elem * device_block_size,) * 2

    worker_block = attention_layers * per_token * block_size
    copies = stored_copies(tp, predicts_replicated(attention == "mla", tp))
    all_copies = worker_block * copies
    aligned = -(-all_copies // CPU_BLOCK_ALIGNMENT) * CPU_BLOCK_ALIGNMENT
    exact = state_layers == 0
    if not exact:
        notes.append(
            f"hybrid model: {state_layers} of {num_layers} layers are linear-"
            "attention / Mamba layers with per-request state, not counted; vLLM "
            "pads every layer's page to one size for such models, so a CPU block "
            "is at least this large: read the exact size from the worker's log "
            "line 'CPU block pool of N blocks x B bytes'"
        )
    return KVSizing(
        model_type=model_type,
        attention=attention,
        num_layers=num_layers,
        num_attention_layers=attention_layers,
        num_state_layers=state_layers,
        kv_heads_per_worker=kv_heads,
        head_size=head_size,
        kv_cache_dtype=kv_dtype,
        dtype_bytes=elem,
        tensor_parallel_size=tp,
        block_size=block_size,
        device_block_size=device_block_size,
        bytes_per_token_per_layer=per_token,
        fragment_bytes=fragments,
        worker_bytes_per_cpu_block=worker_block,
        stored_copies=copies,
        bytes_per_cpu_block=aligned,
        exact=exact,
        notes=tuple(notes),
    )


def size_model_dir(model_dir: str | os.PathLike[str], **kwargs: Any) -> KVSizing:
    """``size_kv`` of a local model directory's config.json (and of the KV
    quantisation a vllm-ascend ModelSlim checkpoint declares beside it)."""
    config = load_config(model_dir)
    directory = model_dir if os.path.isdir(model_dir) else os.path.dirname(model_dir)
    kv_dtype = modelslim_kv_dtype(
        os.fspath(directory), kwargs.pop("kv_cache_dtype", "auto")
    )
    return size_kv(config, kv_cache_dtype=kv_dtype, **kwargs)
