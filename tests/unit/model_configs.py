"""config.json shapes of public checkpoints (the keys KV sizing reads, plus
a few it must ignore), shared by test_sizing.py and test_doctor.py; and the
sample model directories of docs/first_run.md, which
``python -m tests.unit.model_configs [DIR]`` writes (default /tmp/models)."""

import json
import sys
from pathlib import Path

# Shapes of public checkpoints' config.json (the keys sizing reads, plus a
# few it must ignore).
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
}
LLAMA3_8B = {  # no head_dim: head size is hidden_size / num_attention_heads
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
}
LLAMA2_7B_MHA = {  # no num_key_value_heads: one KV head per attention head
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "torch_dtype": "float16",
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "torch_dtype": "bfloat16",
    "vocab_size": 102400,
    "max_position_embeddings": 163840,
}
QWEN3_NEXT_80B = {  # hybrid: every 4th layer is full attention
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "torch_dtype": "bfloat16",
}


def tiny_qwen3_config() -> dict:
    """The repository's generated test model (testing/tiny_model.py), as its
    config.json reads: float32, which vLLM serves in 16 bits."""
    from vllm_ascend.kv_offload.testing.tiny_model import TinyModelSpec

    spec = TinyModelSpec()
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "torch_dtype": "float32",
    }


def write_model(tmp_path, config, name="model"):
    """A model directory holding only ``config`` as its config.json."""
    d = tmp_path / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return d


# docs/first_run.md's sample directories: config.json alone (no model hub).
DOC_SAMPLES = {
    "Qwen3-0.6B": QWEN3_0_6B,
    "Qwen3-0.6B-bad": {**QWEN3_0_6B, "head_dim": "32"},
    "DeepSeek-V2-Lite": DEEPSEEK_V2_LITE,
    "DeepSeek-V3.2-like": {**DEEPSEEK_V2_LITE, "index_topk": 2048},
}


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/models")
    for name, config in DOC_SAMPLES.items():
        print(write_model(root, config, name))
