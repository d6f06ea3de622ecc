"""The sizes ``sizing.py`` reads from a model's config.json, checked before
any is used: each present one must be an integer (``true`` is not), positive
and at most its bound in ``SIZE_BOUNDS``. A JSON ``null`` is an absent key
(configs write ``"head_dim": null``). A present but invalid size is an error
naming the key and its value, never a reason to derive the size another way.

The bounds are far above the sizes of released models; what they stop is a
config whose sizes would make a CPU block of petabytes, or a negative one.
A valid config of a layout the formulas do not describe (``check_layout``)
is refused by name with ``UnsupportedModelError``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAX_HEAD_SIZE",
    "SIZE_BOUNDS",
    "SizingError",
    "UnsupportedModelError",
    "check_layout",
    "check_sizes",
    "modelslim_kv_dtype",
]

# The largest value accepted for each size key sizing reads (the first of a
# group of synonyms is the one models mostly use).
_LAYERS = 1024
_HEADS = 4096
_HEAD_DIM = 4096
# Also the bound of a head size derived as hidden_size // num_attention_heads.
MAX_HEAD_SIZE = _HEAD_DIM
SIZE_BOUNDS: dict[str, int] = {
    "num_hidden_layers": _LAYERS,
    "full_attention_interval": _LAYERS,
    "num_attention_heads": _HEADS,
    "n_head": _HEADS,
    "num_key_value_heads": _HEADS,
    "n_head_kv": _HEADS,
    "num_kv_heads": _HEADS,
    "multi_query_group_num": _HEADS,
    "num_attention_groups": _HEADS,
    "head_dim": _HEAD_DIM,
    "hidden_size_per_head": _HEAD_DIM,
    "qk_rope_head_dim": _HEAD_DIM,
    "kv_lora_rank": 4 * _HEAD_DIM,
    "hidden_size": 65536,
}

# Keys of layouts the sizing formulas do not describe: sizing them would be a
# guess, so they are refused by name (UnsupportedModelError).
_UNSUPPORTED_KEYS = {
    "compress_ratios": "compressed attention (DeepSeek-V4 style)",
    "index_topk": "a sparse-attention indexer with its own KV cache "
    "(DeepSeek-V3.2 style)",
    "block_configs": "per-layer block configurations (heterogeneous layers)",
    "attn_type_list": "per-layer attention types (attn_type_list)",
    "hybrid_override_pattern": "a hybrid layer pattern (hybrid_override_pattern)",
    "num_kv_shared_layers": "KV shared across layers (num_kv_shared_layers)",
    "cross_attention_layers": "cross-attention layers",
}


class SizingError(ValueError):
    """A model config the KV sizing cannot derive exactly: a size that is
    missing or invalid, or a setting that does not fit the model."""


class UnsupportedModelError(SizingError):
    """A valid config of a model layout the sizing formulas do not cover."""


def _unsupported(what: str) -> UnsupportedModelError:
    """``what`` the sizing does not derive, and where the exact size is."""
    return UnsupportedModelError(
        f"{what}; read the exact CPU block size from the worker's log line "
        "'CPU block pool of N blocks x B bytes' instead"
    )


def check_sizes(cfg: Mapping[str, Any]) -> None:
    """Raises SizingError for the first size key of ``cfg`` (the language
    model's config) that is present and not a positive integer within
    ``SIZE_BOUNDS``."""
    for key, bound in SIZE_BOUNDS.items():
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise SizingError(
                f"config.json: {key}={value!r} must be a positive integer"
            )
        if value > bound:
            raise SizingError(
                f"config.json: {key}={value} is above {bound}, the largest this "
                "sizing accepts (far above any released model's)"
            )
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    if cfg.get("head_dim") is None and hidden and heads:
        # The head size many models derive (a bound on it, as on head_dim).
        if not 0 < hidden // heads <= MAX_HEAD_SIZE:
            raise SizingError(
                f"config.json: hidden_size={hidden} // num_attention_heads={heads} "
                f"gives a head size of {hidden // heads}, not in 1..{MAX_HEAD_SIZE}; "
                "set head_dim to the model's head size"
            )


def check_layout(config: Mapping[str, Any], cfg: Mapping[str, Any], model: str) -> None:
    """Raises UnsupportedModelError for a model (``config``, its language
    model's part ``cfg``, of model_type ``model``) whose layout the sizing
    formulas do not describe."""
    if config.get("is_encoder_decoder") or cfg.get("is_encoder_decoder"):
        raise UnsupportedModelError(
            f"config.json: model_type {model!r} is an encoder-decoder "
            "model; KV offloading sizing covers decoder-only models"
        )
    for key, what in _UNSUPPORTED_KEYS.items():
        if cfg.get(key) is not None:
            raise _unsupported(
                f"config.json has {key}: {what}, which this sizing does not derive"
            )


# vllm-ascend's ModelSlim checkpoints declare KV quantisation in a file beside
# config.json (upstream 0.30.0rc2, quantization/configs/modelslim_config.py:
# the file name :108, kv_cache_type / fa_quant_type / indexer_quant_type
# :1047-1054, the C8-MXFP recipe :64 and :831). Only dense C8 keeps the pages
# config.json describes (int8 K and V; its scales are layer weights, not
# cache); the others add parts (scale tensors, an int8 latent beside a bf16
# rope) config.json does not show, so sizing from it would undercount.
MODELSLIM_FILE = "quant_model_description.json"


def modelslim_kv_dtype(model_dir: str, kv_cache_dtype: str) -> str:
    """The KV cache dtype to size a model in ``model_dir`` with, given
    ``--kv-cache-dtype`` ``kv_cache_dtype``: "int8" for a ModelSlim dense C8
    checkpoint under "auto"; UnsupportedModelError where vllm-ascend's KV
    quantisation adds cache parts config.json does not describe."""
    if kv_cache_dtype == "mxfp8":
        raise _unsupported(
            "--kv-cache-dtype mxfp8 is vllm-ascend's C8-MXFP KV cache: fp8 K "
            "and V plus K and V scale tensors config.json does not describe"
        )
    path = os.path.join(model_dir, MODELSLIM_FILE)
    try:
        with open(path, "rb") as f:
            description = json.load(f)
    except FileNotFoundError:
        return kv_cache_dtype
    except (OSError, ValueError) as e:
        raise SizingError(f"{path} cannot be read as JSON: {e}") from e
    if not isinstance(description, Mapping):
        raise SizingError(f"{path} must hold a JSON object")
    kv_type = description.get("kv_cache_type") or ""
    for key in ("fa_quant_type", "indexer_quant_type"):
        if description.get(key):
            raise _unsupported(
                f"{MODELSLIM_FILE}: {key}={description[key]!r} quantises part of "
                "the KV cache (an int8 part beside a bf16 one, or an indexer "
                "cache with its scales), which this sizing does not derive"
            )
    if kv_type and kv_type != "C8":
        raise _unsupported(
            f"{MODELSLIM_FILE}: kv_cache_type={kv_type!r} (C8-MXFP or another "
            "recipe) adds scale tensors config.json does not describe"
        )
    if kv_type == "C8" and kv_cache_dtype == "auto":
        return "int8"
    return kv_cache_dtype
