"""KV sizing from config.json alone: a CPU block's bytes and how many fit.

Expected numbers are worked out by hand from the formula, written out next
to each; one test checks the result against vLLM's own ModelConfig and
KV-cache spec for the same configs. ``size_kv`` (conftest) sizes a dict by
writing it as a model directory's config.json.
"""

import pytest

from tests.unit.model_configs import (
    DEEPSEEK_V2_LITE,
    LLAMA2_7B_MHA,
    LLAMA3_8B,
    QWEN3_0_6B,
    QWEN3_NEXT_80B,
    tiny_qwen3_config,
    write_model,
)
from vllm_ascend.kv_offload import host_guard
from vllm_ascend.kv_offload.host_guard import (
    AUTO_POOL_SHARE,
    HostBudget,
    auto_num_cpu_blocks,
    fit_host_memory,
)
from vllm_ascend.kv_offload.sizing import (
    CPU_BLOCK_ALIGNMENT,
    SizingError,
    UnsupportedModelError,
    size_model_dir,
)


@pytest.mark.parametrize(
    ("config", "kwargs", "expected"),
    [
        # 2 (K, V) * 28 layers * 8 KV heads * 128 head dim * 2 bytes (bf16)
        # * 128 tokens = 14,680,064 bytes, a multiple of the 4 KiB page; one
        # device block of 128 tokens: K and V, 8 * 128 * 2 * 128 bytes each.
        (QWEN3_0_6B, {"block_size": 128}, {
            "attention": "gqa", "num_attention_layers": 28, "kv_heads_per_worker": 8,
            "head_size": 128, "kv_cache_dtype": "bfloat16", "exact": True,
            "bytes_per_token_per_layer": 2 * 8 * 128 * 2,
            "worker_bytes_per_cpu_block": 2 * 28 * 8 * 128 * 2 * 128,
            "bytes_per_cpu_block": 14_680_064, "fragment_bytes": (262_144, 262_144),
        }),
        # 2 (K, V) * 2 layers * 2 KV heads * 32 * 2 bytes (float32 served as
        # bf16) * 128 tokens = 65,536 bytes: the row size the e2e engines log,
        # "CPU block pool of 1000 blocks x 65536 bytes" (docs/user_guide.md).
        (tiny_qwen3_config(), {}, {
            "worker_bytes_per_cpu_block": 2 * 2 * 2 * 32 * 2 * 128,
        }),
        # Llama: head size 4096 / 32 = 128; 2 * 32 layers * 8 KV heads * 128
        # * 2 bytes * 128 tokens = 16,777,216 bytes.
        (LLAMA3_8B, {}, {"head_size": 128, "bytes_per_cpu_block": 16_777_216}),
        # MHA without a KV head key: one KV head per head; 2 * 32 layers
        # * 32 KV heads * 128 * 2 bytes (fp16) * 128 tokens.
        (LLAMA2_7B_MHA, {}, {
            "attention": "mha", "kv_heads_per_worker": 32,
            "bytes_per_cpu_block": 2 * 32 * 32 * 128 * 2 * 128,
        }),
        # DeepSeek MLA, one latent per layer: (kv_lora_rank 512 +
        # qk_rope_head_dim 64) * 2 bytes * 27 layers * 128 tokens = 3,981,312
        # bytes (972 pages of 4 KiB); the Ascend layout keeps the latent as
        # nope (512) and rope (64) tensors.
        (DEEPSEEK_V2_LITE, {}, {
            "attention": "mla", "kv_heads_per_worker": 1, "head_size": 576,
            "bytes_per_cpu_block": 27 * (512 + 64) * 2 * 128,
            "fragment_bytes": (512 * 2 * 128, 64 * 2 * 128),
        }),
        # Tensor parallel splits KV heads and counts every worker: 8 KV heads
        # on 2 workers, 4 each, 2 * 28 * 4 * 128 * 2 * 128 = 7,340,032 bytes
        # per worker; a CPU block over both is twice that.
        (QWEN3_0_6B, {"tensor_parallel_size": 2}, {
            "kv_heads_per_worker": 4, "worker_bytes_per_cpu_block": 7_340_032,
            "bytes_per_cpu_block": 14_680_064,
        }),
        # More workers than KV heads replicate one head: 8 KV heads on 16
        # workers, 1 each; 2 * 28 * 1 * 128 * 2 * 128 per worker, 16 workers.
        (QWEN3_0_6B, {"tensor_parallel_size": 16}, {
            "kv_heads_per_worker": 1, "worker_bytes_per_cpu_block": 1_835_008,
            "bytes_per_cpu_block": 16 * 1_835_008,
        }),
        # kv_cache_dtype overrides the checkpoint's: fp8 is half of bf16, and
        # DeepSeek's sparse fp8 MLA cache holds 656 bytes per token and layer.
        (QWEN3_0_6B, {"kv_cache_dtype": "fp8"}, {"bytes_per_cpu_block": 7_340_032}),
        (DEEPSEEK_V2_LITE, {"kv_cache_dtype": "fp8_ds_mla"}, {
            "worker_bytes_per_cpu_block": 27 * 656 * 128,
        }),
        # block_size is tokens per CPU block: 256 = 2 device blocks of 128.
        (QWEN3_0_6B, {"block_size": 256}, {
            "bytes_per_cpu_block": 2 * 14_680_064, "blocks_per_chunk": 2,
        }),
    ],
    ids=[
        "qwen3-gqa-guide", "tiny-test-model", "llama-head-size-from-hidden",
        "mha-without-kv-heads", "deepseek-mla", "tp2-splits-kv-heads",
        "tp16-replicates-one-head", "fp8", "fp8-ds-mla", "block-size-256",
    ],
)  # fmt: skip
def test_sizing_by_hand(config, kwargs, expected, size_kv):
    s = size_kv(config, **kwargs)
    assert {k: getattr(s, k) for k in expected} == expected


