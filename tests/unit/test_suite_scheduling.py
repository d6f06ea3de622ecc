"""How the suite is split over pytest-xdist's workers (scripts/run_tests.sh):
whole modules per worker (pyproject.toml's ``--dist loadfile``), the
modules sharing one server as one unit, and each worker's share of the cores
(tests/conftest.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import REPO, SHARED_SERVER_MODULES, work_unit, worker_threads


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
    run_two_workers(tmp_path, "pytest_xdist_make_scheduler")
    workers = (tmp_path / "workers").read_text().split()
    assert len(workers) == 2 and len(set(workers)) == 1, workers


def run_two_workers(tmp_path, hook: str, env: dict[str, str] | None = None) -> None:
    """``pytest -n 2 --dist loadfile`` over the tests in ``tmp_path`` (in
    ``env``, else this environment), with tests/conftest.py's ``hook`` (and
    only it) in their conftest.py."""
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
        f"from tests.conftest import {hook}  # noqa: F401\n"
    )
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
    args += ["--dist", "loadfile", "--rootdir", str(tmp_path), str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_worker_gets_its_share_of_the_cores_as_openmp_threads():
    cores = len(os.sched_getaffinity(0))
    assert worker_threads({"PYTEST_XDIST_WORKER_COUNT": "2"}) == str(max(1, cores // 2))
    assert worker_threads({"PYTEST_XDIST_WORKER_COUNT": str(4 * cores)}) == "1"
    # Outside xdist, or set by the user: left alone.
    assert worker_threads({}) is None
    users = {"PYTEST_XDIST_WORKER_COUNT": "2", "OMP_NUM_THREADS": "8"}
    assert worker_threads(users) is None


def test_workers_and_what_they_start_run_their_share_of_threads(tmp_path):
    """Torch in a worker, and in a process the worker starts, run that many
    threads; a user's OMP_NUM_THREADS is kept."""
    probe = "import torch; print(torch.get_num_threads())"
    (tmp_path / "test_threads.py").write_text(
        "import os, subprocess, sys\n\n\ndef test_threads():\n"
        "    import torch\n\n"
        f"    child = subprocess.run([sys.executable, '-c', {probe!r}],\n"
        "        capture_output=True, text=True, check=True).stdout.strip()\n"
        f"    with open({str(tmp_path / 'threads')!r}, 'w') as f:\n"
        "        omp = os.environ.get('OMP_NUM_THREADS')\n"
        "        f.write(f'{omp} {torch.get_num_threads()} {child}')\n"
    )
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    run_two_workers(tmp_path, "pytest_configure", env)
    assert (tmp_path / "threads").read_text().split() == [share, share, share]
    run_two_workers(tmp_path, "pytest_configure", {**env, "OMP_NUM_THREADS": "3"})
    assert (tmp_path / "threads").read_text().split()[0] == "3"
