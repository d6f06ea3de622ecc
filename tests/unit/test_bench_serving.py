"""benchmarks/bench_serving.py and its modules: what they read, plan and
compute, without a server."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import pytest

from benchmarks import bench_serving as bs
from benchmarks import serving_report as report
from benchmarks import serving_workloads as wl
from benchmarks.common import SMALL_MODEL, ModelArgs, add_model_args, model_args
from benchmarks.serving_server import (
    COUNTERS,
    counter_deltas,
    offload_config,
    parse_omp_binding,
    prometheus_totals,
    serve_flags,
    server_env,
)
from tests.unit.kv_helpers import GUIDE_EXTRA

REPO = Path(__file__).resolve().parents[2]

METRICS_PAGE = """\
# HELP vllm:prompt_tokens_cached_by_source_total cached prompt tokens
# TYPE vllm:prompt_tokens_cached_by_source_total counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="host"} 512.0
vllm:prompt_tokens_cached_by_source_total{engine="0",source="device"} 128.0
# HELP vllm:num_preemptions_total preemptions
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
vllm:num_preemptions_total{engine="1",model_name="m"} 1.0
"""


def test_metrics_are_summed_over_labels_but_the_source():
    totals = prometheus_totals(METRICS_PAGE)
    assert totals[COUNTERS["cpu_hit_tokens"]] == 512
    assert totals[COUNTERS["device_hit_tokens"]] == 128
    assert totals["vllm:num_preemptions_total"] == 4


def test_counter_deltas_treat_missing_counters_as_zero():
    before = {COUNTERS["cpu_hit_tokens"]: 100.0}
    after = {COUNTERS["cpu_hit_tokens"]: 612.0, COUNTERS["preemptions"]: 2.0}
    d = counter_deltas(before, after)
    assert d["cpu_hit_tokens"] == 512
    assert d["preemptions"] == 2
    assert d["load_bytes"] == 0


def bench_json(**over):
    """A ``vllm bench serve`` result file, with ``over`` changed."""
    base = {
        "completed": 10, "failed": 0, "request_throughput": 2.0,
        "output_throughput": 32.0, "mean_ttft_ms": 300.0, "median_ttft_ms": 250.0,
        "p99_ttft_ms": 900.0, "p100_ttft_ms": 1000.0, "mean_tpot_ms": 40.0,
        "median_tpot_ms": 39.0,
    }  # fmt: skip
    return {**base, **over}


def test_bench_serve_result_keys_map_to_ours():
    got = wl.parse_bench_result(bench_json())
    assert got["req_per_s"] == 2.0
    assert got["ttft_p99_ms"] == 900.0
    assert got["ttft_max_ms"] == 1000.0
    assert got["tpot_mean_ms"] == 40.0
    # A file that is no bench result is refused.
    with pytest.raises(ValueError, match="not a bench serve result"):
        wl.parse_bench_result({"date": "x"})


def test_ratios_are_on_over_off():
    off = wl.parse_bench_result(bench_json())
    on = wl.parse_bench_result(bench_json(request_throughput=3.0, p99_ttft_ms=450.0))
    r = report.ratios(off, on)
    assert r["req_per_s"] == 1.5
    assert r["ttft_p99_ms"] == 0.5
    assert r["tpot_mean_ms"] == 1.0
    # A zero off value gives NaN, not a division error.
    r = report.ratios({"req_per_s": 0.0}, {"req_per_s": 1.0})
    assert math.isnan(r["req_per_s"])


def record(rnd, offload, kind="prefix_repetition", conc=4, load=(), **bench):
    """A record as run_workload and run_server write it."""
    return {
        "round": rnd,
        "offload": offload,
        "workload": f"{kind}_c{conc}",
        "kind": kind,
        "concurrency": conc,
        "bench": wl.parse_bench_result(bench_json(**bench)),
        "counters": dict.fromkeys(COUNTERS, 0.0),
        "rss_gib": 1.0,
        "loadavg_1m": list(load),
    }


def test_rounds_pair_off_with_on_and_goals_need_every_round():
    """A round without its other half gets no ratio and counts for no goal."""
    recs = [
        record(0, False),
        record(0, True, request_throughput=4.0, median_ttft_ms=100.0),
        record(1, True, request_throughput=2.8, median_ttft_ms=100.0),
        record(1, False),
        record(2, False),
    ]
    *pairs, half = report.pair_rounds(recs)
    assert [p["ratios"]["req_per_s"] for p in pairs] == [2.0, 1.4]
    assert "ratios" not in half
    checked = report.check_goals([*pairs, half], report.GOALS["issue18"])
    goals = {(g["kind"], g["ratio"]): g for g in checked}
    throughput = goals[("prefix_repetition", "req_per_s")]
    assert throughput["measured"] == [2.0, 1.4]
    assert throughput["met"] is False  # round 1 misses 1.5
    assert goals[("prefix_repetition", "ttft_median_ms")]["met"] is True  # 0.4
    assert ("no_reuse", "req_per_s") not in goals  # not measured: not reported


def test_each_figure_has_the_load_average_seen_while_it_was_measured():
    recs = [record(0, False, load=[1.5, 2.0]), record(0, True, load=[3.25])]
    recs[1]["bench"]["req_per_s"] = 4.0
    (pair,) = report.pair_rounds(recs)
    assert pair["ratios"]["req_per_s"] == 2.0
    assert pair["load"] == 3.25  # the peak over both servers
    (goal,) = [
        g
        for g in report.check_goals([pair], report.GOALS["issue26"])
        if g["ratio"] == "req_per_s"
    ]
    assert (goal["measured"], goal["load"]) == ([2.0], [3.25])
    table = report.report_markdown(
        {"pairs": [pair], "goals": [goal], "greedy_differing": 0}
    )
    assert "| 2.0 / 3.2 |" in table  # load avg off / on beside the row
    assert "| 2.00 (3.2) |" in table  # and beside the goal's figure


def issue26_pairs(quiet=1.6, busy=1.4, p99=1.0, tpot=1.05, no_reuse=0.95):
    """Two rounds at 8 and 16 concurrent of issue 26's workloads, on/off
    ratios as given (off: bench_json's figures)."""
    off = bench_json()
    reuse = {"p99_ttft_ms": off["p99_ttft_ms"] * p99,
             "mean_tpot_ms": off["mean_tpot_ms"] * tpot}  # fmt: skip
    kinds = (("prefix_repetition", quiet, reuse), ("hog", busy, reuse),
             ("no_reuse", no_reuse, {}))  # fmt: skip
    recs = []
    for rnd, conc, (kind, thr, on) in itertools.product((0, 1), (8, 16), kinds):
        throughput = off["request_throughput"] * thr
        recs.append(record(rnd, False, kind, conc))
        recs.append(record(rnd, True, kind, conc, request_throughput=throughput, **on))
    return report.pair_rounds(recs)


def unmet_issue26_goals(**ratios) -> set:
    checked = report.check_goals(issue26_pairs(**ratios), report.GOALS["issue26"])
    assert all(len(g["measured"]) == 4 for g in checked)  # 2 rounds x 2 conc.
    return {(g["kind"], g["ratio"]) for g in checked if not g["met"]}


@pytest.mark.parametrize(
    "ratios, missed",
    [
        ({}, set()),  # met at their bounds
        ({"quiet": 1.59}, {("prefix_repetition", "req_per_s")}),
        ({"busy": 1.39}, {("hog", "req_per_s")}),
        ({"p99": 1.01}, {(k, "ttft_p99_ms") for k in ("prefix_repetition", "hog")}),
        ({"tpot": 1.06}, {(k, "tpot_mean_ms") for k in ("prefix_repetition", "hog")}),
        ({"no_reuse": 0.94}, {("no_reuse", "req_per_s")}),
        # Throughput: 1.6 quiet but 1.4 beside a busy core; 1.5x passes with
        # one busy core, not on a quiet host.
        ({"quiet": 1.5, "busy": 1.5}, {("prefix_repetition", "req_per_s")}),
    ],
)  # fmt: skip
def test_issue26_goals_are_met_at_their_bounds_and_missed_just_past(ratios, missed):
    assert unmet_issue26_goals(**ratios) == missed


def test_the_committed_run_reports_again_with_its_goals(capsys):
    path = REPO / "docs" / "figures" / "serving_benchmark.json"
    committed = json.loads(path.read_text())
    goal_set = committed.get("goal_set", "issue18")  # runs before the sets
    bs.main(["--from-json", str(path), "--goals", goal_set])
    out = capsys.readouterr().out
    again = bs.summarize(json.loads(path.read_text()), goal_set)
    assert [g["measured"] for g in again["goals"]] == [
        g["measured"] for g in committed["goals"]
    ]
    assert [g["met"] for g in again["goals"]] == [g["met"] for g in committed["goals"]]
    for g in committed["goals"]:
        assert f"| {g['kind']} | {g['ratio']} on/off | {g['goal']} | " in out


def test_the_openmp_binding_is_read_from_vllms_server_log():
    log = (
        "(EngineCore pid=1) INFO [ompmultiprocessing.py:185] OpenMP thread "
        "binding info: \n\tlocal_world_size=1, reserve_cpu_num=2\n"
        "\tlocal_rank=0, core ids=[0, 1]\n\treserved_cpus=[]\n"
    )
    assert parse_omp_binding(log) == {"omp_cores": [0, 1], "reserved_cpus": []}
    assert parse_omp_binding("no binding logged") is None


def test_multi_turn_requests_are_summarized_like_bench_serve():
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput as Out

    outs = [
        Out(success=True, ttft=0.1, latency=1.1, output_tokens=11),
        Out(success=True, ttft=0.3, latency=2.3, output_tokens=21),
        Out(success=False, ttft=0.0, latency=0.0, output_tokens=0),
    ]
    s = wl.summarize_requests(outs, duration_s=4.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["req_per_s"] == 0.5
    assert s["out_tok_per_s"] == 8.0
    assert s["ttft_median_ms"] == pytest.approx(200.0)
    assert s["ttft_max_ms"] == pytest.approx(300.0)
    assert s["tpot_mean_ms"] == pytest.approx(100.0)  # 1 s / 10, 2 s / 20


def test_greedy_differences_count_per_prompt_across_servers_and_passes():
    same = [[[1, 2], [3, 4]], [[1, 2], [3, 4]]]
    assert report.greedy_differences({"r0-off": same, "r0-on": same}) == 0
    other = [[[1, 2], [3, 5]], [[1, 2], [3, 5]]]
    # Prompt 2 differs from the reference in both passes.
    assert report.greedy_differences({"r0-off": same, "r0-on": other}) == 2
    flaky = [[[1, 2], [3, 4]], [[1, 2], [9, 9]]]
    assert report.greedy_differences({"r0-off": same, "r0-on": flaky}) == 2


def test_the_working_set_is_the_given_multiple_of_the_device_cache():
    sizes = wl.Sizes(96, working_set=2.0, prefix_len=512, suffix_len=64,
                     output_len=16, repeats=3)  # fmt: skip
    # 2 x 96 blocks x 128 tokens = 48 prefixes of 512 tokens.
    assert sizes.num_prefixes == 48
    assert sizes.num_prefixes * 512 == 2 * 96 * wl.BLOCK_TOKENS


def test_every_workload_kind_is_planned_and_off_and_on_share_the_flags():
    args = bs.parse_args([])
    sizes = wl.Sizes(96, 2.0, 512, 64, 16, 3)
    kinds = {w.kind for w in wl.workloads(args, sizes)}
    assert kinds == {
        "prefix_repetition",
        "hog",
        "shared_prefix",
        "no_reuse",
        "multi_turn",
    }
    off = serve_flags(sizes.device_blocks, 16)
    on = serve_flags(sizes.device_blocks, 16, sizes.cpu_blocks)
    assert on == off + ["--kv-transfer-config", offload_config(sizes.cpu_blocks)]


def issue26_args(*extra):
    args = bs.parse_args(["--preset", "issue26", *extra])
    return args, wl.Sizes.of(args)


def test_the_issue26_preset_is_issue_26s_shape():
    args, sizes = issue26_args()
    assert model_args(args) == ModelArgs(**{**SMALL_MODEL.__dict__, "layers": 6})
    assert args.dtype == "float32"
    assert sizes.device_blocks == 128
    assert (sizes.num_prefixes, sizes.prefix_len) == (32, 1024)
    # Prefixes and their suffixes: ~2.25x the device cache's tokens.
    tokens = sizes.num_prefixes * (sizes.prefix_len + sizes.suffix_len)
    assert tokens / (sizes.device_blocks * wl.BLOCK_TOKENS) == 2.25
    plan = wl.workloads(args, sizes)
    assert [(w.kind, w.concurrency) for w in plan] == [
        ("prefix_repetition", 8), ("prefix_repetition", 16),
        ("hog", 8), ("hog", 16),
        ("no_reuse", 8), ("no_reuse", 16),
    ]  # fmt: skip
    assert all(w.num_prompts == 96 for w in plan if w.kind != "no_reuse")
    assert (args.rounds, args.goals) == (2, "issue26")


def test_the_issue26_preset_serves_the_guides_config_as_is():
    args, sizes = issue26_args()
    flags = serve_flags(sizes.device_blocks, 16, sizes.cpu_blocks)
    config = json.loads(flags[flags.index("--kv-transfer-config") + 1])
    assert config == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": GUIDE_EXTRA,
    }
    assert not [k for k in server_env() if "CPU_NUM" in k or "OMP" in k]


def test_flags_given_beside_a_preset_win():
    args, _ = issue26_args("--rounds", "1", "--concurrency", "8")
    assert (args.rounds, args.concurrency, args.layers) == (1, [8], 6)
    quick = bs.parse_args(["--quick", "--rounds", "3"])
    assert (quick.rounds, quick.device_blocks) == (3, 24)


def test_the_estimate_grows_with_servers_layers_tokens_and_the_hog():
    args, sizes = issue26_args()
    plan = wl.workloads(args, sizes)
    four = wl.estimate_seconds(plan, servers=4, layers=6)
    assert wl.estimate_seconds(plan, servers=8, layers=6) == 2 * four
    assert wl.estimate_seconds(plan, servers=4, layers=12) > four
    quiet, hog = plan[0], plan[2]
    assert quiet.num_prompts == hog.num_prompts
    assert quiet.prompt_tokens == hog.prompt_tokens
    assert wl.estimate_seconds([hog], 1, 6) > wl.estimate_seconds([quiet], 1, 6)


def test_model_args_are_the_tiny_model_spec_fields():
    p = argparse.ArgumentParser()
    add_model_args(p, SMALL_MODEL)
    args = p.parse_args(["--layers", "2"])
    m = model_args(args)
    assert m == ModelArgs(**{**SMALL_MODEL.__dict__, "layers": 2})
    spec = m.spec(max_positions=4096)
    assert (spec.num_layers, spec.hidden_size, spec.num_kv_heads) == (2, 512, 4)
    assert spec.max_position_embeddings == 4096