def test_model_dir_needs_only_config_json(tmp_path):
    d = write_model(tmp_path, QWEN3_0_6B)
    assert size_model_dir(d).bytes_per_cpu_block == 14_680_064
    assert size_model_dir(d / "config.json").bytes_per_cpu_block == 14_680_064


def test_mla_latent_is_stored_once_for_all_tensor_parallel_workers(size_kv):
    """Every worker holds the same latent: vLLM calls the layout replicated
    and the workers of the host share one copy (replication.py)."""
    s = size_kv(DEEPSEEK_V2_LITE, tensor_parallel_size=2)
    assert s.worker_bytes_per_cpu_block == 3_981_312
    assert s.stored_copies == 1
    assert s.bytes_per_cpu_block == 3_981_312  # a multiple of the page size
    assert "stores it once" in " ".join(s.notes)
    # The host-memory fit counts one pool, not one per worker.
    fit = fit_host_memory(s, available_bytes=10 * 2**30)
    assert fit.workers_on_host == 1
    assert fit.max_num_cpu_blocks == int(10 * 2**30 * 0.9) // 3_981_312


def test_float32_checkpoint_is_served_as_bfloat16_like_vllm_auto(size_kv):
    fp32 = dict(QWEN3_0_6B, torch_dtype="float32")
    assert size_kv(fp32).kv_cache_dtype == "bfloat16"
    assert size_kv(fp32, dtype="float32").kv_cache_dtype == "float32"
    # Newer transformers write "dtype" instead of "torch_dtype".
    new_key = {k: v for k, v in QWEN3_0_6B.items() if k != "torch_dtype"}
    assert size_kv(dict(new_key, dtype="float16")).kv_cache_dtype == "float16"


def test_cpu_block_over_workers_is_padded_to_a_page(size_kv):
    # One MLA layer of (100 + 12) * 2 bytes * 16 tokens = 3,584 bytes,
    # padded to one 4 KiB page as vLLM's spec does.
    tiny = {
        "model_type": "deepseek_v2",
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "kv_lora_rank": 100,
        "qk_rope_head_dim": 12,
        "torch_dtype": "bfloat16",
    }
    s = size_kv(tiny, block_size=16, device_block_size=16)
    assert s.worker_bytes_per_cpu_block == 3_584
    assert s.bytes_per_cpu_block == CPU_BLOCK_ALIGNMENT == 4096


