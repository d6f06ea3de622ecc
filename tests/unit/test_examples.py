"""The examples as a new user meets them: ``--help``, run as the docs show
it (``python examples/<example>.py --help`` from the checkout), prints every
flag and exits 0 before any engine or model is touched; the offline
example's completion of the generated model says that its text means
nothing; and their pre-flight sizing (``examples/kv_offload_sizing.py``):
the guide's configuration with the flags' overrides, and a configuration
that cannot fit refused before any engine starts, naming what to pass; and
the serve script up to the server it starts (a stub here; the real one in
tests/e2e/test_serve.py)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.unit.model_configs import QWEN3_0_6B, write_model
from vllm_ascend.kv_offload import host_guard, host_ledger
from vllm_ascend.kv_offload.testing.server import free_port

REPO = Path(__file__).resolve().parents[2]
SIZING_FLAGS = ("--num-cpu-blocks", "--cpu-bytes", "--kv-cache-bytes")
GiB = 2**30
MiB = 2**20
QWEN3_06B_BLOCK_BYTES = 14_680_064  # docs/user_guide.md, "Sizing the CPU pool"


def example(name: str):
    """``examples/<name>.py``, imported by path (its module level imports no
    vLLM), registered under ``name`` as the examples import each other."""
    spec = importlib.util.spec_from_file_location(
        name, REPO / "examples" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


sizing = example("kv_offload_sizing")


@pytest.mark.parametrize("name", ["offline_inference_kv_offload", "kv_offload_sizing"])
def test_help_lists_the_sizing_flags_and_exits_0(name):
    proc = subprocess.run(
        [sys.executable, f"examples/{name}.py", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:")
    for flag in SIZING_FLAGS:
        assert flag in proc.stdout
    # The auto pool's share, as the help text states it.
    shown = " ".join(proc.stdout.split())
    assert "auto: 50% of the host memory" in shown
    # The description is the docstring's whole first paragraph, not a line
    # cut off mid-sentence.
    summary = example(name).__doc__.split("\n\n")[0]
    assert " ".join(summary.split()) in shown


def completion(text: str) -> SimpleNamespace:
    """What ``LLM.generate`` returns for one prompt, as far as it is printed."""
    return SimpleNamespace(
        prompt="Hello, my name is", outputs=[SimpleNamespace(text=text)]
    )


@pytest.mark.parametrize("generated", [True, False], ids=["generated", "--model"])
def test_completion_of_the_generated_model_is_explained_where_printed(
    generated, capsys
):
    example("offline_inference_kv_offload").print_completions(
        [completion(" kuke data nuva")], generated
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["Prompt: 'Hello, my name is'", "Generated: ' kuke data nuva'"]
    if generated:
        (note,) = lines[2:]
        assert "random weights" in note and "meaningless" in note
        assert "time to first token" in note
    else:
        # A real model's text speaks for itself.
        assert lines[2:] == []


@pytest.fixture
def model(tmp_path):
    model = write_model(tmp_path, QWEN3_0_6B)
    (model / "model.safetensors").write_bytes(b"\0" * MiB)
    return str(model)


@pytest.fixture
def host(monkeypatch, available, host_ledger_dir):
    """Sets the host memory available to the check (no other pool on the
    host unless the test records one in its ledger)."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    return available


def test_cpu_block_bytes_from_config_match_the_user_guide(model):
    assert sizing.read_model(model, 128).cpu_block_bytes == QWEN3_06B_BLOCK_BYTES


def test_cpu_block_is_the_pools_row_a_whole_number_of_pages(tmp_path):
    # K and V of 1 layer x 1 KV head x head_dim 4 in bf16: 2 KiB per
    # 128-token block, which the pool holds in one page-aligned row.
    shape = {"num_hidden_layers": 1, "num_key_value_heads": 1, "head_dim": 4}
    tiny = write_model(tmp_path, {**QWEN3_0_6B, **shape})
    assert sizing.read_model(str(tiny), 128).cpu_block_bytes == mmap.PAGESIZE


