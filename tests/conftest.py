"""Suite-wide pytest settings: progress lines for the slow tests; how
pytest-xdist's workers split the modules and the cores; the serving doc's
client flow, run by the unit and the end-to-end tests.

An end-to-end or packaging test starts real engines or builds and can run for
minutes; in pytest's default (dots) output such a test would be silent for
that long. Each one gets a line when it starts and one with its result and
duration when it ends (unless -v already shows it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLOW_MARKERS = ("e2e", "packaging")
_started: dict[str, float] = {}


def _reporter(config: pytest.Config):
    if config.get_verbosity() > 0:
        return None  # -v prints every test already
    return config.pluginmanager.get_plugin("terminalreporter")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logstart(nodeid: str) -> None:
    _started[nodeid] = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # The markers from the report's keywords: under xdist this runs in the
    # controller, which has not collected the items.
    if not any(m in report.keywords for m in SLOW_MARKERS):
        return
    tr = _reporter(_CONFIG) if _CONFIG is not None else None
    if tr is None:
        return
    nodeid = report.nodeid
    if report.when == "setup" and report.passed:
        tr.ensure_newline()
        tr.write_line(f"[slow test] {nodeid} ...")
    elif report.when == "call" or (report.when == "setup" and not report.passed):
        seconds = time.monotonic() - _started.pop(nodeid, time.monotonic())
        tr.ensure_newline()
        tr.write_line(f"[slow test] {nodeid} {report.outcome} ({seconds:.0f} s)")


_CONFIG: pytest.Config | None = None

# Test modules sharing tests/e2e/conftest.py's package-scoped
# ``tiering_server``: under xdist one work unit, so that one worker starts
# the server once (each worker taking one of them would start its own).
SHARED_SERVER_MODULES = frozenset(
    {"tests/e2e/test_kv_events.py", "tests/e2e/test_tiering_online.py"}
)


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its module, or one unit for all of
    SHARED_SERVER_MODULES."""
    module = nodeid.split("::", 1)[0]
    return "tiering_server" if module in SHARED_SERVER_MODULES else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` (pyproject.toml) with ``work_unit``'s units."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedServerScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:  # xdist's override point
            return work_unit(nodeid)

    return SharedServerScheduling(config, log)


def worker_threads(environ: Mapping[str, str]) -> str | None:
    """``OMP_NUM_THREADS`` for a pytest-xdist worker and all it starts: its
    share of the cores. None outside xdist, or where the variable is set.

    Each worker starts engines on the same cores, and an in-process engine
    on vLLM's CPU backend runs an OpenMP thread per core: two of them on two
    cores spin at each other's barriers (the README's side-by-side timing of
    four end-to-end modules, with and without this)."""
    workers = environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None or "OMP_NUM_THREADS" in environ:
        return None
    return str(max(1, len(os.sched_getaffinity(0)) // int(workers)))


def pytest_configure(config: pytest.Config) -> None:
    global _CONFIG
    _CONFIG = config
    if threads := worker_threads(os.environ):
        os.environ["OMP_NUM_THREADS"] = threads  # before torch is imported


@dataclass
class DocFlow:
    """What the serving doc's client flow printed."""

    completions: list[dict]  # req's lines: text and usage, or the error
    resets: list[dict]  # POST /reset_prefix_cache's answers
    metrics: list[str]  # the /metrics lines it greps
    output: str  # stdout and stderr


def doc_block(
    marker: str, lang: str = "bash", doc_name: str = "serving_events_metrics.md"
) -> str:
    """The one ``lang`` block of ``docs/<doc_name>`` holding ``marker``."""
    doc = (REPO / "docs" / doc_name).read_text()
    blocks = re.findall(rf"```{lang}\n(.*?)```", doc, re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


def doc_env() -> dict[str, str]:
    """The environment the docs' commands run in: this one, with this
    interpreter's directory first on PATH (they run `python`)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    return env


def run_serving_doc_flow(port: int) -> DocFlow | None:
    """The client flow of docs/serving_events_metrics.md (curl + jq, the
    block that defines ``req``), run by bash from the checkout against
    127.0.0.1:``port`` instead of the doc's 8000; None without curl or jq."""
    if shutil.which("curl") is None or shutil.which("jq") is None:
        return None
    flow = doc_block("req() {")
    proc = subprocess.run(
        ["bash", "-c", flow.replace("127.0.0.1:8000", f"127.0.0.1:{port}")],
        cwd=REPO,
        env=doc_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    lines = proc.stdout.splitlines()
    replies = [json.loads(line) for line in lines if line.startswith("{")]
    return DocFlow(
        completions=[r for r in replies if "success" not in r],
        resets=[r for r in replies if "success" in r],
        metrics=[line for line in lines if line.startswith("vllm:")],
        output=output,
    )
