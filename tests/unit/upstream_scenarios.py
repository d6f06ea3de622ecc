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
    kv_quant = upstream.kv_quant()
    kv_quant.enable_fa_quant = True  # a ModelSlim C8 checkpoint's setting
    kv_quant.kvcache_quant_layers = {0, 1}

    def mxfp_layers(block_size: int):
        return {
            _attn(i): (
                # mxfp_cache_spec of vLLM's spec (:6185).
                ns["mxfp_cache_spec"](
                    FullAttentionSpec(
                        block_size=block_size, num_kv_heads=2, head_size=128, dtype=bf16
                    )
                ),
                C8MXFPLayer(torch.randint(0, 256, (2 * 128,), dtype=torch.uint8)),
                ATTN,
            )
            for i in range(2)
        }

    return {
        "bf16 (k, v)": Scenario(
            "bf16_kv",
            [{_attn(i): (dense, Layer(), ATTN) for i in range(2)}],
            contiguous_pa=True,  # paged-attention layers: K and V apart
        ),
        "bf16 (k, v) interleaved in one allocation": Scenario(
            "bf16_kv_strided",
            [{_attn(i): (dense, Layer(), ATTN) for i in range(2)}],
        ),
        "C8 INT8 dense (k, v)": Scenario(
            # kv_c8.py:125 sets the layer's cache dtype to int8; its scales
            # are per-layer weights (kv_c8.py:132-139), not cache.
            "c8_int8",
            [
                {
                    _attn(i): (replace(dense, dtype=torch.int8), Layer(), ATTN)
                    for i in range(2)
                }
            ],
            cache_dtype="int8",
        ),
        "MLA (nope, rope)": Scenario(
            "mla",
            [{_attn(i): (mla, MLALayer(512, 64), MLA) for i in range(2)}],
        ),
        "MLA C8 (int8 nope, bf16 rope)": Scenario(
            # fa_quant layer (:6238-6239): head_size = 576 + 64, int8.
            "mla_c8",
            [
                {
                    _attn(i): (
                        replace(mla, head_size=640, dtype=torch.int8),
                        MLALayer(512, 64),
                        MLA,
                    )
                    for i in range(2)
                }
            ],
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
            "dsa",
            [
                {
                    **{_attn(i): (mla, MLALayer(512, 64), SFA) for i in range(2)},
                    **{_indexer(i): (indexer_c8, Layer(), INDEXER) for i in range(2)},
                }
            ],
            use_sparse=True,
        ),
        "sparse-SFA C8 packed latent + indexer C8 (k, scale)": Scenario(
            # :6207-6235: one int8 row of latent, bf16 rope and fp32 tile
            # scales (get_sfa_qsfa_packed_head_dim).
            "sfa_c8",
            [
                {
                    **{
                        _attn(i): (
                            replace(
                                mla,
                                head_size=ns["get_sfa_qsfa_packed_head_dim"](512, 64),
                                dtype=torch.int8,
                                cache_dtype_str="int8",
                                cache_sparse_sfa_c8=True,
                            ),
                            MLALayer(512, 64),
                            SFA,
                        )
                        for i in range(2)
                    },
                    **{_indexer(i): (indexer_c8, Layer(), INDEXER) for i in range(2)},
                }
            ],
            use_sparse=True,
            cache_dtype="int8",
            c8_cache_dtype=torch.int8,
        ),
        "hybrid attention + Mamba": Scenario(
            "qwen3_next",
            [
                {
                    _attn(i): (replace(dense, block_size=64), Layer(), ATTN)
                    for i in (1, 3)
                },
                {
                    f"model.layers.{i}.linear_attn": (
                        # Padded to the attention page, as vLLM unifies
                        # hybrid page sizes.
                        MambaSpec(
                            block_size=64,
                            shapes=((3, 256), (4, 32, 32)),
                            dtypes=(bf16, torch.float32),
                            page_size_padded=replace(
                                dense, block_size=64
                            ).page_size_bytes,
                        ),
                        Layer(),
                        None,
                    )
                    for i in (0, 2)
                },
            ],
        ),
        "DSV4 indexer: (k, scale) + overlapping full-page view": Scenario(
            # _reshape_kv_cache_tensors, :5520-5535: with
            # DSV4_COMPRESSED_CACHE the layer also gets a full view of the
            # same page bytes (overlap_full_kv_cache).
            "dsv4",
            [
                {
                    _indexer(i): (
                        specs.AscendMLAAttentionSpec(
                            block_size=128,
                            num_kv_heads=1,
                            head_size=128,
                            dtype=torch.int8,
                            scale_dim=4,
                            scale_dtype=torch.float32,
                            tokens_per_state=4,
                            model_version="deepseek_v4",
                        ),
                        Layer(),
                        MLA,
                    )
                    for i in range(1)
                }
            ],
            layout=KVCacheLayout.BLHNC,
            use_compress=True,
            capabilities=frozenset({"DSV4_COMPRESSED_CACHE"}),
        ),
    }
