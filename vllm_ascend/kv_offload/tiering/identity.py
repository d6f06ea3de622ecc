"""Writer identity: what must be equal for one instance's stored KV bytes to
be usable by another, and the ``root_dir`` component derived from it.

vLLM's own file naming collapses TP sizes when it deems the bytes portable,
which this package's per-rank rows are not; hence a directory per identity.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_offload.config import OffloadingConfig

from vllm_ascend.kv_offload.tiering.model_identity import model_identity

# Bumped whenever the bytes a file holds, or the identity's fields, change
# meaning (v2: the model part is vLLM's resolved config and the weights).
FORMAT = "vllm-ascend-kv-offload/rows-v2"
IDENTITY_DIR_PREFIX = "ascend-kv-"
IDENTITY_FILE = "identity.json"


def storage_identity(
    config: OffloadingConfig, device_type: str, vllm_config: Any | None
) -> dict[str, Any]:
    """What must be equal for one instance's stored KV bytes to be valid in
    another: the layout from ``config``, the model from vLLM's resolved
    ``vllm_config`` (``model_identity``). The scheduler side computes it (it
    owns the secondary tiers)."""
    parallel = config.parallel
    return {
        "format": FORMAT,
        "device_type": device_type,
        "model": config.model.name,
        "kv_dtype": config.model.dtype,
        "kv_cache_layout": config.kv_cache_layout,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [
            {"tokens_per_block": g.tokens_per_block, "layers": list(g.layer_names)}
            for g in config.groups
        ],
        "world_size": parallel.world_size,
        "tp_size": parallel.tp_size,
        "pp_size": parallel.pp_size,
        "pcp_size": parallel.pcp_size,
        "dcp_size": parallel.dcp_size,
        "replicated_layout": config.replicated_layout,
        **model_identity(vllm_config),
    }


def identity_digest(identity: Mapping[str, Any]) -> str:
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def identity_root(root_dir: str, digest: str) -> str:
    return os.path.join(root_dir, f"{IDENTITY_DIR_PREFIX}{digest[:16]}")
