"""benchmarks/bench_serving.py: what it reads and computes, without an engine."""

from __future__ import annotations

import argparse
import math

import pytest

from benchmarks import bench_serving as bs
from benchmarks.common import SMALL_MODEL, ModelArgs, add_model_args, model_args

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
    totals = bs.prometheus_totals(METRICS_PAGE)
    assert totals[bs.COUNTERS["cpu_hit_tokens"]] == 512
    assert totals[bs.COUNTERS["device_hit_tokens"]] == 128
    assert totals["vllm:num_preemptions_total"] == 4


def test_counter_deltas_treat_missing_counters_as_zero():
    before = {bs.COUNTERS["cpu_hit_tokens"]: 100.0}
    after = {bs.COUNTERS["cpu_hit_tokens"]: 612.0, bs.COUNTERS["preemptions"]: 2.0}
    d = bs.counter_deltas(before, after)
    assert d["cpu_hit_tokens"] == 512
    assert d["preemptions"] == 2
    assert d["load_bytes"] == 0


def bench_json(**over):
    base = {
        "completed": 10,
        "failed": 0,
        "request_throughput": 2.0,
        "output_throughput": 32.0,
        "mean_ttft_ms": 300.0,
        "median_ttft_ms": 250.0,
        "p99_ttft_ms": 900.0,
        "p100_ttft_ms": 1000.0,
        "mean_tpot_ms": 40.0,
        "median_tpot_ms": 39.0,
    }
    return {**base, **over}


def test_bench_serve_result_keys_map_to_ours():
    got = bs.parse_bench_result(bench_json())
    assert got["req_per_s"] == 2.0
    assert got["ttft_p99_ms"] == 900.0
    assert got["ttft_max_ms"] == 1000.0
    assert got["tpot_mean_ms"] == 40.0


def test_a_file_that_is_no_bench_result_is_refused():
    with pytest.raises(ValueError, match="not a bench serve result"):
        bs.parse_bench_result({"date": "x"})


def test_ratios_are_on_over_off():
    off = bs.parse_bench_result(bench_json())
    on = bs.parse_bench_result(bench_json(request_throughput=3.0, p99_ttft_ms=450.0))
    r = bs.ratios(off, on)
    assert r["req_per_s"] == 1.5
    assert r["ttft_p99_ms"] == 0.5
    assert r["tpot_mean_ms"] == 1.0


def test_a_zero_off_value_gives_nan_not_a_division_error():
    r = bs.ratios({"req_per_s": 0.0}, {"req_per_s": 1.0})
    assert math.isnan(r["req_per_s"])


def record(rnd, offload, kind="prefix_repetition", **bench):
    return {
        "round": rnd,
        "offload": offload,
        "workload": f"{kind}_c4",
        "kind": kind,
        "concurrency": 4,
        "bench": bs.parse_bench_result(bench_json(**bench)),
    }


def test_rounds_pair_off_with_on_and_goals_need_every_round():
    recs = [
        record(0, False),
        record(0, True, request_throughput=4.0, median_ttft_ms=100.0),
        record(1, True, request_throughput=2.8, median_ttft_ms=100.0),
        record(1, False),
    ]
    pairs = bs.pair_rounds(recs)
    assert [p["ratios"]["req_per_s"] for p in pairs] == [2.0, 1.4]
    goals = {(g["kind"], g["ratio"]): g for g in bs.check_goals(pairs)}
    throughput = goals[("prefix_repetition", "req_per_s")]
    assert throughput["measured"] == [2.0, 1.4]
    assert throughput["met"] is False  # round 1 misses 1.5
    assert goals[("prefix_repetition", "ttft_median_ms")]["met"] is True  # 0.4
    assert ("no_reuse", "req_per_s") not in goals  # not measured: not reported


def test_a_round_without_its_other_half_gets_no_ratio():
    (pair,) = bs.pair_rounds([record(0, False)])
    assert "ratios" not in pair