def test_multimodal_config_sizes_its_text_model(size_kv):
    # vLLM's ModelConfig inspects the multimodal model class, whose module
    # imports torchvision (not installed on the CPU test machine).
    pytest.importorskip("torchvision")
    vl = {
        "model_type": "qwen3_vl",
        "torch_dtype": "bfloat16",
        "text_config": {k: v for k, v in QWEN3_0_6B.items() if k != "torch_dtype"},
        "vision_config": {"depth": 24},
    }
    assert size_kv(vl).bytes_per_cpu_block == 14_680_064


def test_hybrid_model_counts_attention_layers_as_a_lower_bound(size_kv):
    # 48 layers, full attention every 4th: 12 attention layers;
    # 2 * 12 * 2 KV heads * 256 * 2 bytes * 128 tokens = 3,145,728 bytes.
    s = size_kv(QWEN3_NEXT_80B)
    assert (s.num_attention_layers, s.num_state_layers) == (12, 36)
    assert s.bytes_per_cpu_block == 2 * 12 * 2 * 256 * 2 * 128 == 3_145_728
    assert not s.exact
    assert any("lower" in n or "at least" in n for n in s.notes)


def test_layer_types_list_marks_attention_layers(size_kv):
    # A hybrid model (Qwen3-Next: linear attention next to full attention).
    layers = ["linear_attention", "linear_attention", "full_attention"] * 2
    cfg = dict(QWEN3_NEXT_80B, num_hidden_layers=6, layer_types=layers)
    s = size_kv(cfg)
    assert (s.num_attention_layers, s.num_state_layers) == (2, 4)
    # Sliding-window layers hold pages of the same size per token.
    layers = ["sliding_attention", "full_attention"] * 3
    sliding = dict(QWEN3_0_6B, num_hidden_layers=6, layer_types=layers)
    assert size_kv(sliding).exact


MLA_NO_ROPE = {k: v for k, v in DEEPSEEK_V2_LITE.items() if k != "qk_rope_head_dim"}
UNSUPPORTED = {"index_topk", "block_configs", "encoder-decoder", "no attention layers"}


@pytest.mark.parametrize(
    ("config", "kwargs", "named"),
    [
        ({**QWEN3_0_6B, "num_hidden_layers": None}, {}, "num_hidden_layers"),
        ({**QWEN3_0_6B, "num_attention_heads": None}, {}, "num_attention_heads"),
        ({**QWEN3_0_6B, "head_dim": None, "hidden_size": None}, {}, "hidden_size"),
        ({**QWEN3_0_6B, "num_key_value_heads": 0}, {}, "num_key_value_heads"),
        ({**QWEN3_0_6B, "index_topk": 2048}, {}, "index_topk"),
        ({**QWEN3_0_6B, "block_configs": [{}]}, {}, "block_configs"),
        ({**QWEN3_0_6B, "torch_dtype": "complex64"}, {}, "--dtype"),
        ({**QWEN3_0_6B, "is_encoder_decoder": True}, {}, "encoder-decoder"),
        ({**QWEN3_0_6B, "layer_types": ["full_attention"]}, {}, "layer_types"),
        # A hybrid model without attention layers.
        ({**QWEN3_NEXT_80B, "layer_types": ["linear_attention"] * 48}, {},
         "no attention layers"),
        (MLA_NO_ROPE, {}, "qk_rope_head_dim"),
        # Bad settings name the flag.
        (QWEN3_0_6B, {"block_size": 100}, "--block-size=100"),
        (QWEN3_0_6B, {"block_size": 0}, "--block-size"),
        (QWEN3_0_6B, {"tensor_parallel_size": 3}, "--tensor-parallel-size=3"),
        (QWEN3_0_6B, {"kv_cache_dtype": "int3"}, "--kv-cache-dtype"),
        (QWEN3_0_6B, {"kv_cache_dtype": "fp8_ds_mla"}, "MLA"),
    ],
)  # fmt: skip
def test_what_it_cannot_size_is_refused_by_name(config, kwargs, named, size_kv):
    # Layouts the formulas do not describe are unsupported: the doctor warns.
    error = UnsupportedModelError if named in UNSUPPORTED else SizingError
    with pytest.raises(error, match=named):
        size_kv(config, **kwargs)


