"""The doctor against model directories holding only a config.json, run in
this process through its ``main(argv)`` (what the console script calls),
and once as a user runs it (``python -m``) where only a fresh interpreter
can show it: a platform plugin that fails to import.

It validates a model's config.json before it sizes: every size it reads is
a positive integer within a documented bound, or the doctor exits 1 with one
line naming the key and the value; a model layout it cannot size is a
warning, not a broken machine; its copy checks allocate a small, bounded
amount whatever the model."""

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from tests.unit.conftest import NO_COPY_CHECKS, run_doctor
from tests.unit.model_configs import (
    DEEPSEEK_V2_LITE,
    LLAMA3_8B,
    QWEN3_0_6B,
)
from vllm_ascend.kv_offload import ops, self_check
from vllm_ascend.kv_offload.copy_paths import candidate_paths

ROOT = Path(__file__).resolve().parents[2]
# Small test sizes: the checks, not the figures, are under test here.
FAST = ["--alloc-mib", "8", "--bandwidth-mib", "2", "--rounds", "1"]


def without(config: dict, *keys: str) -> dict:
    return {k: v for k, v in config.items() if k not in keys}


def doctor_on(tmp_path, config: dict, *args: str) -> tuple[int, list[str]]:
    """The doctor's exit status and output lines for a model directory
    holding ``config`` as its config.json."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc, out = run_doctor("--model", str(tmp_path), *args)
    return rc, out.splitlines()


def doctor_json(tmp_path, config: dict, *args: str) -> tuple[int, dict]:
    """The doctor's exit status and ``--json`` report (``doctor_on``)."""
    rc, lines = doctor_on(tmp_path, config, "--json", *args)
    return rc, json.loads("\n".join(lines))


@pytest.fixture(scope="module")
def qwen3_json(tmp_path_factory):
    return doctor_json(tmp_path_factory.mktemp("qwen3"), QWEN3_0_6B, *FAST)


def test_healthy_cpu_machine_exits_zero(qwen3_json):
    rc, report = qwen3_json
    assert rc == 0, report["checks"]
    assert report["ok"] is True
    assert not [c for c in report["checks"] if c["status"] == "FAIL"]


def test_json_names_platform_copy_path_and_self_check(qwen3_json):
    _, report = qwen3_json
    assert report["platform"] == "cpu"
    assert report["vllm_platform"] == "cpu"
    # The best path this build offers on cpu: the self-check's first.
    assert report["copy_path"] == candidate_paths("cpu")[0].name
    # "passed", or says plainly that the self-check is not in this build.
    assert report["self_check"] == "passed" or report["self_check"].startswith(
        "missing:"
    )


def test_json_sizes_the_model_from_config_json(qwen3_json):
    _, report = qwen3_json
    # 2 * 28 layers * 8 KV heads * 128 * 2 bytes * 128 tokens (test_sizing.py).
    assert report["bytes_per_cpu_block"] == 14_680_064
    blocks = report["max_num_cpu_blocks"]
    assert isinstance(blocks, int) and blocks >= 0
    assert report["cpu_bytes_to_use"] == blocks * 14_680_064
    host = report["host"]
    assert host["usable_bytes"] // 14_680_064 == blocks


def test_json_reports_versions_allocation_and_verified_bandwidth(qwen3_json):
    _, report = qwen3_json
    versions = report["versions"]
    assert versions["torch"] and versions["vllm"].startswith("0.")
    assert versions["torch_npu"] == "not found"  # this CI machine has none
    alloc = report["pool_allocation"]
    assert alloc["asked_bytes"] == 8 << 20 and alloc["seconds"] > 0
    rows = report["bandwidth"]
    # Qwen3's K and V pages are the same size: one fragment size, two ways.
    assert {(r["direction"], r["fragment_bytes"]) for r in rows} == {
        ("store", 262_144),
        ("load", 262_144),
    }
    # "op": the native op's path (a build without it copies on torch, "loop").
    op = ["op"] if ops.HAS_NATIVE_OP else []
    for r in rows:
        assert set(r["gbps"]) == {"contiguous", "loop", *op}
        assert r["verified"] == dict.fromkeys(["loop", *op], True)


