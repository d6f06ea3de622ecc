"""The serving benchmark's report: off and on paired per round and workload,
their ratios, the goals checked against them, a markdown table and plots.
Pure functions of the recorded numbers (``--from-json`` reports an earlier
run again).
"""

from __future__ import annotations

from pathlib import Path

# Ratios on/off reported.
RATIO_KEYS = ("req_per_s", "out_tok_per_s", "ttft_median_ms", "ttft_p99_ms",
              "ttft_max_ms", "tpot_mean_ms")  # fmt: skip
REUSE = ("prefix_repetition", "hog")  # prefix reuse, quiet and beside a busy core
# Goals: (workload kind, ratio key, bound, "min"|"max"), per issue.
GOALS = {
    "issue18": [
        *((k, r, b, s) for k in REUSE for r, b, s in (
            ("req_per_s", 1.5, "min"), ("ttft_median_ms", 0.5, "max"),
            ("ttft_p99_ms", 1.0, "max"), ("tpot_mean_ms", 1.0, "max"))),
        ("no_reuse", "req_per_s", 0.98, "min"),
        ("no_reuse", "tpot_mean_ms", 1.02, "max"),
    ],
    "issue26": [
        *((k, r, b, s) for k in REUSE for r, b, s in (
            ("req_per_s", 1.6 if k == "prefix_repetition" else 1.4, "min"),
            ("ttft_p99_ms", 1.0, "max"), ("tpot_mean_ms", 1.05, "max"))),
        ("no_reuse", "req_per_s", 0.95, "min"),
    ],
}  # fmt: skip


def ratios(off: dict, on: dict) -> dict[str, float]:
    """on / off for each ratio key both sides have (nan where off is 0)."""
    out = {}
    for key in RATIO_KEYS:
        a, b = off.get(key), on.get(key)
        if a is None or b is None:
            continue
        out[key] = b / a if a else float("nan")
    return out


def peak_load(*records: dict) -> float:
    """The highest 1-minute load average seen during these records."""
    return max((x for r in records for x in r.get("loadavg_1m", [])), default=0.0)


def pair_rounds(records: list[dict]) -> list[dict]:
    """Joins off and on records of the same round and workload; adds ratios
    and the peak load average seen while either ran."""
    by_key: dict[tuple, dict] = {}
    for rec in records:
        key = (rec["round"], rec["workload"])
        p = by_key.setdefault(key, {"round": rec["round"], "workload": rec["workload"]})
        p.update(kind=rec["kind"], concurrency=rec["concurrency"])
        p["on" if rec["offload"] else "off"] = rec
    pairs = [by_key[key] for key in sorted(by_key)]
    for p in pairs:
        if "off" in p and "on" in p:
            p["ratios"] = ratios(p["off"]["bench"], p["on"]["bench"])
            p["load"] = peak_load(p["off"], p["on"])
    return pairs


def check_goals(pairs: list[dict], goals: list[tuple]) -> list[dict]:
    """Each goal against every measured (round, workload) of its kind: met
    only if every ratio measured meets it. Beside each ratio, the peak load
    average while it was measured."""
    rows = []
    for kind, key, bound, sense in goals:
        seen = [p for p in pairs if p["kind"] == kind and key in p.get("ratios", {})]
        if not seen:
            continue
        measured = [p["ratios"][key] for p in seen]
        worst = min(measured) if sense == "min" else max(measured)
        rows.append(
            {
                "kind": kind,
                "ratio": key,
                "goal": f"{'>=' if sense == 'min' else '<='} {bound:g}",
                "measured": measured,
                "load": [p.get("load") for p in seen],
                "met": bool(worst >= bound if sense == "min" else worst <= bound),
            }
        )
    return rows


def greedy_differences(greedy: dict[str, list]) -> int:
    """Prompt outputs (over both passes) differing from the first server's."""
    tags = sorted(greedy)
    if not tags:
        return 0
    ref = greedy[tags[0]]
    n = 0
    for tag in tags[1:]:
        for pass_ref, pass_other in zip(ref, greedy[tag], strict=True):
            n += sum(a != b for a, b in zip(pass_ref, pass_other, strict=True))
    for passes in greedy.values():  # and within a server, pass 1 vs pass 2
        n += sum(a != b for a, b in zip(passes[0], passes[1], strict=True))
    return n