def test_a_config_vllm_cannot_load_is_refused_with_vllms_reason(size_kv):
    # A model_type that neither transformers nor vLLM knows.
    cfg = dict(QWEN3_0_6B, model_type="no_such_model", architectures=["NoSuch"])
    with pytest.raises(UnsupportedModelError, match="vLLM's ModelConfig cannot load"):
        size_kv(cfg)


def test_missing_or_broken_config_json(tmp_path):
    # Said for the API as for the doctor's and the examples' --model.
    with pytest.raises(SizingError, match="no config.json") as refused:
        size_model_dir(tmp_path)
    assert "give a local Hugging Face model directory" in str(refused.value)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SizingError, match="not readable JSON"):
        size_model_dir(tmp_path)


def _guard_accepts(available, sizing, num_blocks) -> bool:
    """What the worker's guard says, with ``available`` bytes of host memory
    and no other pool on the host."""
    request = host_guard.PoolRequest(
        num_blocks=num_blocks,
        row_bytes=sizing.worker_bytes_per_cpu_block,
        key="num_cpu_blocks",
        setting=f"num_cpu_blocks={num_blocks}",
        all_workers_block_bytes=sizing.bytes_per_cpu_block,
        blocks_per_chunk=sizing.blocks_per_chunk,
        chunk_key="block_size",
        device_block_tokens=sizing.device_block_size,
    )
    return host_guard.check_pool(request, host_guard.HostBudget(available)) is None


@pytest.mark.parametrize(
    ("config", "available", "reserved", "workers"),
    [(QWEN3_0_6B, 24 * 2**30 + 12345, 0, None),
     (DEEPSEEK_V2_LITE, 24 * 2**30 + 12345, 0, None),
     (LLAMA3_8B, 24 * 2**30 + 12345, 0, None),
     (QWEN3_0_6B, 16 * 2**30 + 999, 3 * 2**30, 1)],  # memory reserved beside
)  # fmt: skip
def test_max_num_cpu_blocks_is_the_largest_the_guard_accepts(
    config, available, reserved, workers, size_kv
):
    s = size_kv(config)
    fit = fit_host_memory(
        s, available_bytes=available, reserved_bytes=reserved, workers_on_host=workers
    )
    assert fit.max_num_cpu_blocks > 0
    # The guard runs after the reserved memory is allocated.
    after = available - reserved
    assert _guard_accepts(after, s, fit.max_num_cpu_blocks)
    assert not _guard_accepts(after, s, fit.max_num_cpu_blocks + 1)
    # cpu_bytes_to_use holds exactly that many blocks (vLLM divides by the
    # padded CPU block).
    assert fit.cpu_bytes_to_use // s.bytes_per_cpu_block == fit.max_num_cpu_blocks


def test_guide_config_on_a_24_gib_host(size_kv):
    # 90% of 24 GiB = 23,192,823,398 bytes; / 14,680,064 = 1579 blocks.
    fit = fit_host_memory(size_kv(QWEN3_0_6B), available_bytes=24 * 2**30)
    assert fit.usable_bytes == int(24 * 2**30 * 0.9) == 23_192_823_398
    assert fit.max_num_cpu_blocks == 23_192_823_398 // 14_680_064 == 1579
    assert fit.cpu_bytes_to_use == 1579 * 14_680_064


def test_reserved_memory_and_workers_on_host_shrink_the_fit(size_kv):
    s = size_kv(QWEN3_0_6B, tensor_parallel_size=2)
    gib = 2**30
    # Two workers' pools on this host, 4 GiB kept for the device KV cache:
    # 90% of 20 GiB = 19,327,352,832 bytes; / (2 * 7,340,032) = 1316 blocks.
    fit = fit_host_memory(s, available_bytes=24 * gib, reserved_bytes=4 * gib)
    assert fit.max_num_cpu_blocks == int(20 * gib * 0.9) // (2 * 7_340_032) == 1316
    one = fit_host_memory(s, available_bytes=24 * gib, workers_on_host=1)
    assert one.max_num_cpu_blocks == int(24 * gib * 0.9) // 7_340_032
    none = fit_host_memory(s, available_bytes=gib, reserved_bytes=2 * gib)
    assert none.max_num_cpu_blocks == 0


