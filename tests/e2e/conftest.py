"""Shared pieces of the end-to-end tests: prompts, engine configs, the
scenario runner and its fixtures, the tiering config, the shared tiering
server's fixture (the online tests' server: tests/e2e/serving.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from vllm_ascend.kv_offload.testing.engine import GUIDE_EXTRA_CONFIG
from vllm_ascend.kv_offload.testing.tiny_model import (
    ensure_mla_model,
    ensure_tiny_model,
    make_prompt,
)

REPO = Path(__file__).resolve().parents[2]

GUIDE_OFFLOAD = GUIDE_EXTRA_CONFIG

# The guide's config with the test-only spec whose worker injects the faults
# named by VLLM_ASCEND_KV_OFFLOAD_FAULTS (tests/fault_injection.py).
FAULTY_OFFLOAD = dict(
    GUIDE_OFFLOAD,
    spec_name="FaultInjectingOffloadingSpec",
    spec_module_path="tests.fault_injection",
)

# fp32 keeps recomputed and reloaded prefixes numerically identical; a small
# device KV cache keeps engine start-up cheap: 512 blocks of 128 tokens
# (64 MiB for the tiny model; all prompts of DOCS take 21) instead of the
# 1 GiB of VLLM_CPU_KVCACHE_SPACE (run_scenario), which vLLM zeroes at every
# start (seconds on a busy 2-core machine).
ENGINE = {
    "dtype": "float32",
    "max_model_len": 2048,
    "enforce_eager": True,
    "num_gpu_blocks_override": 512,
}

# vLLM's engine core and its one worker inside the scenario's process
# (VLLM_ENABLE_V1_MULTIPROCESSING=0, the uni executor): about three times
# faster to start than vLLM's default layout (an engine core and a worker
# process), and several engines can run one after another in one process
# ("sequence"). The servers and the scenarios that say so keep the default.
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


# In-process, 16 device blocks of 128 tokens for up to 8 running requests of
# up to 5 blocks each: the scheduler preempts all the time (the stress and
# batched sync-load tests).
PREEMPTING_ENGINE = dict(
    ENGINE,
    distributed_executor_backend="uni",
    max_model_len=1024,
    num_gpu_blocks_override=16,
    max_num_seqs=8,
)


def in_process(scenario: dict) -> dict:
    """``scenario`` with its engine (``ENGINE`` unless given) in-process."""
    engine = dict(scenario.get("engine", ENGINE), distributed_executor_backend="uni")
    env = {**scenario.get("env", {}), **IN_PROCESS_ENV}
    return dict(scenario, engine=engine, env=env)


# Two tensor-parallel workers on vLLM's CPU backend (scenario keys): its mp
# executor, each worker's OpenMP threads on a core of its own (on a 2-core
# machine the engine core shares them; the default binding does not give
# two ranks a core each).
TP2 = {
    "engine": {**ENGINE, "tensor_parallel_size": 2},
    "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
}

# Three "documents" of 4 full 128-token blocks, three questions each.
DOC_WORDS = 512
DOCS = [make_prompt(DOC_WORDS, seed=100 + d) for d in range(3)]
PROMPTS_BY_DOC = [
    [f"{doc} {make_prompt(40, seed=1000 + 10 * d + q)}" for q in range(3)]
    for d, doc in enumerate(DOCS)
]
ALL_PROMPTS = [p for doc in PROMPTS_BY_DOC for p in doc]
FULL_DOC_TOKENS = 512  # a document's 4 full blocks
FIRST_QUESTIONS = [0, 3, 6]  # indices of each document's first prompt
FIRST_PROMPTS = [ALL_PROMPTS[i] for i in FIRST_QUESTIONS]
# Store everything, then ask again with the device prefix cache emptied:
# the first question of each document must come from the CPU.
TWICE = [
    {"prompts": ALL_PROMPTS},
    {"prompts": ALL_PROMPTS, "reset_prefix_cache": True},
]


def with_faults(scenario_dir, name: str, faults: str, **scenario) -> dict:
    """``scenario`` (``TWICE`` through the fault-injecting guide config
    unless given) with ``faults``, logged to ``<name>.faults``."""
    env = {
        "VLLM_ASCEND_KV_OFFLOAD_FAULTS": faults,
        "VLLM_ASCEND_KV_OFFLOAD_FAULTS_LOG": str(scenario_dir / f"{name}.faults"),
    }
    return {"phases": TWICE, "offload": FAULTY_OFFLOAD, **scenario, "env": env}


def injected_faults(scenario_dir, name: str) -> list[str]:
    """The faults that ``with_faults(scenario_dir, name, ...)`` injected."""
    fault_log = scenario_dir / f"{name}.faults"
    return fault_log.read_text().split("\n")[:-1] if fault_log.exists() else []


def run_scenario(
    tmp_path: Path, name: str, scenario: dict, timeout_s: float = 600
) -> dict:
    """Run ``scenario`` in its own process; return its JSON result."""
    spec_file = tmp_path / f"{name}.json"
    out_file = tmp_path / f"{name}.result.json"
    spec_file.write_text(json.dumps(scenario))
    env = dict(os.environ)
    # "pythonpath": entries ahead of the repo, from interpreter start on (the
    # vLLM 0.33 overlay's sitecustomize must run before vllm is imported).
    path = [*scenario.get("pythonpath", []), str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.e2e.run_scenario", str(spec_file), str(out_file)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    # Everything the process printed (the error below keeps only the end).
    (tmp_path / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise AssertionError(
            f"scenario {name} failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return json.loads(out_file.read_text())


def run_sequence(
    tmp_path: Path, name: str, scenarios: dict[str, dict], **options
) -> dict[str, dict]:
    """``scenarios`` one after the other in one process (run_scenario's
    ``sequence``; ``options``: ``timeout_s`` or top-level scenario keys such
    as ``env``); each one's result by name."""
    timeout_s = options.pop("timeout_s", 600)
    sequence = {**options, "sequence": list(scenarios.values())}
    result = run_scenario(tmp_path, name, sequence, timeout_s)
    return dict(zip(scenarios, result["runs"], strict=True))


