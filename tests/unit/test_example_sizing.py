"""The examples' pre-flight sizing (``examples/kv_offload_sizing.py``): the
guide's configuration with the flags' overrides, and a configuration that
cannot fit refused before any engine starts, naming what to pass."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from tests.unit.model_configs import QWEN3_0_6B, write_model
from vllm_ascend.kv_offload import host_guard

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "kv_offload_sizing", REPO / "examples" / "kv_offload_sizing.py"
)
sizing = importlib.util.module_from_spec(_spec)
sys.modules["kv_offload_sizing"] = sizing
_spec.loader.exec_module(sizing)

GiB = 2**30
MiB = 2**20
QWEN3_06B_BLOCK_BYTES = 14_680_064  # docs/user_guide.md, "Sizing the CPU pool"


@pytest.fixture
def model(tmp_path):
    model = write_model(tmp_path, QWEN3_0_6B)
    (model / "model.safetensors").write_bytes(b"\0" * MiB)
    return str(model)


@pytest.fixture
def host(monkeypatch, available):
    """Sets the host memory available to the check."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    return available


def test_cpu_block_bytes_from_config_match_the_user_guide(model):
    assert sizing.read_model(model).cpu_block_bytes(128) == QWEN3_06B_BLOCK_BYTES


def test_guide_configuration_is_refused_where_it_cannot_fit(model, host):
    host(18 * GiB)
    with pytest.raises(SystemExit) as info:
        sizing.plan(model)
    message = str(info.value)
    assert "num_cpu_blocks=1000" in message
    assert "13.67 GiB" in message
    fit = host_guard.auto_num_cpu_blocks(
        QWEN3_06B_BLOCK_BYTES,
        MiB + sizing.ENGINE_OVERHEAD_BYTES + 2 * 8192 * QWEN3_06B_BLOCK_BYTES // 128,
        18 * GiB,
    )
    assert f"pass --num-cpu-blocks {fit} (or auto)" in message


def test_auto_sizes_the_pool_that_fits_and_keeps_the_rest_of_the_guide(model, host):
    host(18 * GiB)
    p = sizing.plan(model, num_cpu_blocks="auto")
    blocks = p.extra_config["num_cpu_blocks"]
    assert 0 < blocks < 1000
    # The examples' auto and the package's (host_guard, as the doctor's
    # host_guard.fit_host_memory) agree: one computation, not two.
    assert blocks == host_guard.auto_num_cpu_blocks(
        QWEN3_06B_BLOCK_BYTES, p.engine_bytes, 18 * GiB
    )
    assert p.pool_bytes <= 0.9 * (18 * GiB - p.engine_bytes) * sizing.AUTO_POOL_SHARE
    assert {k: v for k, v in p.extra_config.items() if k != "num_cpu_blocks"} == {
        k: v for k, v in sizing.GUIDE_EXTRA_CONFIG.items() if k != "num_cpu_blocks"
    }
    assert f"num_cpu_blocks={blocks} (auto)" in p.overrides


def test_kv_cache_on_the_cpu_backend_is_sized_for_the_model(model, host):
    host(64 * GiB)
    p = sizing.plan(model)
    # A real model's max_model_len is capped at 8192; 2 sequences of it.
    assert p.max_model_len == 8192
    assert p.kv_cache_bytes == 2 * 8192 * QWEN3_06B_BLOCK_BYTES // 128
    assert p.extra_config == sizing.GUIDE_EXTRA_CONFIG
    # On a device, the KV cache is left to the platform.
    assert sizing.plan(model, kv_cache_in_host=False).kv_cache_bytes is None


def test_cpu_bytes_replaces_num_cpu_blocks(model, host):
    host(64 * GiB)
    p = sizing.plan(model, cpu_bytes=2 * GiB)
    assert "num_cpu_blocks" not in p.extra_config
    assert p.extra_config["cpu_bytes_to_use"] == 2 * GiB
    with pytest.raises(SystemExit, match="give one"):
        sizing.plan(model, cpu_bytes=2 * GiB, num_cpu_blocks="10")


def test_bad_values_name_the_flag(model, host):
    host(64 * GiB)
    with pytest.raises(SystemExit, match="--num-cpu-blocks 'x'"):
        sizing.plan(model, num_cpu_blocks="x")
    with pytest.raises(SystemExit, match="needs a local model directory"):
        sizing.plan("Qwen/Qwen3-0.6B", num_cpu_blocks="auto")


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("1073741824", GiB),
        ("512MiB", 512 * MiB),
        ("4G", 4 * GiB),
        ("1.5GiB", 3 * GiB // 2),
        ("4096", 4096),
        ("16K", 16384),
        ("64KiB", 65536),
        ("1M", MiB),
    ],
)
def test_sizes_accept_binary_units(text, nbytes):
    """The size flags of the examples and the benchmarks."""
    assert host_guard.size_flag(text) == nbytes


@pytest.mark.parametrize("text", ["0", "x", "4 apples"])
def test_a_size_flag_refuses_what_is_not_a_size(text):
    with pytest.raises(argparse.ArgumentTypeError, match="size"):
        host_guard.size_flag(text)
