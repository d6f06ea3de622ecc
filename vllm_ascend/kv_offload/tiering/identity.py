"""Writer identity: what must be equal for one instance's stored KV bytes to
be usable by another (the layout, vLLM's resolved model config, the weights,
the deployment key's id), and the ``root_dir`` component derived from it.

vLLM's own file naming collapses TP sizes when it deems the bytes portable,
which this package's per-rank rows are not; hence a directory per identity.

The model part: vLLM's resolved model config (after ``hf_overrides``), its
dtypes and quantisation, the load format, and the weights (a fingerprint of
a local directory's weight files, the hub commit of a hub id). Weights that
cannot be identified get a per-process nonce, so such engines share no
files unless the fs tier names a shared id (``SHARED_ID``).

The weights fingerprint is cheap on any checkpoint size: per weight file its
name, size, its safetensors header (tensor names, dtypes, shapes, offsets)
and ``SAMPLES`` evenly spaced samples of ``SAMPLE_BYTES``; files up to
``WHOLE_FILE_BYTES`` are hashed whole. It reads no directory but the model's
own (not recursively) and never the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections.abc import Mapping
from typing import Any

from huggingface_hub import try_to_load_from_cache
from vllm.v1.kv_offload.config import OffloadingConfig

from vllm_ascend.kv_offload.config import PREFIX, OffloadConfigError
from vllm_ascend.kv_offload.tiering.auth_key import (
    AUTH_KEY_FILE,
    key_id,
    read_auth_key,
)

# Bumped whenever the bytes a file holds, or the identity's fields, change
# meaning (v2: the model part is vLLM's resolved config and the weights).
FORMAT = "vllm-ascend-kv-offload/rows-v2"
IDENTITY_DIR_PREFIX = "ascend-kv-"
IDENTITY_FILE = "identity.json"

# A new one in every process: unidentified weights are never shared.
PROCESS_NONCE = uuid.uuid4().hex
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLES = 64
SAMPLE_BYTES = 4096
WHOLE_FILE_BYTES = 1 << 20
# safetensors refuses headers over 100 MB; hashing is bounded below that.
MAX_HEADER_BYTES = 16 << 20

# What of vLLM's CacheConfig decides the KV's dtype (identity key: field).
CACHE_FIELDS = {
    "kv_cache_dtype": "cache_dtype",
    "kv_cache_dtype_skip_layers": "kv_cache_dtype_skip_layers",
    "mamba_cache_dtype": "mamba_cache_dtype",
    "mamba_ssm_cache_dtype": "mamba_ssm_cache_dtype",
}

# The fs tier key naming weights shared on purpose, and what it accepts.
SHARED_ID = "identity"
_SHARED_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}")


def unidentified(reason: str) -> dict[str, str]:
    return {"unidentified": reason, "nonce": PROCESS_NONCE}


def _hash_file(path: str, size: int) -> str:
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_BYTES:
            return hashlib.file_digest(f, "sha256").hexdigest()
        h = hashlib.sha256()
        start = 0
        if path.endswith(".safetensors"):
            header_len = int.from_bytes(f.read(8), "little")
            start = min(8 + header_len, size)
            f.seek(0)
            h.update(f.read(min(start, 8 + MAX_HEADER_BYTES)))
        span = max(size - start - SAMPLE_BYTES, 0)
        for i in range(SAMPLES):
            f.seek(start + span * i // (SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def fingerprint_weights(path: str) -> dict[str, Any]:
    """The fingerprint of the weight files in directory ``path`` (or of the
    file ``path``, e.g. a GGUF), or ``unidentified`` when there are none or
    they cannot be read."""
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith(WEIGHT_SUFFIXES))
        files = [os.path.join(path, n) for n in names]
    else:
        files = [path]
    if not files:
        return unidentified(f"no weight files in {path}")
    h = hashlib.sha256()
    try:
        for file in files:
            size = os.stat(file).st_size
            h.update(f"{os.path.basename(file)}\0{size}\0".encode())
            h.update(_hash_file(file, size).encode())
    except OSError as e:
        return unidentified(f"weights at {path} cannot be read ({e.strerror})")
    return {"files": len(files), "sampled_sha256": h.hexdigest()}


def _hub_commit(repo_id: str, revision: str | None) -> str | None:
    """The commit of the local hub cache snapshot of ``repo_id`` at
    ``revision`` (what vLLM loaded), without the network; None if none."""
    try:
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except Exception:  # an id the hub library refuses: not identified
        return None
    if not isinstance(found, str):
        return None
    snapshot = os.path.basename(os.path.dirname(found))
    return snapshot if re.fullmatch(r"[0-9a-f]{40}", snapshot) else None


def weights_identity(model_config: Any, load_format: str) -> dict[str, Any]:
    if load_format == "dummy":
        return unidentified("load_format 'dummy': random weights")
    path = getattr(model_config, "model_weights", None) or model_config.model
    if os.path.exists(path):
        return fingerprint_weights(path)
    commit = _hub_commit(model_config.model, model_config.revision)
    if commit is not None:
        return {"hub_commit": commit}
    return unidentified(f"{path} is neither a local path nor in the hub cache")


def model_identity(vllm_config: Any | None) -> dict[str, Any]:
    """The model's part of the storage identity, from vLLM's resolved
    config (``VllmConfig``); ``unidentified`` without one."""
    if vllm_config is None:
        return {"weights": unidentified("vLLM's resolved model config not seen")}
    model = vllm_config.model_config
    load_format = str(vllm_config.load_config.load_format)
    try:
        # transformers' own canonical serialisation (sorted keys), overrides in.
        hf_config = model.hf_config.to_json_string(use_diff=False)
    except (TypeError, ValueError) as e:
        return {"weights": unidentified(f"model config not serialisable ({e})")}
    return {
        "hf_config_sha256": hashlib.sha256(hf_config.encode()).hexdigest(),
        "model_dtype": str(model.dtype).removeprefix("torch."),
        "quantization": model.quantization,
        # getattr: fields some vLLM releases do not have count as absent.
        **{
            key: str(getattr(vllm_config.cache_config, field, None))
            for key, field in CACHE_FIELDS.items()
        },
        "model_impl": str(model.model_impl),
        "load_format": load_format,
        "revision": model.revision,
        "code_revision": model.code_revision,
        "weights": weights_identity(model, load_format),
    }


def check_shared_id(value: Any, where: str) -> None:
    if not isinstance(value, str) or not _SHARED_ID_RE.fullmatch(value):
        raise OffloadConfigError(
            f"{where}['{SHARED_ID}']={value!r} must name the weights every "
            "engine sharing this directory serves: 1-128 letters, digits or "
            '. _ - : @ +, starting with a letter or digit, e.g. "my-deployment-v3"; '
            "or remove it to have the weights fingerprinted"
        )


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


def tier_identity(
    identity: Mapping[str, Any], tier: Mapping[str, Any]
) -> tuple[dict[str, Any], bytes | None]:
    """The identity of the files of fs tier ``tier`` (an entry of
    ``secondary_tiers``), and its deployment key (None: none). The spec's
    ``identity`` with its weights named by the user (``SHARED_ID``) instead
    of fingerprinted (everything else still has to match); a keyed tier's
    with the key's id (slow and salted, not the key: ``auth_key.key_id``),
    so deployments with different keys do not remove each other's files as
    forgeries."""
    identity = dict(identity)
    if tier.get(SHARED_ID) is not None:
        identity["weights"] = {"shared_id": tier[SHARED_ID]}
    if tier.get(AUTH_KEY_FILE) is None:
        return identity, None
    setting = f"{PREFIX}['secondary_tiers'][..]['{AUTH_KEY_FILE}']"
    auth_key = read_auth_key(tier[AUTH_KEY_FILE], setting)
    identity["auth_key_id"] = key_id(auth_key, identity_digest(identity))
    return identity, auth_key
