"""The tests (unit, e2e, packaging and their helpers) reach this package
only through public seams.

No ``object.__new__`` (an object built without its constructor), no
``._private`` attribute of an object the test did not define (ours or
vLLM's: vLLM's private names live in ``vllm_compat.py``), whether written
``obj._x`` or by name (``getattr``/``setattr``/``monkeypatch.setattr(obj,
"_x", ...)``). A test's own classes may use their own private names.
Modules of other projects (``os``, ``torch``) are not this rule's business.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

# (file, private name) -> why no public seam can do. Keep it small.
ALLOWED = {
    ("unit/test_transfer_queue.py", "_pending"): (
        "starts shutdown at the instant submit records its job, the race "
        "window under test; no public call lands inside submit"
    ),
    ("unit/swap_helpers.py", "_C_kv_offload"): (
        "the native extension itself: its op's contract is tested without "
        "ops.py's torch fallback in between"
    ),
    ("unit/upstream_layouts.py", "_kv_cache_spec_attn_group_iterator"): (
        "upstream vllm-ascend's model-runner code, run on CPU, reads this of "
        "its self; the test plays that self (upstream_runner.REPLACEMENTS)"
    ),
}
# Calls that name an attribute by a string: (object, name, ...).
BY_NAME = {"getattr", "setattr", "hasattr", "delattr"}
OWN = {"self", "cls"}
OUR_ROOTS = ("vllm_ascend", "vllm", "tests")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


class _Scan(ast.NodeVisitor):
    def __init__(self, foreign_modules: set[str]):
        self.foreign = foreign_modules  # names bound to other projects' modules
        self.classes: list[set[str]] = []  # private names each class defines
        self.found: list[tuple[int, str, str]] = []  # (line, name, what)

    def _reach(self, node: ast.AST, obj: ast.expr, name: str) -> None:
        if not _private(name) or _root(obj) in self.foreign:
            return
        if isinstance(obj, ast.Name) and obj.id in OWN and self.classes:
            if name in self.classes[-1]:
                return  # the test class's own attribute
        self.found.append((node.lineno, name, ast.unparse(node)[:80]))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        # from vllm_ascend.kv_offload import _C (a private module or name)
        if node.level == 0 and (node.module or "").startswith(OUR_ROOTS[:2]):
            for alias in node.names:
                for part in [*(node.module or "").split("."), alias.name]:
                    self._reach(node, ast.Name("_module"), part)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        own = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                own.add(sub.name)
            elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                if isinstance(sub.value, ast.Name) and sub.value.id in OWN:
                    own.add(sub.attr)
            elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                own.add(sub.id)
        self.classes.append(own)
        self.generic_visit(node)
        self.classes.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr == "__new__" and _root(node.value) == "object":
            self.found.append((node.lineno, "__new__", ast.unparse(node)))
        self._reach(node, node.value, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        called = (
            func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        )
        if called in BY_NAME and len(node.args) >= 2:
            obj, name = node.args[0], node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                self._reach(node, obj, name.value)
            elif (  # monkeypatch.setattr("pkg.mod._name", value)
                isinstance(obj, ast.Constant)
                and isinstance(obj.value, str)
                and "." in obj.value
            ):
                for part in obj.value.split("."):
                    self._reach(node, ast.Name("_dotted"), part)
        self.generic_visit(node)


def _foreign_modules(tree: ast.Module) -> set[str]:
    """Names the file binds to modules of other projects (``import os``,
    ``from torch import cuda``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith(OUR_ROOTS):
                    names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if node.module and not node.module.startswith(OUR_ROOTS):
                names.update(a.asname or a.name for a in node.names)
    return names


def back_doors(source: str) -> list[tuple[int, str, str]]:
    """(line, private name, code) of each reach in ``source``."""
    tree = ast.parse(source)
    scan = _Scan(_foreign_modules(tree))
    scan.visit(tree)
    return scan.found


def test_tests_reach_nothing_private_and_build_nothing_without_its_constructor():
    found = []
    used = set()
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        for line, name, code in back_doors(path.read_text()):
            if (rel, name) in ALLOWED:
                used.add((rel, name))
            else:
                found.append(f"{rel}:{line}: {code}")
    assert not found, (
        "tests reach private attributes or build objects without their "
        "constructor; use a public seam (a constructor argument, a public "
        "property, observable behaviour), or, for vLLM, vllm_compat.py:\n"
        + "\n".join(found)
    )
    assert used == set(ALLOWED), (
        f"allow-list entries no longer needed: {set(ALLOWED) - used}"
    )


@pytest.mark.parametrize(
    "planted",
    [
        "spec = object.__new__(Spec)\n",
        "worker._loads.submit(1, job)\n",
        "assert not q._thread.is_alive()\n",
        "def t(monkeypatch):\n    monkeypatch.setattr(Worker, '_start', f)\n",
        "x = getattr(spec, '_pool_request')\n",
        "monkeypatch.setattr('vllm_ascend.kv_offload.ops._lib', None)\n",
        "from vllm.x import Factory\nFactory._registry.pop('a')\n",
        "from vllm_ascend.kv_offload import _C_kv_offload\n",
        "from vllm.v1.kv_offload.cpu._private import helper\n",
        # A test class reaching a private name it inherits, not its own.
        "class W(Worker):\n    def f(self):\n        return self._queues\n",
    ],
)
def test_the_scan_finds_a_planted_back_door(planted: str) -> None:
    assert back_doors(planted)


@pytest.mark.parametrize(
    "clean",
    [
        "class M:\n    def f(self):\n        self._x = 1\n        return self._x\n",
        "class M:\n    def _poll(self):\n        pass\n    def g(self):\n"
        "        self._poll()\n",
        "import os\nos._exit(0)\n",
        "import torch\ntorch.cuda._sleep(10)\n",
        "x.__class__\n",
        "monkeypatch.setattr(worker, 'copy_path', 'torch')\n",
    ],
)
def test_the_scan_leaves_public_and_own_names_alone(clean: str) -> None:
    assert back_doors(clean) == []
