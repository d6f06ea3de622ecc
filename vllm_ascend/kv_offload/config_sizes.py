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

from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAX_HEAD_SIZE",
    "SIZE_BOUNDS",
    "SizingError",
    "UnsupportedModelError",
    "check_layout",
    "check_sizes",
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
            raise UnsupportedModelError(
                f"config.json has {key}: {what}, which this sizing does not "
                "derive; read the exact CPU block size from the worker's log "
                "line 'CPU block pool of N blocks x B bytes' instead"
            )