def test_guide_configuration_is_refused_where_it_cannot_fit(model, host):
    host(18 * GiB)
    with pytest.raises(SystemExit) as info:
        sizing.plan(model)
    message = str(info.value)
    assert "num_cpu_blocks=1000" in message
    assert "13.67 GiB" in message
    engine = (
        MiB + sizing.ENGINE_OVERHEAD_BYTES + 2 * 8192 * QWEN3_06B_BLOCK_BYTES // 128
    )
    fit = host_guard.auto_num_cpu_blocks(
        QWEN3_06B_BLOCK_BYTES, host_guard.HostBudget(18 * GiB, reserved=engine)
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
        QWEN3_06B_BLOCK_BYTES, host_guard.HostBudget(18 * GiB, reserved=p.engine_bytes)
    )
    assert p.pool_bytes <= 0.9 * (18 * GiB - p.engine_bytes) * sizing.AUTO_POOL_SHARE
    assert {k: v for k, v in p.extra_config.items() if k != "num_cpu_blocks"} == {
        k: v for k, v in sizing.GUIDE_EXTRA_CONFIG.items() if k != "num_cpu_blocks"
    }
    assert f"num_cpu_blocks={blocks} (auto)" in p.overrides


def test_the_other_pools_of_the_host_count_as_the_worker_counts_them(
    model, host, host_ledger_dir
):
    """Another engine's pool on this host (in the host's ledger) leaves less
    room, as it does for the worker: auto sizes a smaller pool, and a pool
    that fits alone but not next to it is refused before any engine starts."""
    host(64 * GiB)
    alone = sizing.plan(model, num_cpu_blocks="auto")
    assert sizing.plan(model, num_cpu_blocks="3000").pool_bytes < 42 * GiB
    other = host_ledger.reserve(20 * GiB, "another-engine", lambda others: None)
    try:
        beside = sizing.plan(model, num_cpu_blocks="auto")
        budget = host_guard.HostBudget(
            64 * GiB, host_ledger.live_pools(), reserved=beside.engine_bytes
        )
        blocks = beside.extra_config["num_cpu_blocks"]
        assert blocks < alone.extra_config["num_cpu_blocks"]
        assert blocks == int(budget.room() * sizing.AUTO_POOL_SHARE) // (
            QWEN3_06B_BLOCK_BYTES
        )
        with pytest.raises(SystemExit) as info:
            sizing.plan(model, num_cpu_blocks="3000")
    finally:
        other.release()
    message = str(info.value)
    assert "1 other CPU pool of this host (20.00 GiB) counts against that" in message
    assert f"pass --num-cpu-blocks {blocks} (or auto)" in message
    # Other pools that leave no room at all: auto says so.
    crowd = [host_ledger.reserve(28 * GiB, f"e{i}", lambda o: None) for i in (1, 2)]
    try:
        with pytest.raises(SystemExit) as info:
            sizing.plan(model, num_cpu_blocks="auto")
    finally:
        for reservation in crowd:
            reservation.release()
    assert "no CPU block" in str(info.value)
    assert "2 other CPU pools of this host (56.00 GiB) count against" in str(info.value)


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


def test_the_serve_script_says_the_engine_compiles_then_runs_the_guides_serve(
    tmp_path, host_ledger_dir
):
    """``examples/serve_kv_offload.sh MODEL --num-cpu-blocks 10`` as the docs
    show it, with vLLM's server (``vllm serve`` or its module) replaced by a
    stub that records its arguments: before the engine's silent minutes the
    script says it compiles (the default, not eager), then runs the server
    with the guide's --kv-transfer-config, the sizing flag applied and taken
    out of the server's own arguments."""
    model = write_model(tmp_path, QWEN3_0_6B)
    stub, argv_file = tmp_path / "bin", tmp_path / "server_argv"
    stub.mkdir()
    record = f"printf '%s\\n' \"$@\" > {argv_file}; exit 0"
    (stub / "vllm").write_text(f"#!/usr/bin/env bash\n{record}\n")
    (stub / "python").write_text(
        "#!/usr/bin/env bash\n"
        f"if [[ $1 == -m && $2 == vllm.entrypoints.* ]]; then {record}; fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    for script in stub.iterdir():
        script.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{stub}:{os.environ['PATH']}",
        "PORT": str(free_port()),
    }
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    proc = subprocess.run(
        ["bash", "examples/serve_kv_offload.sh", str(model), "--num-cpu-blocks",
         "10", "--max-model-len", "1024"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    said = " ".join(proc.stderr.split())
    assert (
        "its engine loads the model and compiles it with torch.compile "
        "(--enforce-eager skips compiling): a minute or more"
    ) in said
    argv = argv_file.read_text().splitlines()
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            **sizing.GUIDE_EXTRA_CONFIG,
            "num_cpu_blocks": 10,
        },
    }
    assert "--num-cpu-blocks" not in argv
    assert argv[argv.index("--max-model-len") + 1] == "1024"
    assert int(argv[argv.index("--kv-cache-memory-bytes") + 1]) >= 256 * MiB
