"""Suite-wide pytest settings: progress lines for the slow tests.

An end-to-end or packaging test starts real engines or builds and can run for
minutes; in pytest's default (dots) output such a test would be silent for
that long. Each one gets a line when it starts and one with its result and
duration when it ends (unless -v already shows it).
"""

from __future__ import annotations

import time

import pytest

SLOW_MARKERS = ("e2e", "packaging")

_slow: set[str] = set()
_started: dict[str, float] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(m) for m in SLOW_MARKERS):
            _slow.add(item.nodeid)


def _reporter(config: pytest.Config):
    if config.get_verbosity() > 0:
        return None  # -v prints every test already
    return config.pluginmanager.get_plugin("terminalreporter")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logstart(nodeid: str) -> None:
    if nodeid in _slow:
        _started[nodeid] = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    nodeid = report.nodeid
    if nodeid not in _slow:
        return
    tr = _reporter(_CONFIG) if _CONFIG is not None else None
    if tr is None:
        return
    if report.when == "setup" and report.passed:
        tr.ensure_newline()
        tr.write_line(f"[slow test] {nodeid} ...")
    elif report.when == "call" or (report.when == "setup" and not report.passed):
        seconds = time.monotonic() - _started.get(nodeid, time.monotonic())
        tr.ensure_newline()
        tr.write_line(f"[slow test] {nodeid} {report.outcome} ({seconds:.0f} s)")


_CONFIG: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _CONFIG
    _CONFIG = config
