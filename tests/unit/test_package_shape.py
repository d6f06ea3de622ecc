"""The package's shape (issue 25): its modules import each other without a
cycle, and it stays lean.

Every import statement counts, also those inside functions: a lazy import
only hides a cycle from the interpreter (the module that does it depends on
the other all the same). Imports under ``if TYPE_CHECKING:`` do not run and
do not count. ``from package import name`` depends on the submodule ``name``
when there is one, else on the package's ``__init__``.

No module over 400 lines (no source file of the repository either: tests,
benchmarks, C++), no class over 180. One that grows past either has
taken on a second job: move that role into a collaborator of its own (as
``failures.JobLedger`` and ``scheduler_side.py`` were), rather than squeeze
lines.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_ascend.kv_offload as package

PACKAGE = package.__name__
ROOT = Path(package.__file__).parent
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 180


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((PACKAGE, *parts))] = path
    return modules


def _runtime_imports(nodes):
    """Import nodes among ``nodes`` and below them that run (those under
    ``if TYPE_CHECKING:`` do not)."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _runtime_imports(node.orelse)
        else:
            yield from _runtime_imports(ast.iter_child_nodes(node))


def _imported(node: ast.Import | ast.ImportFrom, package_of: str) -> list[str]:
    """Dotted names an import statement loads: for ``from base import x``,
    ``base.x`` (a submodule, if there is one) or ``base``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = package_of.split(".")[: len(package_of.split(".")) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    return [f"{base}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    modules = _modules()

    def owner(name: str) -> str | None:
        # The longest module prefix: "pkg.attr" is pkg, "pkg.sub" is sub.
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package_of = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in _runtime_imports([ast.parse(path.read_text())]):
            deps |= {owner(n) for n in _imported(node, package_of)}
        graph[name] = deps - {None, name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the path, then "done"
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_imports_inside_functions_and_relative_ones():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    real = import_graph()
    # connector.py imports these at module level; the test would be blind
    # if it missed them.
    assert f"{PACKAGE}.worker" in real[f"{PACKAGE}.connector"]
    assert f"{PACKAGE}.tiering.spec" in real[f"{PACKAGE}.tiering"]


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    if cycle:
        pytest.fail("import cycle: " + " -> ".join(cycle))


def test_the_package_itself_imports_none_of_its_modules():
    """``import vllm_ascend.kv_offload`` (every submodule import runs it
    first) loads nothing of ours: no native library, no vLLM."""
    assert import_graph()[PACKAGE] == set()


def test_ops_loads_the_native_library_on_first_use_only():
    """A process that never copies (scheduler, API server) does not load it."""
    code = (
        "import sys; from vllm_ascend.kv_offload import ops; "
        "native = 'vllm_ascend.kv_offload._C_kv_offload'; "
        "print(native in sys.modules); ops.native_backends(); "
        "print(native in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    before, after = proc.stdout.split()
    assert before == "False"
    if list(ROOT.glob("_C_kv_offload*.so")):  # built here: loaded on use
        assert after == "True"


def class_lines(source: str) -> dict[str, int]:
    """Lines of each class (nested ones too), from its ``class`` line to
    its last."""
    return {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None
    }


def test_a_class_is_measured_from_its_class_line_to_its_last():
    source = "@decorated\nclass A:\n    x = 1\n\n    class B:\n        y = 2\n\nz = 3\n"
    assert class_lines(source) == {"A": 5, "B": 2}


def sources() -> dict[str, str]:
    """Every module of the package: its name -> its source."""
    found = {
        name: path.read_text(encoding="utf-8") for name, path in _modules().items()
    }
    assert len(found) > 20, f"not the package's modules: {sorted(found)}"
    return found


def test_no_module_of_the_package_is_over_400_lines():
    over = {
        name: n
        for name, source in sources().items()
        if (n := len(source.splitlines())) > MAX_MODULE_LINES
    }
    assert not over, f"split these modules by role (lines): {over}"


def test_no_class_of_the_package_is_over_180_lines():
    over = {
        f"{module}:{name}": n
        for module, source in sources().items()
        for name, n in class_lines(source).items()
        if n > MAX_CLASS_LINES
    }
    assert not over, f"move a role out of these classes (lines): {over}"


REPO = ROOT.parents[1]
# The package's modules have the test above.
SOURCE_DIRS = ("csrc", "tests", "benchmarks", "examples", "tools")
SOURCE_SUFFIXES = {".py", ".sh", ".cpp", ".h", ".cu"}


def test_no_source_file_outside_the_package_is_over_400_lines():
    """The same bound for the tests, benchmarks, examples, tools, scripts and
    the C++ (the simulated ACL runtime included): one role per file."""
    files = [REPO / "setup.py", *(REPO / "scripts").iterdir()]
    for top in SOURCE_DIRS:
        files += (p for p in (REPO / top).rglob("*") if p.suffix in SOURCE_SUFFIXES)
    over = {
        str(p.relative_to(REPO)): n
        for p in files
        if p.is_file() and (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert len(files) > 120, files  # the scan reads the repository
    assert not over, f"split these files by role (lines): {over}"
