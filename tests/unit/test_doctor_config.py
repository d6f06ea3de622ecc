"""The doctor validates a model's config.json before it sizes: every size it
reads is a positive integer within a documented bound, or the doctor exits 1
with one line naming the key and the value; a model layout it cannot size is
a warning, not a broken machine; its copy checks allocate a small, bounded
amount whatever the model. Run in-process: the doctor's ``main`` with argv."""

from __future__ import annotations

import json

import pytest

from tests.unit.model_configs import (
    DEEPSEEK_V2_LITE,
    LLAMA3_8B,
    QWEN3_0_6B,
    QWEN3_NEXT_80B,
)
from vllm_ascend.kv_offload import doctor, self_check

NO_COPY_CHECKS = ["--alloc-mib", "0", "--bandwidth-mib", "0"]


def run_doctor(tmp_path, capsys, config: dict, *args: str) -> tuple[int, list[str]]:
    """The doctor's exit status and output lines for a model directory
    holding ``config`` as its config.json."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    rc = doctor.main(["--model", str(tmp_path), *args])
    return rc, capsys.readouterr().out.splitlines()


def sizing_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line[7:].startswith("sizing")]


def without(config: dict, *keys: str) -> dict:
    return {k: v for k, v in config.items() if k not in keys}


@pytest.mark.parametrize(
    "config, line",
    [
        ({**QWEN3_0_6B, "head_dim": "32"}, "head_dim='32' must be a positive integer"),
        ({**QWEN3_0_6B, "head_dim": 32.5}, "head_dim=32.5 must be a positive integer"),
        ({**QWEN3_0_6B, "head_dim": -32}, "head_dim=-32 must be a positive integer"),
        ({**QWEN3_0_6B, "head_dim": 0}, "head_dim=0 must be a positive integer"),
        ({**QWEN3_0_6B, "head_dim": True}, "head_dim=True must be a positive integer"),
        ({**QWEN3_0_6B, "head_dim": 2**19}, "head_dim=524288 is above 4096"),
        ({**QWEN3_0_6B, "num_hidden_layers": 10**6},
         "num_hidden_layers=1000000 is above 1024"),
        ({**QWEN3_0_6B, "num_attention_heads": "16"},
         "num_attention_heads='16' must be a positive integer"),
        ({**QWEN3_0_6B, "num_key_value_heads": -8},
         "num_key_value_heads=-8 must be a positive integer"),
        ({**without(QWEN3_0_6B, "head_dim"), "hidden_size": 8},
         "hidden_size=8 // num_attention_heads=16 gives a head size of 0"),
        ({**without(QWEN3_0_6B, "head_dim"), "hidden_size": 65536,
          "num_attention_heads": 8, "num_key_value_heads": 8},
         "hidden_size=65536 // num_attention_heads=8 gives a head size of "
         "8192, not in 1..4096"),
        ({**QWEN3_0_6B, "hidden_size": 10**9}, "hidden_size=1000000000 is above"),
        ({**DEEPSEEK_V2_LITE, "kv_lora_rank": "512"},
         "kv_lora_rank='512' must be a positive integer"),
        ({**DEEPSEEK_V2_LITE, "qk_rope_head_dim": 0},
         "qk_rope_head_dim=0 must be a positive integer"),
        ({"model_type": "llava", "text_config": {**QWEN3_0_6B, "head_dim": 64.0}},
         "head_dim=64.0 must be a positive integer"),
    ],
    ids=[
        "head_dim-string", "head_dim-float", "head_dim-negative", "head_dim-zero",
        "head_dim-bool", "head_dim-huge", "layers-huge", "heads-string",
        "kv-heads-negative", "hidden-less-than-heads", "derived-head-size-huge",
        "hidden-huge", "mla-rank-string", "mla-rope-zero", "nested-text-config",
    ],
)  # fmt: skip
def test_an_invalid_size_exits_1_with_one_line_naming_key_and_value(
    tmp_path, capsys, config, line
):
    rc, lines = run_doctor(tmp_path, capsys, config, *NO_COPY_CHECKS)
    assert rc == 1
    (sizing,) = sizing_lines(lines)
    assert sizing.startswith("[FAIL] sizing")
    assert f"config.json: {line}" in sizing
    assert "crashed" not in sizing and "fits now" not in "\n".join(lines)
    assert lines[-1].startswith("BROKEN: sizing failed")


@pytest.mark.parametrize(
    "config, why",
    [
        ({**QWEN3_0_6B, "index_topk": 2048}, "config.json has index_topk"),
        ({**QWEN3_0_6B, "is_encoder_decoder": True}, "encoder-decoder"),
        # A hybrid model whose every layer is linear attention.
        ({**QWEN3_NEXT_80B, "layer_types": ["linear_attention"] * 48},
         "no attention layers"),
        ({**QWEN3_0_6B, "model_type": "no_such_model",
          "architectures": ["NoSuchForCausalLM"]},
         "vLLM's ModelConfig cannot load"),  # vLLM's reason follows
    ],
    ids=["sparse-indexer", "encoder-decoder", "no-attention", "vllm-cannot-load"],
)  # fmt: skip
def test_a_model_it_cannot_size_is_a_warning_not_broken(tmp_path, capsys, config, why):
    rc, lines = run_doctor(tmp_path, capsys, config, *NO_COPY_CHECKS)
    assert rc == 0
    (sizing,) = sizing_lines(lines)
    assert sizing.startswith("[warn] sizing      cannot size this model: ")
    assert why in sizing
    assert lines[-1].startswith("OK")


def test_a_json_null_size_is_an_absent_one(tmp_path, capsys):
    # Configs write "head_dim": null; the head size is then hidden_size's
    # (Llama's rule; transformers refuses a null head_dim for Qwen3).
    config = {**LLAMA3_8B, "hidden_size": 1024, "num_attention_heads": 16}
    config["head_dim"] = None
    rc, lines = run_doctor(tmp_path, capsys, config, *NO_COPY_CHECKS)
    assert rc == 0
    assert "head size 64" in "\n".join(lines)  # 1024 // 16


def test_copy_checks_allocate_a_bounded_amount_whatever_the_model(
    tmp_path, capsys, monkeypatch
):
    # Valid sizes near the bounds: one K page of a 128-token device block is
    # 64 heads * 4096 * 4 bytes * 128 = 128 MiB.
    config = {
        **QWEN3_0_6B,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "head_dim": 4096,
        "torch_dtype": "float32",
    }
    checked: list[list[int]] = []
    real = self_check.run_self_check

    def spy(device, fragment_sizes):
        checked.append(list(fragment_sizes))
        return real(device, fragment_sizes)

    monkeypatch.setattr(self_check, "run_self_check", spy)
    args = ["--alloc-mib", "0", "--bandwidth-mib", "1", "--rounds", "1", "--json"]
    args += ["--kv-cache-dtype", "float32"]
    rc, lines = run_doctor(tmp_path, capsys, config, *args)
    report = json.loads("\n".join(lines))
    assert rc == 0, report["checks"]
    assert report["sizing"]["fragment_bytes"] == [128 << 20, 128 << 20]
    assert checked and max(max(c) for c in checked) <= 8 << 20
    rows = report["bandwidth"]
    assert rows and max(r["fragment_bytes"] for r in rows) <= 8 << 20


# GPT-2's config.json names its sizes n_layer / n_head / n_embd; transformers
# maps them (attribute_map), as vLLM reads them.
GPT2 = {
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "n_layer": 12,
    "n_head": 12,
    "n_embd": 768,
    "torch_dtype": "float16",
}


def test_a_model_with_its_own_key_names_is_sized_as_vllm_reads_it(tmp_path, capsys):
    rc, lines = run_doctor(tmp_path, capsys, GPT2, *NO_COPY_CHECKS, "--json")
    report = json.loads("\n".join(lines))
    assert rc == 0, report["checks"]
    # 2 (K, V) * 12 layers * 12 heads * 64 (768 / 12) * 2 bytes * 128 tokens.
    assert report["bytes_per_cpu_block"] == 2 * 12 * 12 * 64 * 2 * 128 == 4_718_592


def test_a_bad_host_budget_setting_fails_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_KV_OFFLOAD_HOST_BUDGET", "lots")
    rc, lines = run_doctor(tmp_path, capsys, QWEN3_0_6B, *NO_COPY_CHECKS)
    assert rc == 1
    (sizing,) = sizing_lines(lines)
    assert sizing.startswith("[FAIL] sizing      VLLM_ASCEND_KV_OFFLOAD_HOST_BUDGET")
    assert "crashed" not in sizing
