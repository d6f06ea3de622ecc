"""How the suite is split over pytest-xdist's workers (scripts/run_tests.sh):
whole modules per worker (pyproject.toml's ``--dist loadfile``), and the
modules sharing one server as one unit (tests/conftest.py)."""

from __future__ import annotations

import re

from tests.conftest import REPO, SHARED_SERVER_MODULES


def uses_tiering_server(text: str) -> bool:
    """A test or fixture of the module asks for ``tiering_server``."""
    return re.search(r"def \w+\([^)]*\btiering_server\b", text) is not None


def test_every_module_using_the_shared_server_is_listed():
    users = {
        path.relative_to(REPO).as_posix()
        for path in (REPO / "tests").rglob("test_*.py")
        if uses_tiering_server(path.read_text())
    }
    assert users == SHARED_SERVER_MODULES


def test_modules_sharing_the_server_go_to_one_worker(pytestconfig, monkeypatch):
    # As under -n 2 (with -n 0 xdist sets "no" and no nodes); _split_scope:
    # xdist's point of override for a work unit's scope.
    monkeypatch.setattr(pytestconfig.option, "dist", "loadfile")
    monkeypatch.setattr(pytestconfig.option, "tx", ["2*popen"])
    sched = pytestconfig.hook.pytest_xdist_make_scheduler(config=pytestconfig, log=None)
    scope = sched._split_scope
    shared = {scope(f"{module}::test_a") for module in SHARED_SERVER_MODULES}
    assert len(shared) == 1
    # Any other module is a unit of its own, all of its tests together.
    others = ["tests/e2e/test_serve.py", "tests/e2e/test_tiering.py", __file__]
    units = {scope(f"{m}::test_a") for m in others} | shared
    assert len(units) == len(others) + 1
    assert scope("tests/e2e/test_tiering.py::test_b") == scope(
        "tests/e2e/test_tiering.py::test_a"
    )
