"""tools/graft_upstream.py applied to the real upstream sdist (docs/upstream_graft.md).

The sdist of the pinned upstream release is downloaded once (cached); each
run unpacks it twice (pristine and to-be-grafted) into a temporary directory.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.packaging import upstream
from tests.packaging.conftest import PROBE

pytestmark = pytest.mark.packaging

REPO = upstream.REPO_ROOT
SCRIPT = REPO / "tools" / "graft_upstream.py"
DOC = REPO / "docs" / "upstream_graft.md"
OURS = ("vllm_ascend/kv_offload/", "csrc/kv_offload/")

sys.path.insert(0, str(SCRIPT.parent))
import graft_upstream  # noqa: E402


def _snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Relative path -> (sha256, mtime_ns) of every file under root."""
    out = {}
    for path in root.rglob("*"):
        if path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            out[path.relative_to(root).as_posix()] = (digest, path.stat().st_mtime_ns)
    return out


def _graft(tree: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(tree), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _doc_modified_files() -> set[str]:
    """The backticked paths listed under '## Upstream files modified'."""
    section = re.search(
        r"^## Upstream files modified\n(?P<body>.*?)(?=^## )",
        DOC.read_text(),
        re.M | re.S,
    )
    assert section, f"{DOC.name} lacks the section '## Upstream files modified'"
    return set(re.findall(r"^- `([^`]+)`", section["body"], re.M))


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> dict[str, Path]:
    """pristine: the unpacked sdist; grafted: another copy, grafted once."""
    sdist, base = upstream.upstream_sdist(), tmp_path_factory.mktemp("graft")
    pristine = upstream.unpack_sdist(sdist, base / "pristine")
    grafted = upstream.unpack_sdist(sdist, base / "grafted")
    proc = _graft(grafted)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "files written" in proc.stdout, proc.stdout
    return {"pristine": pristine, "grafted": grafted}


def test_doc_names_exactly_the_files_the_script_modifies():
    assert _doc_modified_files() == set(graft_upstream.MODIFIED_FILES)


def test_only_the_documented_upstream_files_change(trees):
    before = _snapshot(trees["pristine"])
    after = _snapshot(trees["grafted"])
    assert not set(before) - set(after), "the graft removed upstream files"
    changed = {p for p in before if before[p][0] != after[p][0]}
    assert changed == _doc_modified_files()

    added = set(after) - set(before)
    expected = set(graft_upstream.overlay_files())
    assert added == expected
    assert all(p.startswith(OURS) for p in added)
    for rel in added:
        assert (trees["grafted"] / rel).read_bytes() == (REPO / rel).read_bytes(), rel
    # What upstream does not build, and what is built, stays out.
    assert "vllm_ascend/kv_offload/__init__.py" in added
    assert "csrc/kv_offload/dispatch.cpp" in added
    assert not any(p.endswith((".so", ".pyc")) or "__pycache__" in p for p in added)
    assert "csrc/kv_offload/module.cpp" not in added
    # The upstream tree did not have our directories before.
    assert not any(p.startswith(OURS) for p in before)


def test_second_run_changes_nothing(trees):
    before = _snapshot(trees["grafted"])
    proc = _graft(trees["grafted"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "nothing to do" in proc.stdout
    assert _snapshot(trees["grafted"]) == before  # contents and mtimes


def test_torch_binding_calls_registration_in_both_soc_blocks(trees):
    text = (trees["grafted"] / "csrc" / "torch_binding.cpp").read_text()
    decl = "void register_kv_offload_ops(torch::Library& m);"
    call = "vllm_ascend::register_kv_offload_ops(ops);"
    assert text.count(decl) == 1
    assert text.count(call) == 2
    block = re.compile(r"^TORCH_LIBRARY_EXPAND\(CONCAT\(_C, _ascend\), ops\)", re.M)
    blocks = [m.start() for m in block.finditer(text)]
    assert len(blocks) == 2
    assert text.index(decl) < blocks[0]
    for start in blocks:
        opening = text[start:].split("\n", 3)
        assert opening[1] == "{" and opening[2].strip() == call, opening[:3]
    # One block under ASCEND_PLATFORM_310P, the other in its #else.
    head = text[: blocks[0]]
    assert head.rstrip().splitlines()[-2].startswith("#ifdef ASCEND_PLATFORM_310P")
    assert "#else" in text[blocks[0] : blocks[1]]
    # Upstream's own op of the same family is still there, next to ours.
    assert (
        'ops.def("swap_blocks_batch(Tensor x, Tensor y, Tensor z, int direction)'
        in text
    )


def test_cmake_adds_our_sources_with_defines_and_include_dir(trees):
    text = (trees["grafted"] / "CMakeLists.txt").read_text()
    anchor = text.index("pybind11_add_module(vllm_ascend_C ${VLLM_ASCEND_SRC})")
    block = text[anchor:]
    cpp = sorted(p for p in graft_upstream.overlay_files() if p.endswith(".cpp"))
    assert cpp == sorted(graft_upstream.native_sources(graft_upstream.overlay_files()))
    for src in cpp:
        assert f"${{CMAKE_CURRENT_SOURCE_DIR}}/{src}" in block, src
    assert "csrc/kv_offload/module.cpp" not in text
    assert (
        "target_sources(vllm_ascend_C PRIVATE ${VLLM_ASCEND_KV_OFFLOAD_SRC})" in block
    )
    assert "VLLM_ASCEND_KV_OFFLOAD_GRAFTED;VLLM_ASCEND_WITH_NPU" in block
    assert 'INCLUDE_DIRECTORIES "${CMAKE_CURRENT_SOURCE_DIR}/csrc/kv_offload"' in block
    # Upstream's non-recursive glob does not pick our sources up a second time.
    assert re.search(r"csrc/\*\.cpp", text) and "csrc/**" not in text


def _setup_entry_points(setup_py: Path) -> dict[str, list[str]]:
    """The literal ``entry_points=`` argument of setup() in setup.py."""
    tree = ast.parse(setup_py.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            for kw in node.keywords:
                if kw.arg == "entry_points":
                    return ast.literal_eval(kw.value)
    raise AssertionError("setup() has no entry_points")


def test_setup_py_gains_our_general_plugin_only(trees):
    before = _setup_entry_points(trees["pristine"] / "setup.py")
    after = _setup_entry_points(trees["grafted"] / "setup.py")
    ours = graft_upstream.our_entry_point()
    assert set(after) == set(before)
    for group, entries in before.items():
        extra = [e for e in after[group] if e not in entries]
        assert after[group][: len(entries)] == entries
        assert extra == ([ours] if group == "vllm.general_plugins" else [])
    assert ours.split("=", 1)[1].strip().startswith("vllm_ascend.kv_offload.")


def _upstream_copy(trees, tmp_path: Path) -> Path:
    """A copy of the pristine tree's files the graft reads before it writes
    (the three it patches, the two it checks for): enough for a refusal."""
    tree = tmp_path / "upstream"
    for rel in {*graft_upstream.MODIFIED_FILES, "setup.py", "vllm_ascend/__init__.py"}:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(trees["pristine"] / rel, tree / rel)
    return tree


def _refuses(tree: Path) -> str:
    """The graft exits 1 on ``tree`` and writes nothing; returns its stderr."""
    before = _snapshot(tree)
    proc = _graft(tree)
    assert proc.returncode == 1
    assert _snapshot(tree) == before
    return proc.stderr


def test_missing_anchor_refuses_and_writes_nothing(trees, tmp_path):
    tree = _upstream_copy(trees, tmp_path)
    binding = tree / "csrc" / "torch_binding.cpp"
    binding.write_text(
        binding.read_text().replace("TORCH_LIBRARY_EXPAND(", "TORCH_LIBRARY(")
    )
    stderr = _refuses(tree)
    assert "refusing" in stderr and "torch_binding.cpp" in stderr
    assert "found 0 times, expected 2" in stderr


def test_old_upstream_with_its_own_kv_offload_is_refused(trees, tmp_path):
    tree = _upstream_copy(trees, tmp_path)
    # What vllm-ascend 0.23.x ships (vllm_ascend/kv_offload/{npu,cpu_npu}.py).
    own = tree / "vllm_ascend" / "kv_offload"
    own.mkdir()
    (own / "__init__.py").write_text("")
    (own / "cpu_npu.py").write_text("# upstream's\n")
    stderr = _refuses(tree)
    assert "vllm_ascend/kv_offload/cpu_npu.py" in stderr
    assert "< 0.30" in stderr


def test_merged_package_imports(trees, tmp_path):
    """The grafted tree's Python package imports in the main venv, from the tree.

    ``-S``: no ``.pth`` files run, so this repo's editable install (whose
    finder would otherwise also serve ``vllm_ascend.kv_offload``'s native
    module) stays out; the venv's site-packages (vllm, torch) are appended.
    """
    merged = trees["grafted"]
    site_dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # The sdist's vllm_ascend.egg-info is on the path with the tree, so vLLM
    # sees upstream's platform plugin "ascend"; activated on this CPU machine
    # it fails (needs the _build_info module of upstream's native build, and
    # torch_npu). vLLM resolves the platform on our first log call.
    env["VLLM_PLUGINS"] = graft_upstream.our_entry_point().split("=")[0].strip()
    cmd = [sys.executable, "-S", PROBE, "merged", merged, *dict.fromkeys(site_dirs)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = got["ours"]
    assert "error" not in ours, ours["error"]
    assert Path(ours["npu"]) == merged / "vllm_ascend" / "kv_offload" / "npu.py"
    # upstream's own package __init__, not a namespace package
    assert Path(got["package"]["file"]) == merged / "vllm_ascend" / "__init__.py"
    assert ours["spec"] == "vllm_ascend.kv_offload.npu"
    for name, file in got["modules"].items():
        assert file is None or Path(file).is_relative_to(merged), (name, file)
    # No native module in the tree (upstream's is not built without CANN):
    # the torch path.
    assert ours["has_native_op"] is False
