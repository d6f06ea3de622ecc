"""benchmarks/serving_profile.py and its probe: what they time and add up,
without a server."""

from __future__ import annotations

import importlib.util
import time

import pytest

from benchmarks import serving_profile as sp


@pytest.fixture
def probe(monkeypatch):
    """The probe module as a server loads it, without its import hook and
    writer thread (those start only with SERVING_PROBE_DIR set)."""
    monkeypatch.delenv("SERVING_PROBE_DIR", raising=False)
    spec = importlib.util.spec_from_file_location(
        "serving_probe_under_test", sp.PROBE_DIR / "sitecustomize.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_wrapped_call_counts_its_own_time_not_that_of_wrapped_calls_inside(probe):
    inner = probe.timed("inner", lambda: time.sleep(0.05))

    def outer_body():
        inner()
        inner()

    probe.timed("outer", outer_body)()
    stats = probe.snapshot()["stats"]
    calls, wall, _ = stats["inner"]
    assert calls == 2 and wall >= 0.1e9
    assert stats["outer"][0] == 1
    assert stats["outer"][1] < wall / 2  # the sleeps are the inner calls'


def snap(t_ns: int, cpu_ns: int, stats: dict) -> dict:
    return {"pid": 1, "time_ns": t_ns, "process_cpu_ns": cpu_ns, "stats": stats}


def test_the_split_is_the_workload_delta_per_row_and_per_step():
    before = {
        "engine": snap(0, 0, {"EngineCore.step": [1, 5, 5]}),
        "worker": snap(0, 0, {"Worker.execute_model": [1, 9, 9]}),
    }
    after = {
        "engine": snap(2_000_000_000, 10**9, {
            "EngineCore.step": [5, 4e6 + 5, 1e6 + 5],
            "Scheduler.schedule": [4, 2e6, 2e6],
            "AscendOffloadingConnector.build_connector_meta": [4, 1e6, 1e6],
            "OffloadingConnector.build_connector_meta": [4, 3e6, 3e6],
        }),
        "worker": snap(2_000_000_000, 3 * 10**9, {
            "Worker.execute_model": [5, 8e8 + 9, 4e8 + 9],
            "copy.load": [2, 6e6, 2e6],
        }),
    }  # fmt: skip
    out = sp.split(sp.diff(before, after))
    rows = out["rows"]
    assert out["steps"] == 4  # Scheduler.schedule calls during the workload
    assert rows["model forward"]["cpu_s"] == pytest.approx(0.4)
    assert rows["model forward"]["cpu_ms_step"] == pytest.approx(100)
    assert rows["connector scheduler calls"]["wall_ms_step"] == pytest.approx(1.0)
    assert rows["copies (copy threads)"]["calls"] == 2
    assert out["worker_cpu_s"] == 3 and out["engine_cpu_s"] == 1
    # Copy threads are not the engine's or the worker's main thread.
    assert out["engine_thread_cpu_s"] == pytest.approx(
        sum(r["cpu_s"] for k, r in rows.items() if not k.startswith("copies"))
    )