def test_text_output_has_one_line_per_check(tmp_path):
    rc, lines = doctor_on(tmp_path, LLAMA3_8B, *FAST)
    out = "\n".join(lines)
    assert rc == 0, out
    for name in ("versions", "vllm", "platform", "backends", "copy path"):
        assert f"] {name}" in out
    for name in ("sizing", "pool alloc", "self-check", "bandwidth"):
        assert f"] {name}" in out
    # 2 * 32 layers * 8 KV heads * 128 * 2 bytes * 128 tokens.
    assert "16,777,216 bytes" in out
    assert lines[-1].startswith("OK")


def test_unsizable_model_exits_nonzero_naming_the_key(tmp_path):
    broken = without(QWEN3_0_6B, "num_hidden_layers")
    rc, report = doctor_json(tmp_path, broken, *NO_COPY_CHECKS)
    assert rc == 1
    assert report["ok"] is False
    assert "num_hidden_layers" in report["sizing"]["error"]
    assert report["bytes_per_cpu_block"] is None
    # The other checks still ran: the report is still worth attaching.
    assert report["platform"] == "cpu"


@pytest.mark.skipif(not ops.HAS_NATIVE_OP, reason="needs the native op")
def test_copy_op_writing_wrong_bytes_exits_nonzero(monkeypatch):
    # The op copies, then one byte of the destination is flipped: what a
    # faulty copy path would do to KV.
    real = ops.native_swap

    def faulty_path(device, per_copy=False):
        swap = real(device, per_copy)

        def faulty(src, dst, sizes):
            out = swap(src, dst, sizes)
            p = ctypes.cast(int(dst[-1]), ctypes.POINTER(ctypes.c_uint8))
            p[0] ^= 0xFF
            return out

        return faulty

    # Where the bandwidth table's path binds the op (copy_paths.CopyPath.bind).
    monkeypatch.setattr(ops, "native_swap", faulty_path)
    rc, out = run_doctor("--alloc-mib", "0", "--bandwidth-mib", "1")
    assert rc == 1, out
    assert "WRONG BYTES" in out and "op (store" in out
    assert out.rstrip().splitlines()[-1].startswith("BROKEN")


def test_platform_plugin_failing_to_import_is_reported_not_raised(tmp_path):
    # What upstream vllm-ascend's platform plugin does on a machine without
    # torch_npu: vLLM's platform resolution raises ModuleNotFoundError. vLLM
    # resolves its platform once per process: the doctor runs in its own.
    (tmp_path / "fake_npu_platform.py").write_text(
        "def register():\n    return 'fake_npu_platform_cls.NPUPlatform'\n"
    )
    (tmp_path / "fake_npu_platform_cls.py").write_text("import torch_npu  # noqa\n")
    dist = tmp_path / "fake_npu_platform-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Name: fake-npu-platform\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.platform_plugins]\nfake_npu = fake_npu_platform:register\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_ascend.kv_offload.doctor", "--json"]
        + NO_COPY_CHECKS,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    platform = next(c for c in report["checks"] if c["name"] == "platform")
    assert platform["status"] == "FAIL"
    assert "torch_npu" in platform["summary"]
    assert "VLLM_PLUGINS=ascend_kv_offload" in platform["summary"]
    assert report["vllm_platform"] is None


def fake_self_check(monkeypatch, passes: bool) -> None:
    """A stand-in for self_check.run_self_check with the result shape of
    the pool helper's module (SelfCheckResult: passed, path, failure,
    attempts, summary()), to check what the doctor makes of each outcome."""
    attempts = [NS(path="native", passed=False, failure="byte 7 of block 0 differs")]
    if passes:
        attempts.append(NS(path="torch", passed=True, failure=None))
    result = NS(
        passed=passes,
        path="torch" if passes else None,
        failure=None if passes else "native: byte 7 of block 0 differs",
        attempts=attempts,
        memory_kind="pageable",
        bandwidth_gbps=1.0,
        seconds=0.1,
        summary=lambda: "passed on path torch",
    )
    monkeypatch.setattr(
        self_check, "run_self_check", lambda device, fragment_sizes: result
    )