def test_the_unpatched_server_is_compared_with_off_apart_from_the_goals():
    unpatched = record(0, True, request_throughput=1.0)
    unpatched["variant"] = bs.UNPATCHED
    recs = [record(0, False), record(0, True, request_throughput=4.0), unpatched]
    (pair,) = bs.pair_rounds(recs)
    assert pair["ratios"]["req_per_s"] == 2.0
    assert pair["ratios_unpatched"]["req_per_s"] == 0.5
    (goal,) = [
        g for g in bs.check_goals([pair]) if g["ratio"] == "req_per_s"
    ]  # the goals judge the shipped configuration only
    assert goal["measured"] == [2.0]
    for rec in recs:  # what run_workload adds beside the client's figures
        rec.update(counters=dict.fromkeys(bs.COUNTERS, 0.0), rss_gib=1.0, loadavg_1m=[])
    table = bs.report_markdown({"pairs": [pair], "goals": [], "greedy_differing": 0})
    assert "(vLLM's reservation)" in table


def test_the_openmp_binding_is_read_from_vllms_server_log():
    log = (
        "(EngineCore pid=1) INFO [ompmultiprocessing.py:185] OpenMP thread "
        "binding info: \n\tlocal_world_size=1, reserve_cpu_num=2\n"
        "\tlocal_rank=0, core ids=[0, 1]\n\treserved_cpus=[]\n"
    )
    assert bs.parse_omp_binding(log) == {"omp_cores": [0, 1], "reserved_cpus": []}
    assert bs.parse_omp_binding("no binding logged") is None


def test_multi_turn_requests_are_summarized_like_bench_serve():
    outs = [
        {"success": True, "ttft": 0.1, "latency": 1.1, "output_tokens": 11},
        {"success": True, "ttft": 0.3, "latency": 2.3, "output_tokens": 21},
        {"success": False, "ttft": 0.0, "latency": 0.0, "output_tokens": 0},
    ]
    s = bs.summarize_requests(outs, duration_s=4.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["req_per_s"] == 0.5
    assert s["out_tok_per_s"] == 8.0
    assert s["ttft_median_ms"] == pytest.approx(200.0)
    assert s["ttft_max_ms"] == pytest.approx(300.0)
    assert s["tpot_mean_ms"] == pytest.approx(100.0)  # 1 s / 10, 2 s / 20


def test_greedy_differences_count_per_prompt_across_servers_and_passes():
    same = [[[1, 2], [3, 4]], [[1, 2], [3, 4]]]
    assert bs.greedy_differences({"r0-off": same, "r0-on": same}) == 0
    other = [[[1, 2], [3, 5]], [[1, 2], [3, 5]]]
    # Prompt 2 differs from the reference in both passes.
    assert bs.greedy_differences({"r0-off": same, "r0-on": other}) == 2
    flaky = [[[1, 2], [3, 4]], [[1, 2], [9, 9]]]
    assert bs.greedy_differences({"r0-off": same, "r0-on": flaky}) == 2


def test_the_working_set_is_the_given_multiple_of_the_device_cache():
    sizes = bs.Sizes(
        device_blocks=96,
        working_set=2.0,
        prefix_len=512,
        suffix_len=64,
        output_len=16,
        repeats=3,
    )
    # 2 x 96 blocks x 128 tokens = 48 prefixes of 512 tokens.
    assert sizes.num_prefixes == 48
    assert sizes.num_prefixes * 512 == 2 * 96 * bs.BLOCK_TOKENS


def test_every_workload_kind_is_planned_and_off_and_on_share_the_flags():
    args = bs.parse_args([])
    sizes = bs.Sizes(96, 2.0, 512, 64, 16, 3)
    kinds = {w.kind for w in bs.workloads(args, sizes)}
    assert kinds == {
        "prefix_repetition",
        "hog",
        "shared_prefix",
        "no_reuse",
        "multi_turn",
    }
    assert '"spec_module_path": "vllm_ascend.kv_offload.npu"' in bs.offload_config(10)


def test_model_args_are_the_tiny_model_spec_fields():
    p = argparse.ArgumentParser()
    add_model_args(p, SMALL_MODEL)
    args = p.parse_args(["--layers", "2"])
    m = model_args(args)
    assert m == ModelArgs(**{**SMALL_MODEL.__dict__, "layers": 2})
    spec = m.spec(max_positions=4096)
    assert (spec.num_layers, spec.hidden_size, spec.num_kv_heads) == (2, 512, 4)
    assert spec.max_position_embeddings == 4096
