"""How the suite is split over pytest-xdist's workers (scripts/run_tests.sh):
whole modules per worker (pyproject.toml's ``--dist loadfile``), and the
modules sharing one server as one unit (tests/conftest.py)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO, SHARED_SERVER_MODULES, work_unit


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


def test_modules_sharing_the_server_go_to_one_worker():
    shared = {work_unit(f"{module}::test_a") for module in SHARED_SERVER_MODULES}
    assert len(shared) == 1
    # Any other module is a unit of its own, all of its tests together.
    others = ["tests/e2e/test_serve.py", "tests/e2e/test_tiering.py", "tests/x.py"]
    units = {work_unit(f"{m}::test_a") for m in others} | shared
    assert len(units) == len(others) + 1
    assert work_unit("tests/x.py::C::test_b") == work_unit("tests/x.py::test_a")


def test_one_worker_runs_both_modules_of_the_shared_server(tmp_path):
    """Two workers, and only the two modules sharing the server: plain
    ``loadfile`` hands one to each worker (the first unit each), ours both
    to one."""
    for module in SHARED_SERVER_MODULES:
        path = tmp_path / module
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "import os\n\n\ndef test_worker():\n"
            f"    with open({str(tmp_path / 'workers')!r}, 'a') as f:\n"
            "        f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n"
        )
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
        "from tests.conftest import pytest_xdist_make_scheduler  # noqa: F401\n"
    )
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
    args += ["--dist", "loadfile", "--rootdir", str(tmp_path), str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, *args], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    workers = (tmp_path / "workers").read_text().split()
    assert len(workers) == 2 and len(set(workers)) == 1, workers
