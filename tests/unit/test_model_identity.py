"""The model part of the fs tier's storage identity (issue 28, D2): built from
vLLM's resolved config, so that whatever changes the KV of a model directory
(overrides, revision, quantisation, dummy or other weights) changes the
identity directory, and nothing else does."""

from __future__ import annotations

import importlib
import json
import shutil
import time
from types import SimpleNamespace

import pytest

from tests.unit.conftest import TIERING, make_connector
from vllm_ascend.kv_offload.testing.tiny_model import TinyModelSpec, ensure_tiny_model
from vllm_ascend.kv_offload.tiering import identity as identity_module
from vllm_ascend.kv_offload.tiering.identity import (
    IDENTITY_FILE,
    fingerprint_weights,
    model_identity,
    tier_identity,
    weights_identity,
)

ROPE_OVERRIDE = {"rope_parameters": {"rope_theta": 1000.0, "rope_type": "default"}}


@pytest.fixture(scope="module")
def model_dir() -> str:
    return ensure_tiny_model()


def resolved(model: str, load_format="auto", cache_dtype="auto", **model_kw):
    """vLLM's resolved config of ``model`` (no engine)."""
    from vllm.config import CacheConfig, LoadConfig, ModelConfig, VllmConfig

    model_kw.setdefault("dtype", "bfloat16")  # fp8 weights need a 16-bit dtype
    return VllmConfig(
        model_config=ModelConfig(model=model, **model_kw),
        load_config=LoadConfig(load_format=load_format),
        cache_config=CacheConfig(cache_dtype=cache_dtype),
    )


def identity(model: str, **changes) -> dict:
    return model_identity(resolved(model, **changes))


@pytest.mark.parametrize(
    "change",
    [
        {"hf_overrides": ROPE_OVERRIDE},
        {"revision": "v2"},
        {"code_revision": "v2"},
        {"quantization": "fp8_per_tensor"},
        {"cache_dtype": "fp8"},
        {"dtype": "float32"},
        {"load_format": "dummy"},
    ],
    ids=lambda change: next(iter(change)),
)
def test_what_changes_the_kv_changes_the_identity(model_dir, change):
    assert identity(model_dir, **change) != identity(model_dir)


def test_unidentified_weights_are_never_shared_across_processes(model_dir, tmp_path):
    """Dummy weights, a directory without weight files: a nonce of this
    process instead of a fingerprint."""
    (tmp_path / "config.json").write_text("{}")
    for weights, why in (
        (identity(model_dir, load_format="dummy")["weights"], "dummy"),
        (fingerprint_weights(str(tmp_path)), "no weight files"),
    ):
        assert why in weights["unidentified"]
        assert weights["nonce"] == identity_module.PROCESS_NONCE
    # Each process draws its own nonce when it imports the module.
    reimported = importlib.reload(identity_module)
    assert reimported.PROCESS_NONCE != weights["nonce"]


def test_the_same_config_and_weights_give_the_same_identity_other_weights_not(
    model_dir, tmp_path
):
    """Twice, or a copy; other weights change the weights part only."""
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    assert fingerprint_weights(str(copy)) == fingerprint_weights(model_dir)  # copies
    before = identity(str(copy))
    assert identity(str(copy)) == before
    assert before["weights"]["files"] == 1  # model.safetensors, fingerprinted
    config_json = (copy / "config.json").read_bytes()
    ensure_tiny_model(copy, TinyModelSpec(seed=1))  # the weights rewritten
    assert (copy / "config.json").read_bytes() == config_json
    after = identity(str(copy))
    assert {k for k in before if before[k] != after[k]} == {"weights"}


def _sparse_checkpoint(path, size: int, header: dict) -> int:
    """A safetensors-shaped file of ``size`` bytes, mostly holes; returns
    where its data starts."""
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(size)
    return 8 + len(text)


def test_a_large_checkpoint_is_fingerprinted_from_its_header_and_samples(tmp_path):
    shard = tmp_path / "model-00001-of-00001.safetensors"
    header = {"w": {"dtype": "BF16", "shape": [1 << 18, 1 << 17], "data_offsets": []}}
    data_start = _sparse_checkpoint(shard, 64 << 30, header)  # 64 GiB
    start = time.monotonic()
    first = fingerprint_weights(str(tmp_path))
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"fingerprinting 64 GiB took {elapsed:.1f} s"
    with open(shard, "r+b") as f:  # a byte of the first sample
        f.seek(data_start)
        f.write(b"\x01")
    second = fingerprint_weights(str(tmp_path))
    assert second != first
    header["w"]["dtype"] = "F16"  # same size, another header
    _sparse_checkpoint(shard, 64 << 30, header)
    assert fingerprint_weights(str(tmp_path)) not in (first, second)


def test_a_hub_id_is_identified_by_the_commit_of_its_cached_snapshot(
    tmp_path, monkeypatch
):
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--org--tiny"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))

    def hub(model: str, revision: str | None = None) -> dict:
        return weights_identity(
            SimpleNamespace(model=model, revision=revision, model_weights=""), "auto"
        )

    assert hub("org/tiny") == {"hub_commit": commit}
    assert hub("org/tiny", revision=commit) == {"hub_commit": commit}
    assert "hub cache" in hub("org/absent")["unidentified"]
    assert "hub cache" in hub("org/tiny", revision="v2")["unidentified"]


def with_shared_id(identity: dict, shared_id: str) -> dict:
    """The identity of an fs tier's files naming its weights ``shared_id``."""
    return tier_identity(identity, {"identity": shared_id})[0]


def test_a_shared_id_names_the_weights_and_nothing_else(model_dir):
    base = identity(model_dir)
    unidentified = dict(base, weights={"unidentified": "x", "nonce": "another"})
    assert with_shared_id(base, "dep-v3") == with_shared_id(unidentified, "dep-v3")
    assert with_shared_id(base, "dep-v3") != with_shared_id(base, "dep-v4")
    overridden = identity(model_dir, hf_overrides=ROPE_OVERRIDE)
    assert with_shared_id(overridden, "dep-v3") != with_shared_id(base, "dep-v3")


def test_the_connector_gives_the_tier_vllms_resolved_model_config(model_dir, tmp_path):
    """What the engine builds (our connector, the tiering spec, the fs
    tier) writes an identity.json holding the resolved config's identity,
    fingerprinted weights included."""
    tiers = [{"type": "fs", "root_dir": str(tmp_path)}]
    extra = {**TIERING, "num_cpu_blocks": 8, "block_size": 16, "secondary_tiers": tiers}
    connector = make_connector("scheduler", extra)
    try:
        (written,) = tmp_path.glob(f"ascend-kv-*/{IDENTITY_FILE}")
        stored = json.loads(written.read_text())
    finally:
        connector.shutdown()
    expected = identity(model_dir, dtype="float32")  # make_connector's
    assert {k: stored[k] for k in expected} == expected
    assert "unidentified" not in stored["weights"]


def test_a_config_transformers_cannot_serialise_leaves_the_model_unidentified(
    model_dir, monkeypatch
):
    config = resolved(model_dir)

    def refuse(**kwargs):
        raise TypeError("Object of type X is not JSON serializable")

    monkeypatch.setattr(config.model_config.hf_config, "to_json_string", refuse)
    weights = model_identity(config)["weights"]
    assert "not serialisable" in weights["unidentified"]