def scenario_log(tmp_path: Path, name: str, step: int | None = None) -> str:
    """The whole output (stdout, then stderr) of the last run of ``name``;
    given ``step``, only that engine's of its ``sequence`` (the lines after
    run_scenario's ``### step <step> ###`` markers)."""
    log = (tmp_path / f"{name}.log").read_text()
    if step is None:
        return log
    parts = re.split(r"^### step (\d+) ###\n", log, flags=re.M)
    steps = zip(parts[1::2], parts[2::2], strict=True)
    return "".join(text for i, text in steps if int(i) == step)


def _records(phase: list[dict] | dict) -> list[dict]:
    """A phase's request records (run_scenario's list, or
    ``{"results": [...]}``), or a run's, every phase's in turn."""
    if isinstance(phase, list):
        return phase
    if "results" in phase:
        return phase["results"]
    return [record for records in phase["phases"] for record in records]


def token_ids(phase: list[dict] | dict) -> list[list[int]]:
    return [r["token_ids"] for r in _records(phase)]


def cached(phase: list[dict] | dict) -> list[int]:
    return [r["num_cached_tokens"] for r in _records(phase)]


def remove_vllm_tp_shm(log: str) -> list[str]:
    """Removes what vLLM's CPU tensor-parallel communicator left in
    /dev/shm for the engines of ``log`` (``vllm_dist_<id>-tp:...-cpushm_<rank>``,
    4 MiB each): its workers, terminated after vLLM's shutdown grace
    period, never unlink them. Not offloading's files; returns the paths."""
    removed = []
    for dist_id in sorted(set(re.findall(r"/tmp/(vllm_dist_[0-9a-f]+)", log))):
        for path in Path("/dev/shm").glob(f"{dist_id}-*"):
            path.unlink(missing_ok=True)
            removed.append(str(path))
    return removed


@pytest.fixture(scope="session")
def mla_model() -> str:
    """The tiny DeepSeek-V2-style MLA model (testing/tiny_model.py)."""
    return ensure_mla_model()


@pytest.fixture(scope="session")
def scenario_dir(tmp_path_factory) -> Path:
    ensure_tiny_model()
    return tmp_path_factory.mktemp("scenarios")


@pytest.fixture(scope="session")
def reference(scenario_dir, tmp_path_factory) -> list[list[int]]:
    """Greedy outputs of every prompt with offloading off: one engine per
    run, also under xdist (its workers share the run's temporary root)."""

    def run() -> list[list[int]]:
        scenario = {"offload": None, "phases": [{"prompts": ALL_PROMPTS}]}
        result = run_scenario(scenario_dir, "reference", in_process(scenario))
        return token_ids(result["phases"][0])

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return run()
    shared = tmp_path_factory.getbasetemp().parent / "reference.json"
    with FileLock(shared.with_suffix(".lock")):
        if not shared.exists():
            shared.write_text(json.dumps(run()))
        return json.loads(shared.read_text())


@pytest.fixture(scope="session")
def first_answers(reference) -> list[list[int]]:
    """The reference outputs of each document's first question."""
    return [reference[i] for i in FIRST_QUESTIONS]


@pytest.fixture(scope="package")
def tiering_server(tmp_path_factory):
    """One ``vllm serve`` with tiering and KV events, shared by the online
    tiering and KV-events tests (serving.TieringServer); each test resets
    what it needs and reads counters as deltas. Package scope: it stops when
    the e2e tests end, not after the unit and packaging tests. Its clean
    stop on SIGINT is checked at teardown."""
    from tests.e2e.serving import serve_shared  # serving imports this module

    yield from serve_shared(tmp_path_factory.mktemp("tiering_server"))


@pytest.fixture(
    scope="module",
    params=["installed", "0.33"],
    ids=["vllm-installed", "vllm-0.33-offloading"],
)
def offloading_code(request) -> dict:
    """Scenario keys that pick vLLM's offloading code: the installed release
    (0.32), or vLLM 0.33's offloading packages over it (tests/vllm033)."""
    if request.param == "installed":
        return {}
    from tests.vllm033.overlay import overlay_dir, skip_unless_core_supported

    skip_unless_core_supported()
    return {"pythonpath": [str(overlay_dir())]}


def zmq_events(port: int, topic: str) -> dict:
    """The guide's ``KVEventsConfig`` fields: vLLM publishes on
    ``tcp://*:port``."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "topic": topic,
    }


# The tiering spec with an fs tier under ``root`` (the tiering e2e tests).
def tiering(root: str, write_threads: int = 2, **changes) -> dict:
    return {
        "num_cpu_blocks": 64,
        "block_size": 128,
        "spec_name": "NPUTieringOffloadingSpec",
        "spec_module_path": "vllm_ascend.kv_offload.tiering",
        "secondary_tiers": [
            {
                "type": "fs",
                "root_dir": root,
                "n_read_threads": 2,
                "n_write_threads": write_threads,
            }
        ],
        **changes,
    }