def _pair_row(p: dict) -> str:
    off, on, r = p["off"], p["on"], p["ratios"]
    b0, b1 = off["bench"], on["bench"]

    def cell(key, fmt="{:.0f}"):
        return f"{fmt.format(b0[key])} → {fmt.format(b1[key])} ({r[key]:.2f})"

    c0, c1 = off["counters"], on["counters"]
    return (
        f"| {p['round']} | {p['workload']} | {p['concurrency']} "
        f"| {cell('req_per_s', '{:.2f}')} | {cell('ttft_median_ms')} "
        f"| {cell('ttft_p99_ms')} | {cell('ttft_max_ms')} "
        f"| {cell('tpot_mean_ms', '{:.1f}')} | {c1['cpu_hit_tokens']:.0f} "
        f"| {c0['device_hit_tokens']:.0f} / {c1['device_hit_tokens']:.0f} "
        f"| {c0['preemptions']:.0f} / {c1['preemptions']:.0f} "
        f"| {b0['failed']:.0f} / {b1['failed']:.0f} "
        f"| {off['rss_gib']:.2f} / {on['rss_gib']:.2f} "
        f"| {peak_load(off):.1f} / {peak_load(on):.1f} |"
    )


def report_markdown(result: dict) -> str:
    """The per-round table, the goals table and the greedy check."""
    lines = [
        "| round | workload | conc. | req/s off → on (×) | TTFT median ms off → on (×) "
        "| TTFT p99 ms (×) | TTFT max ms (×) | TPOT ms (×) | CPU-hit tokens on "
        "| device-hit off / on | preempt. off / on | failed | RSS GiB off / on "
        "| load avg off / on (1 min, max) |",
        "|---" * 14 + "|",
    ]
    lines += [_pair_row(p) for p in result["pairs"] if "ratios" in p]
    lines += [
        "",
        "| goal | ratio | bound | measured per round (load avg) | met |",
        "|---|---|---|---|---|",
    ]
    for g in result["goals"]:
        meas = ", ".join(
            f"{x:.2f}" + (f" ({load:.1f})" if load is not None else "")
            for x, load in zip(g["measured"], g.get("load", []), strict=False)
        )
        lines.append(
            f"| {g['kind']} | {g['ratio']} on/off | {g['goal']} | {meas} "
            f"| {'yes' if g['met'] else 'no'} |"
        )
    lines += ["", f"greedy outputs differing: {result['greedy_differing']}"]
    return "\n".join(lines)


def plot(result: dict, out_dir: Path) -> list[Path]:
    """Throughput and TTFT percentiles against concurrency (prefix reuse),
    each point the mean over the rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in result["records"] if r["kind"] == "prefix_repetition"]
    conc = sorted({r["concurrency"] for r in recs})
    out_dir.mkdir(parents=True, exist_ok=True)

    def mean(offload: bool, key: str, c: int) -> float:
        vals = [r["bench"][key] for r in recs
                if r["offload"] == offload and r["concurrency"] == c]  # fmt: skip
        return sum(vals) / len(vals) if vals else float("nan")

    sides = (("off", False, "tab:red"), ("on", True, "tab:blue"))
    figures = {  # file: y label, y scale, lines (style, side, key, label suffix)
        "serving_throughput.png": ("requests / s", "linear", [
            (style, side, "req_per_s", "")
            for side, style in zip(sides, ("o--", "s-"), strict=True)]),
        "serving_ttft.png": ("TTFT (ms)", "log", [
            (style, side, f"ttft_{stat}_ms", f" {stat}") for side in sides
            for style, stat in (("o-", "median"), ("s--", "p99"))]),
    }  # fmt: skip
    paths = []
    for name, (ylabel, yscale, lines) in figures.items():
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for style, (side, offload, color), key, suffix in lines:
            ys = [mean(offload, key, c) for c in conc]
            ax.plot(conc, ys, style, color=color, label=f"offloading {side}{suffix}")
        ax.set(xlabel="concurrent requests", ylabel=ylabel, yscale=yscale, xticks=conc)
        ax.set_title("prefix_repetition, working set 2x device cache")
        ax.legend()
        fig.tight_layout()
        paths.append(out_dir / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