def test_fit_reads_host_memory_now_by_default(monkeypatch, host_ledger_dir, size_kv):
    monkeypatch.setattr(host_guard, "host_available_bytes", lambda: 10 * 14_680_064)
    fit = fit_host_memory(size_kv(QWEN3_0_6B))
    assert fit.available_bytes == 10 * 14_680_064
    assert fit.max_num_cpu_blocks == 9  # 90% of 10 blocks


def test_auto_takes_a_share_of_what_the_guard_accepts_next_to_the_engine():
    # 90% of (24 GiB - 6 GiB engine) = 17,394,617,548 bytes; half of it
    # = 8,697,308,774; / 14,680,064 = 592 blocks.
    gib = 2**30
    assert AUTO_POOL_SHARE == 0.5
    assert (
        auto_num_cpu_blocks(14_680_064, HostBudget(24 * gib, reserved=6 * gib)) == 592
    )
    assert auto_num_cpu_blocks(
        14_680_064, HostBudget(24 * gib, reserved=6 * gib), share=1.0
    ) == (host_guard.usable_bytes(24 * gib, 6 * gib) // 14_680_064)
    assert auto_num_cpu_blocks(14_680_064, HostBudget(24 * gib, reserved=30 * gib)) == 0
    with pytest.raises(SizingError, match="share"):
        auto_num_cpu_blocks(14_680_064, HostBudget(gib), share=0)


def _cpu_backend_quantised_dtypes() -> list[str]:
    """The quantised KV dtypes vLLM's CPU attention backend declares, read
    from vLLM (not a copy of its list)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return [d for d in CPUAttentionBackend.supported_kv_cache_dtypes if d != "auto"]


@pytest.mark.parametrize(
    ("config", "tp", "kv_cache_dtype"),
    [
        (QWEN3_0_6B, 1, "auto"),
        (QWEN3_0_6B, 2, "auto"),
        (LLAMA3_8B, 4, "auto"),
        (DEEPSEEK_V2_LITE, 2, "auto"),
        (tiny_qwen3_config(), 1, "auto"),
        # Quantised KV, against the pages vLLM's CPU backend allocates.
        *[
            (config, 1, dtype)
            for config in (QWEN3_0_6B, tiny_qwen3_config())
            for dtype in _cpu_backend_quantised_dtypes()
        ],
    ],
)
def test_formula_matches_vllms_model_config_and_kv_spec(
    tmp_path, vllm_model_config, config, tp, kv_cache_dtype, size_kv
):
    from vllm.config import ParallelConfig
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        get_kv_quant_mode,
    )

    mc = vllm_model_config(write_model(tmp_path, config))
    parallel = ParallelConfig(tensor_parallel_size=tp)
    ours = size_kv(config, tensor_parallel_size=tp, kv_cache_dtype=kv_cache_dtype)
    heads = mc.get_num_kv_heads(parallel)
    assert heads == ours.kv_heads_per_worker
    assert mc.get_head_size() == ours.head_size
    assert mc.get_num_layers(ParallelConfig()) == ours.num_attention_layers
    assert mc.use_mla == (ours.attention == "mla")
    if kv_cache_dtype == "auto":
        assert str(mc.dtype).removeprefix("torch.") == ours.kv_cache_dtype
    if mc.use_mla:
        spec = MLAAttentionSpec(
            block_size=ours.block_size,
            num_kv_heads=heads,
            head_size=mc.get_head_size(),
            dtype=mc.dtype,
        )
    else:
        # As vLLM's attention layer builds it for this dtype, then as the
        # CPU backend customises it (it adds no scale bytes: fp8 scales are
        # per-tensor floats on the layer, not part of the KV cache).
        spec = CPUAttentionBackend.customize_spec(
            FullAttentionSpec(
                block_size=ours.block_size,
                num_kv_heads=heads,
                head_size=mc.get_head_size(),
                dtype=kv_cache_dtype_str_to_dtype(kv_cache_dtype, mc),
                kv_quant_mode=get_kv_quant_mode(kv_cache_dtype),
            )
        )
    layers = ours.num_attention_layers
    assert spec.page_size_bytes * layers == ours.worker_bytes_per_cpu_block
    assert ours.dtype_bytes == spec.dtype.itemsize
