"""The KV-cache layouts upstream vllm-ascend 0.30.0rc2 builds, as scenarios
for tests/unit/upstream_layouts.py: each model's layers with their specs,
built with the arguments upstream's ``get_kv_cache_spec``
(model_runner_v1.py:6144) passes (line cited per layout)."""

from __future__ import annotations

from dataclasses import replace

import torch
from vllm.config.cache import KVCacheLayout
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from tests.unit.upstream_layouts import Scenario
from tests.unit.upstream_runner import C8MXFPLayer, Layer, MLALayer

ATTN = "AscendAttentionBackend"
MLA = "AscendMLABackend"
SFA = "AscendSFABackend"
INDEXER = "AscendSFAIndexerBackend"


def _attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _indexer(i: int) -> str:
    return f"model.layers.{i}.self_attn.indexer.k_cache"


def _mla_layer() -> MLALayer:
    return MLALayer(512, 64)  # kv_lora_rank, qk_rope_head_dim


def _layers(spec, backend, stand_in=Layer, name=_attn, ids=range(2)) -> dict:
    """Layers ``name(i)`` for each i in ``ids``: ``spec``, a fresh
    ``stand_in()`` and ``backend`` each."""
    return {name(i): (spec, stand_in(), backend) for i in ids}


def scenarios(upstream) -> dict[str, Scenario]:
    """Every layout covered, by name. Specs are built with the arguments
    upstream's get_kv_cache_spec passes (model_runner_v1.py line cited)."""
    ns, specs = upstream.ns, upstream.specs
    bf16 = torch.bfloat16
    # vLLM's Attention.get_kv_cache_spec, kept as is (:6183-6186).
    dense = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=bf16)
    # AscendMLAAttentionSpec from vLLM's MLA spec (:6237-6268): head_size is
    # kv_lora_rank + qk_rope_head_dim = 512 + 64.
    mla = specs.AscendMLAAttentionSpec(
        block_size=128, num_kv_heads=1, head_size=576, dtype=bf16
    )
    # DeepSeek-V3.2 indexer with indexer_kv_dtype=int8 (:6270-6300, dtypes
    # of :469-476): int8 K, one fp16 scale per token.
    indexer_c8 = specs.AscendSFAIndexerCacheSpec(
        block_size=128,
        num_kv_heads=1,
        head_size=128,
        dtype=torch.int8,
        cache_dtype_str="int8",
        scale_dim=1,
        scale_dtype=torch.float16,
        cache_sparse_li_c8=True,
    )
    indexers_c8 = lambda: _layers(indexer_c8, INDEXER, name=_indexer)  # noqa: E731
    kv_quant = upstream.kv_quant()
    kv_quant.enable_fa_quant = True  # a ModelSlim C8 checkpoint's setting
    kv_quant.kvcache_quant_layers = {0, 1}

    def mxfp_layers(block_size: int):
        # mxfp_cache_spec of vLLM's spec (:6185).
        spec = ns["mxfp_cache_spec"](
            FullAttentionSpec(
                block_size=block_size, num_kv_heads=2, head_size=128, dtype=bf16
            )
        )
        # Each layer's static V scales: one E8M0 byte per KV channel.
        return _layers(
            spec,
            ATTN,
            lambda: C8MXFPLayer(torch.randint(0, 256, (2 * 128,), dtype=torch.uint8)),
        )

    # :6207-6235: one int8 row of latent, bf16 rope and fp32 tile scales
    # (get_sfa_qsfa_packed_head_dim).
    sfa_c8 = replace(
        mla,
        head_size=ns["get_sfa_qsfa_packed_head_dim"](512, 64),
        dtype=torch.int8,
        cache_dtype_str="int8",
        cache_sparse_sfa_c8=True,
    )
    # Padded to the attention page, as vLLM unifies hybrid page sizes.
    mamba = MambaSpec(
        block_size=64,
        shapes=((3, 256), (4, 32, 32)),
        dtypes=(bf16, torch.float32),
        page_size_padded=replace(dense, block_size=64).page_size_bytes,
    )
    # _reshape_kv_cache_tensors, :5520-5535: with DSV4_COMPRESSED_CACHE the
    # layer also gets a full view of the same page bytes (overlap_full_kv_cache).
    dsv4 = specs.AscendMLAAttentionSpec(
        block_size=128,
        num_kv_heads=1,
        head_size=128,
        dtype=torch.int8,
        scale_dim=4,
        scale_dtype=torch.float32,
        tokens_per_state=4,
        model_version="deepseek_v4",
    )
    return {
        "bf16 (k, v)": Scenario(
            # paged-attention layers: K and V apart
            "bf16_kv",
            [_layers(dense, ATTN)],
            contiguous_pa=True,
        ),
        "bf16 (k, v) interleaved in one allocation": Scenario(
            "bf16_kv_strided", [_layers(dense, ATTN)]
        ),
        # kv_c8.py:125 sets the layer's cache dtype to int8; its scales are
        # per-layer weights (kv_c8.py:132-139), not cache.
        "C8 INT8 dense (k, v)": Scenario(
            "c8_int8",
            [_layers(replace(dense, dtype=torch.int8), ATTN)],
            cache_dtype="int8",
        ),
        "MLA (nope, rope)": Scenario("mla", [_layers(mla, MLA, _mla_layer)]),
        # fa_quant layer (:6238-6239): head_size = 576 + 64, int8.
        "MLA C8 (int8 nope, bf16 rope)": Scenario(
            "mla_c8",
            [_layers(replace(mla, head_size=640, dtype=torch.int8), MLA, _mla_layer)],
            cache_dtype="int8",
            fa_quant=True,
            quant_config=kv_quant,
        ),
        # 512-token kernel blocks: the C8-MXFP backend's only size
        # (attention_c8_mxfp.py:397-399).
        "C8-MXFP (k, v, k_scale, v_scale)": Scenario(
            "c8_mxfp", [mxfp_layers(512)], kernel_block_sizes=[512], cache_dtype="mxfp8"
        ),
        # A larger scheduler block spans several kernel packets
        # (mxfp_cache_views_for_spec, attention_c8_mxfp.py:236-252).
        "C8-MXFP, 1024-token blocks over 512-token kernel blocks": Scenario(
            "c8_mxfp_1024",
            [mxfp_layers(1024)],
            kernel_block_sizes=[512],
            cache_dtype="mxfp8",
        ),
        "DSA: MLA (nope, rope) + indexer C8 (k, scale)": Scenario(
            "dsa", [{**_layers(mla, SFA, _mla_layer), **indexers_c8()}], use_sparse=True
        ),
        "sparse-SFA C8 packed latent + indexer C8 (k, scale)": Scenario(
            "sfa_c8",
            [{**_layers(sfa_c8, SFA, _mla_layer), **indexers_c8()}],
            use_sparse=True,
            cache_dtype="int8",
            c8_cache_dtype=torch.int8,
        ),
        "hybrid attention + Mamba": Scenario(
            "qwen3_next",
            [
                _layers(replace(dense, block_size=64), ATTN, ids=(1, 3)),
                _layers(
                    mamba, None, name="model.layers.{}.linear_attn".format, ids=(0, 2)
                ),
            ],
        ),
        "DSV4 indexer: (k, scale) + overlapping full-page view": Scenario(
            "dsv4",
            [_layers(dsv4, MLA, name=_indexer, ids=range(1))],
            layout=KVCacheLayout.BLHNC,
            use_compress=True,
            capabilities=frozenset({"DSV4_COMPRESSED_CACHE"}),
        ),
    }
