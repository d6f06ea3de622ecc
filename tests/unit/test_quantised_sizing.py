"""Quantised KV that config.json does not show: vllm-ascend's ModelSlim
checkpoints. Quantised KV dtypes against the pages vLLM's CPU backend
allocates: test_sizing.py; the end-to-end half (engines with offloading off
and on, the pool's gauge and log, the doctor): tests/e2e/test_quantised_kv.py.
"""

import pytest

from tests.unit.model_configs import QWEN3_0_6B, write_model
from vllm_ascend.kv_offload.sizing import (
    SizingError,
    UnsupportedModelError,
    size_model_dir,
)


# vllm-ascend's ModelSlim checkpoints declare KV quantisation beside
# config.json, in quant_model_description.json (upstream 0.30.0rc2,
# quantization/configs/modelslim_config.py:1047-1054 and :831).
def _modelslim(tmp_path, name="model", **description):
    import json

    model = write_model(tmp_path, QWEN3_0_6B, name=name)
    (model / "quant_model_description.json").write_text(json.dumps(description))
    return model


def test_a_dense_c8_checkpoint_is_sized_with_int8_kv(tmp_path):
    plain = size_model_dir(write_model(tmp_path, QWEN3_0_6B, name="plain"))
    c8 = size_model_dir(_modelslim(tmp_path, "c8", kv_cache_type="C8"))
    # bf16 K and V become int8 (the C8 scales are layer weights, not cache).
    assert c8.worker_bytes_per_cpu_block * 2 == plain.worker_bytes_per_cpu_block
    assert size_model_dir(_modelslim(tmp_path, "w8a8")) == plain


@pytest.mark.parametrize(
    "description, kv_cache_dtype, named",
    [
        ({"kv_cache_type": "K_DYNAMIC_V_STATIC_MXFP8_PER_CHANNEL"}, "auto", "C8-MXFP"),
        ({}, "mxfp8", "scale tensors"),
        ({"fa_quant_type": "FAKQuant"}, "auto", "fa_quant_type"),
        ({"indexer_quant_type": "C8"}, "auto", "indexer_quant_type"),
    ],
)
def test_quantised_kv_with_parts_config_json_does_not_show_is_not_sized(
    tmp_path, description, kv_cache_dtype, named
):
    # Sizing from config.json would undercount these (scale tensors, an int8
    # latent beside a bf16 rope): said, not guessed.
    with pytest.raises(UnsupportedModelError, match=named) as e:
        size_model_dir(
            _modelslim(tmp_path, **description), kv_cache_dtype=kv_cache_dtype
        )
    assert "CPU block pool of N blocks x B bytes" in str(e.value)


def test_an_unreadable_quantisation_file_is_an_error_naming_it(tmp_path):
    model = write_model(tmp_path, QWEN3_0_6B)
    (model / "quant_model_description.json").write_text("{not json")
    with pytest.raises(SizingError, match="quant_model_description.json"):
        size_model_dir(model)
