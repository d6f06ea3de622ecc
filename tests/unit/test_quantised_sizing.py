"""Quantised KV: sizing against the pages vLLM's CPU backend allocates.

The end-to-end half (engines with offloading off and on, the pool's gauge
and log, the doctor) is tests/e2e/test_quantised_kv.py.
"""

import pytest

from tests.unit.model_configs import QWEN3_0_6B, tiny_qwen3_config, write_model
from vllm_ascend.kv_offload.sizing import size_kv


def _cpu_backend_quantised_dtypes() -> list[str]:
    """The quantised KV dtypes vLLM's CPU attention backend declares, read
    from vLLM (not a copy of its list)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return [d for d in CPUAttentionBackend.supported_kv_cache_dtypes if d != "auto"]


@pytest.mark.parametrize("kv_cache_dtype", _cpu_backend_quantised_dtypes())
@pytest.mark.parametrize("config", [QWEN3_0_6B, tiny_qwen3_config()])
def test_quantised_kv_matches_the_page_vllms_cpu_backend_allocates(
    tmp_path, vllm_model_config, config, kv_cache_dtype
):
    # The spec as vLLM's attention layer builds it for this dtype, then as
    # the CPU backend customises it (it adds no scale bytes: fp8 scales are
    # per-tensor floats on the layer, not part of the KV cache).
    from vllm.config import ParallelConfig
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    mc = vllm_model_config(write_model(tmp_path, config))
    spec = CPUAttentionBackend.customize_spec(
        FullAttentionSpec(
            block_size=128,
            num_kv_heads=mc.get_num_kv_heads(ParallelConfig()),
            head_size=mc.get_head_size(),
            dtype=kv_cache_dtype_str_to_dtype(kv_cache_dtype, mc),
            kv_quant_mode=get_kv_quant_mode(kv_cache_dtype),
        )
    )
    ours = size_kv(config, kv_cache_dtype=kv_cache_dtype)
    assert spec.page_size_bytes * ours.num_attention_layers == (
        ours.worker_bytes_per_cpu_block
    )
    assert ours.dtype_bytes == spec.dtype.itemsize
