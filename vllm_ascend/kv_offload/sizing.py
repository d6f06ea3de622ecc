"""How big one CPU block is for a model, read through vLLM's ``ModelConfig``.

A local model directory's ``config.json`` is enough (no weights, no
tokenizer): vLLM's ``ModelConfig`` gives the KV heads per tensor-parallel
rank, the head size, MLA or not, the dtype ``auto`` resolves to on this
platform and the attention layers of a hybrid model, as the engine will.
Before it, every size of config.json is validated (``config_sizes``) and
layouts these formulas do not describe are refused by name; a model vLLM
cannot load here is refused with vLLM's reason (``UnsupportedModelError``:
"cannot size this model").

Per token and attention layer on one rank: ``2 (K and V) * kv_heads *
head_size * dtype_bytes``, or for MLA one latent of ``kv_lora_rank +
qk_rope_head_dim``. A CPU block holds ``block_size`` tokens (the guide's key)
of every attention layer; over all workers that store it (one copy for MLA
under tensor parallelism, which the workers of a host share: ``replication``),
padded to the page size, it is the unit of ``cpu_bytes_to_use``. Hybrid
models' state layers are not counted (a lower bound, ``exact=False``). How
many blocks fit in host memory is ``host_guard.fit_host_memory``'s job.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_ascend.kv_offload.config_sizes import (
    SizingError,
    UnsupportedModelError,
    check_layout,
    check_sizes,
    modelslim_kv_dtype,
)
from vllm_ascend.kv_offload.replication import predicts_replicated, stored_copies

if TYPE_CHECKING:
    from vllm.config import ModelConfig

__all__ = [
    "CPU_BLOCK_ALIGNMENT",
    "KVSizing",
    "SizingError",
    "UnsupportedModelError",
    "load_config",
    "model_config",
    "size_model_config",
    "size_model_dir",
]

# vLLM's CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT (mmap.PAGESIZE): a CPU block
# over all workers is padded to it.
CPU_BLOCK_ALIGNMENT = mmap.PAGESIZE
# --kv-cache-dtype values whose pages are plain elements of one dtype (vLLM's
# STR_DTYPE_TO_TORCH_DTYPE gives their size); the others add scales or pack.
_FLOAT_DTYPES = ("float32", "float", "bfloat16", "float16", "half")
_PLAIN_KV_DTYPES = (*_FLOAT_DTYPES, "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "int8")
# vLLM's DeepSeek sparse-MLA fp8 cache: 656 bytes per token and layer
# (512 fp8 latent values, 4 float32 scales, 64 bf16 rope values).
_FP8_DS_MLA_TOKEN_BYTES = 656


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
    max_model_len: int  # vLLM's default for this model
    exact: bool  # False: a lower bound (hybrid models)
    notes: tuple[str, ...] = field(default=())

    @property
    def blocks_per_chunk(self) -> int:
        return self.block_size // self.device_block_size

    @property
    def kv_bytes_per_token(self) -> int:
        """All attention layers, one worker."""
        return self.num_attention_layers * self.bytes_per_token_per_layer


def load_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` of a local model directory (or the file itself)."""
    path = Path(model_dir)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SizingError(
            f"no config.json at {path}: give a local Hugging Face model "
            "directory (its config.json alone is enough)"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SizingError(f"{path} is not readable JSON ({e})") from e
    if not isinstance(config, dict):
        raise SizingError(f"{path} holds {type(config).__name__}, not a JSON object")
    return config


def model_config(model_dir: str | os.PathLike[str], dtype: str = "auto") -> ModelConfig:
    """vLLM's ModelConfig of a local directory, without weights or tokenizer;
    UnsupportedModelError with vLLM's reason where it cannot load it."""
    from vllm.config import ModelConfig

    # vLLM logs (and retries) a config it cannot parse before raising; the
    # reason is in the error, once.
    quiet = logging.getLogger("vllm")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        return ModelConfig(
            model=os.fspath(model_dir), skip_tokenizer_init=True, dtype=dtype
        )
    except Exception as e:
        why = " ".join(str(e).split())[:400]
        raise UnsupportedModelError(
            f"vLLM's ModelConfig cannot load {model_dir} here "
            f"({type(e).__name__}: {why})"
        ) from e
    finally:
        quiet.setLevel(level)


def _require(raw: Mapping[str, Any], hf_config: Any, key: str, why: str) -> None:
    """``key`` (or transformers' alias of it) must be in config.json itself:
    a default filled in by transformers would size some other model."""
    alias = getattr(type(hf_config), "attribute_map", {}).get(key)
    if raw.get(key) is None and (alias is None or raw.get(alias) is None):
        raise SizingError(
            f"config.json: {key} is missing, but {why} needs a positive integer"
        )


def _checkpoint_dtype(cfg: Mapping[str, Any], raw: Mapping[str, Any]) -> None:
    """vLLM's --dtype auto casts a checkpoint dtype that is not a float one to
    what the platform prefers: a guess, refused here naming the flag."""
    for key in ("dtype", "torch_dtype"):
        value = cfg.get(key) or raw.get(key)
        if value is None:
            continue
        if str(value).removeprefix("torch.") not in _FLOAT_DTYPES:
            raise SizingError(
                f"config.json: {key}={value!r} is not a dtype vLLM serves; pass "
                "--dtype bfloat16 (or float16, float32)"
            )
        return


def size_model_config(
    mc: ModelConfig,
    raw_text: Mapping[str, Any],
    *,
    block_size: int = 128,
    device_block_size: int = 128,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
) -> KVSizing:
    """The KV pages and CPU block of the model of vLLM's ModelConfig ``mc``
    (``raw_text``: its config.json's language-model part, a multimodal one's
    ``text_config``, for the keys that must be given there).
    ``block_size``: tokens per CPU block, a multiple of ``device_block_size``
    (vLLM's KV block size on the device)."""
    from vllm.config import ParallelConfig
    from vllm.utils.math_utils import round_up
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

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
    text = mc.hf_text_config
    model_type = str(getattr(text, "model_type", None) or "unknown")
    _require(raw_text, text, "num_hidden_layers", "the number of layers")
    tp = tensor_parallel_size
    parallel = ParallelConfig(tensor_parallel_size=tp)
    num_layers = mc.get_num_layers(parallel)
    attention_layers = mc.get_num_layers_by_block_type(parallel, "attention")
    if attention_layers == 0:
        raise UnsupportedModelError(
            f"config.json: model_type {model_type!r} has no attention layers "
            "(layer_types / full_attention_interval): nothing holds KV pages "
            "to offload"
        )
    try:
        mc.verify_with_parallel_config(parallel)
    except ValueError as e:
        raise SizingError(f"--tensor-parallel-size={tp}: vLLM refuses it: {e}") from e

    kv_dtype = kv_cache_dtype
    if kv_dtype == "auto":
        kv_dtype = str(mc.dtype).removeprefix("torch.")
    if kv_dtype not in _PLAIN_KV_DTYPES and kv_dtype != "fp8_ds_mla":
        raise SizingError(
            f"--kv-cache-dtype={kv_cache_dtype!r} is not known here; use auto, "
            f"{', '.join(_PLAIN_KV_DTYPES)} or fp8_ds_mla"
        )
    elem = STR_DTYPE_TO_TORCH_DTYPE[kv_dtype].itemsize
    head_size = mc.get_head_size()
    notes: list[str] = []
    if mc.use_mla:
        _require(raw_text, text, "kv_lora_rank", "MLA's latent size")
        _require(raw_text, text, "qk_rope_head_dim", "MLA's rope part")
        attention, kv_heads = "mla", 1  # one latent on every rank
        rope = int(text.qk_rope_head_dim)
        if kv_dtype == "fp8_ds_mla":
            per_token = _FP8_DS_MLA_TOKEN_BYTES
            fragments: tuple[int, ...] = (per_token * device_block_size,)
        else:
            per_token = head_size * elem
            # The Ascend layout holds the latent as two tensors (nope, rope).
            fragments = (
                (head_size - rope) * elem * device_block_size,
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
        total_kv = mc.get_total_num_kv_heads()
        kv_heads = mc.get_num_kv_heads(parallel)
        attention = "gqa" if total_kv < text.num_attention_heads else "mha"
        if total_kv < tp:
            notes.append(
                f"{total_kv} KV heads on {tp} workers: each worker holds a "
                "replica of one head"
            )
        per_token = 2 * kv_heads * head_size * elem
        fragments = (kv_heads * head_size * elem * device_block_size,) * 2

    copies = stored_copies(tp, predicts_replicated(mc.use_mla, tp))
    worker_block = attention_layers * per_token * block_size
    aligned = round_up(worker_block * copies, CPU_BLOCK_ALIGNMENT)
    state_layers = num_layers - attention_layers
    if state_layers:
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
        max_model_len=mc.max_model_len,
        exact=state_layers == 0,
        notes=tuple(notes),
    )


def size_model_dir(
    model_dir: str | os.PathLike[str],
    *,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    **kwargs: Any,
) -> KVSizing:
    """The KV pages and CPU block of a local model directory (or its
    config.json), with the KV quantisation a vllm-ascend ModelSlim checkpoint
    declares beside it; ``kwargs`` as ``size_model_config``'s."""
    path = Path(model_dir)
    directory = path if path.is_dir() else path.parent
    raw = load_config(path)
    text = (
        raw.get("text_config") if isinstance(raw.get("text_config"), Mapping) else raw
    )
    check_sizes(text)
    check_layout(raw, text, str(text.get("model_type") or raw.get("model_type")))
    if dtype == "auto":
        _checkpoint_dtype(text, raw)
    kv_dtype = modelslim_kv_dtype(os.fspath(directory), kv_cache_dtype)
    mc = model_config(directory, dtype)
    return size_model_config(mc, text, kv_cache_dtype=kv_dtype, **kwargs)