@pytest.mark.parametrize(
    "passes, rc, self_check_line, copy_path",
    [
        # Moving down to a byte-exact path sets the copy path.
        (True, 0, "passed", "torch"),
        # No byte-exact path: exits nonzero.
        (False, 1, "failed: native: byte 7 of block 0 differs", None),
    ],
)
def test_the_self_checks_outcome_sets_the_copy_path_and_exit_status(
    monkeypatch, passes, rc, self_check_line, copy_path
):
    fake_self_check(monkeypatch, passes=passes)
    got_rc, out = run_doctor("--json", *NO_COPY_CHECKS)
    report = json.loads(out)
    assert got_rc == rc
    assert report["self_check"] == self_check_line
    assert report["copy_path"] == copy_path
    if passes:
        check = next(c for c in report["checks"] if c["name"] == "self-check")
        assert "native: byte 7 of block 0 differs" in check["lines"]


def sizing_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line[7:].startswith("sizing")]


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
    tmp_path, config, line
):
    rc, lines = doctor_on(tmp_path, config, *NO_COPY_CHECKS)
    assert rc == 1
    (sizing,) = sizing_lines(lines)
    assert sizing.startswith("[FAIL] sizing")
    assert f"config.json: {line}" in sizing
    assert "crashed" not in sizing and "fits now" not in "\n".join(lines)
    assert lines[-1].startswith("BROKEN: sizing failed")


def test_a_model_it_cannot_size_is_a_warning_not_broken(tmp_path):
    # Every UnsupportedModelError (test_sizing.py names them) reads so.
    config, why = {**QWEN3_0_6B, "index_topk": 2048}, "config.json has index_topk"
    rc, lines = doctor_on(tmp_path, config, *NO_COPY_CHECKS)
    assert rc == 0
    (sizing,) = sizing_lines(lines)
    assert sizing.startswith("[warn] sizing      cannot size this model: ")
    assert why in sizing
    assert lines[-1].startswith("OK")


def test_a_json_null_size_is_an_absent_one(tmp_path):
    # Configs write "head_dim": null; the head size is then hidden_size's
    # (Llama's rule; transformers refuses a null head_dim for Qwen3).
    config = {**LLAMA3_8B, "hidden_size": 1024, "num_attention_heads": 16}
    config["head_dim"] = None
    rc, lines = doctor_on(tmp_path, config, *NO_COPY_CHECKS)
    assert rc == 0
    assert "head size 64" in "\n".join(lines)  # 1024 // 16


def test_copy_checks_allocate_a_bounded_amount_whatever_the_model(
    tmp_path, monkeypatch
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
    args = ["--alloc-mib", "0", "--bandwidth-mib", "1", "--rounds", "1"]
    rc, report = doctor_json(tmp_path, config, *args, "--kv-cache-dtype", "float32")
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


@pytest.mark.parametrize(
    "config, attention, block_bytes",
    [
        # 2 (K, V) * 12 layers * 12 heads * 64 (768 / 12) * 2 bytes * 128 tokens.
        (GPT2, "mha", 2 * 12 * 12 * 64 * 2 * 128),
        # MLA: 27 layers * (512 + 64) * 2 bytes * 128 tokens.
        (DEEPSEEK_V2_LITE, "mla", 3_981_312),
    ],
    ids=["gpt2-own-key-names", "mla"],
)
def test_a_model_is_sized_as_vllm_reads_it(tmp_path, config, attention, block_bytes):
    rc, report = doctor_json(tmp_path, config, *NO_COPY_CHECKS)
    assert rc == 0, report["checks"]
    assert report["bytes_per_cpu_block"] == block_bytes
    assert report["sizing"]["attention"] == attention


def test_a_bad_host_budget_setting_fails_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_KV_OFFLOAD_HOST_BUDGET", "lots")
    rc, lines = doctor_on(tmp_path, QWEN3_0_6B, *NO_COPY_CHECKS)
    assert rc == 1
    (sizing,) = sizing_lines(lines)
    assert sizing.startswith("[FAIL] sizing      VLLM_ASCEND_KV_OFFLOAD_HOST_BUDGET")
    assert "crashed" not in sizing
