"""The package stays lean (issue 25): no module of ``vllm_ascend/`` over 400
lines, no class over 180. One that grows past either has taken on a second
job: move that role into a collaborator of its own (as ``failures.JobLedger``,
``scheduler_side.py`` or ``tiering/verified_files.py`` were), rather than
squeeze lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_ascend"
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 180


def modules() -> dict[str, str]:
    """Every module of the package: path under the repository -> source."""
    found = {
        str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
        for p in sorted(PACKAGE.rglob("*.py"))
    }
    assert len(found) > 20, f"not the package's modules: {sorted(found)}"
    return found


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


def test_no_module_of_the_package_is_over_400_lines():
    over = {
        path: n
        for path, source in modules().items()
        if (n := len(source.splitlines())) > MAX_MODULE_LINES
    }
    assert not over, f"split these modules by role (lines): {over}"


def test_no_class_of_the_package_is_over_180_lines():
    over = {
        f"{path}:{name}": n
        for path, source in modules().items()
        for name, n in class_lines(source).items()
        if n > MAX_CLASS_LINES
    }
    assert not over, f"move a role out of these classes (lines): {over}"
