"""The powered staleness study's analysis (issue 23; docs/staleness.md "Recommendation"): per arm the
held-out accuracy (mean of the last 3 evaluations) with its 95% t-interval over seeds, and each lag
against lag 0 paired by seed (the same seed: the same initial model, prompt stream and held-out set),
worded by the intervals alone.

    python experiments/staleness/staleness_report.py docs/bench/staleness_powered.json --json \\
        docs/bench/staleness_powered_arms.json --md docs/bench/staleness_powered_arms.md \\
        --plot docs/staleness_powered_arms.png

A comparison lag k - lag 0 is
- "lower" / "higher" when its 95% interval excludes 0;
- "costs at most MARGIN" (non-inferiority at the margin, default 0.10) when the interval's low end
  is above -MARGIN and it contains 0;
- "not resolved" otherwise (the interval reaches below -MARGIN and contains 0).
Pure apart from `main`: `report(rows)` and `markdown(report)` read and return plain data.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # the harness the benchmarks share: bench/common.py, bench/stats.py
from stats import detectable_gap, mean_ci, paired_ci, seeds_per_arm, welch_ci  # noqa: E402

ARMS = [(0, "clip"), (4, "clip"), (8, "clip"), (4, "dual_clip"), (8, "dual_clip")]
MEASURE = "accuracy_last3"
MARGIN = 0.10


def arm_name(lag: int, correction: str) -> str:
    return f"lag {lag} {correction}"


def by_arm(rows: list[dict]) -> dict[tuple[int, str], dict[int, float]]:
    """{(lag, correction): {seed: held-out accuracy}} for the rows that have the measure."""
    out: dict[tuple[int, str], dict[int, float]] = {}
    for r in rows:
        if "lag" in r and r.get(MEASURE) is not None:
            out.setdefault((r["lag"], r["correction"]), {})[r["seed"]] = r[MEASURE]
    return out


def verdict(low: float, high: float, margin: float) -> str:
    if low > 0:
        return "higher"
    if high < 0:
        return "lower"
    if low > -margin:
        return f"costs at most {margin:.2f}"
    return "not resolved"


def report(rows: list[dict], margin: float = MARGIN) -> dict:
    arms = by_arm(rows)
    table = []
    for key in ARMS:
        values = arms.get(key, {})
        row = {"arm": arm_name(*key), "lag": key[0], "correction": key[1], "n": len(values),
               "seeds": sorted(values), "values": [values[s] for s in sorted(values)]}  # fmt: skip
        if len(values) >= 2:
            iv = mean_ci(row["values"])
            row.update(mean=iv.estimate, ci95=[iv.low, iv.high], sd=statistics.stdev(row["values"]))
        elif values:
            row.update(mean=row["values"][0], ci95=None, sd=None)
        table.append(row)
    # the pooled within-arm SD (each arm's deviations from its own mean), for power statements
    dev = [v - statistics.fmean(a.values()) for a in arms.values() if len(a) >= 2 for v in a.values()]
    df = sum(len(a) - 1 for a in arms.values() if len(a) >= 2)
    pooled_sd = math.sqrt(sum(d * d for d in dev) / df) if df > 0 else None
    comparisons = []
    pairs = [((k, "clip"), (0, "clip")) for k in (4, 8)]
    pairs += [((k, "dual_clip"), (0, "clip")) for k in (4, 8)]
    pairs += [((k, "dual_clip"), (k, "clip")) for k in (4, 8)]
    for a_key, b_key in pairs:
        a, b = arms.get(a_key, {}), arms.get(b_key, {})
        seeds = sorted(set(a) & set(b))
        c = {"a": arm_name(*a_key), "b": arm_name(*b_key), "n_pairs": len(seeds), "seeds": seeds}
        if len(seeds) >= 2:
            iv = paired_ci([a[s] for s in seeds], [b[s] for s in seeds])
            c.update(diff=iv.estimate, ci95=[iv.low, iv.high], verdict=verdict(iv.low, iv.high, margin))
            sd_diff = statistics.stdev([a[s] - b[s] for s in seeds])
            c["sd_of_differences"] = sd_diff
        if len(a) >= 2 and len(b) >= 2:
            w = welch_ci(list(a.values()), list(b.values()))
            c.update(welch_diff=w.estimate, welch_ci95=[w.low, w.high])
        comparisons.append(c)
    power = None
    if pooled_sd:
        n = min((len(v) for v in arms.values()), default=0)
        power = {
            "pooled_sd": pooled_sd,
            "df": df,
            "seeds_per_arm_for_0.10": seeds_per_arm(0.10, pooled_sd),
            "detectable_gap_two_sample_at_n": detectable_gap(n, pooled_sd) if n >= 2 else None,
            "n_smallest_arm": n,
        }
    return {"measure": MEASURE, "margin": margin, "arms": table, "comparisons": comparisons, "power": power}


def curves(rows: list[dict]) -> dict[str, dict]:
    """Per arm, held-out accuracy at each evaluation step: mean and 95% t-interval over the seeds
    (steps where at least 2 seeds have an evaluation)."""
    out = {}
    for lag, correction in ARMS:
        runs = [
            r["curve"] for r in rows if r.get("lag") == lag and r["correction"] == correction and "curve" in r
        ]
        steps = sorted({s for c in runs for s in c["eval_step"]})
        series = {"step": [], "mean": [], "low": [], "high": [], "n": []}
        for step in steps:
            values = [c["eval_accuracy"][c["eval_step"].index(step)] for c in runs if step in c["eval_step"]]
            if len(values) >= 2:
                iv = mean_ci(values)
                for k, v in zip(
                    ("step", "mean", "low", "high", "n"),
                    (step, iv.estimate, iv.low, iv.high, len(values)),
                    strict=True,
                ):
                    series[k].append(v)
        out[arm_name(lag, correction)] = series
    return out


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"lag 0 clip": "black", "lag 4 clip": "tab:orange", "lag 8 clip": "tab:red",
               "lag 4 dual_clip": "tab:olive", "lag 8 dual_clip": "tab:purple"}  # fmt: skip
    fig, (ax_c, ax_a) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, c in rep["curves"].items():
        if not c["step"]:
            continue
        style = "--" if "dual" in name else "-"
        ax_c.plot(
            c["step"], c["mean"], style, marker="o", color=colours[name], label=f"{name} (n = {max(c['n'])})"
        )
        ax_c.fill_between(c["step"], c["low"], c["high"], color=colours[name], alpha=0.12)
    ax_c.set(xlabel="learner step", ylabel="held-out greedy accuracy",
             title="held-out accuracy per arm: mean and 95% CI over seeds")  # fmt: skip
    ax_c.legend(fontsize=7, loc="lower right")
    ax_c.set_ylim(0, 1)
    arms = [a for a in rep["arms"] if a.get("ci95")]
    for i, a in enumerate(arms):
        ax_a.errorbar([i], [a["mean"]], yerr=[[a["mean"] - a["ci95"][0]], [a["ci95"][1] - a["mean"]]],
                      fmt="o", color=colours[a["arm"]], capsize=4)  # fmt: skip
        ax_a.scatter([i + 0.15] * a["n"], a["values"], color=colours[a["arm"]], s=10, alpha=0.6)
    ax_a.set_xticks(range(len(arms)), [f"{a['arm']}\nn = {a['n']}" for a in arms], fontsize=7)
    ax_a.set(ylabel="held-out accuracy, mean of the last 3 evaluations", title="per arm: mean, 95% CI, seeds")
    ax_a.set_ylim(0, 1)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def markdown(rep: dict) -> str:
    def f(x, d=3):
        return "" if x is None else f"{x:+.{d}f}" if x < 0 or x > 0 else f"{x:.{d}f}"

    lines = [
        "| arm | n (seeds) | held-out accuracy, mean of last 3 evals [95% CI] | SD over seeds | per seed |",
        "| --- | --- | --- | --- | --- |",
    ]
    for a in rep["arms"]:
        ci = f"{a['mean']:.3f} [{a['ci95'][0]:.3f}, {a['ci95'][1]:.3f}]" if a.get("ci95") else (
            f"{a['mean']:.3f} (one seed)" if a["n"] else "")  # fmt: skip
        sd = f"{a['sd']:.3f}" if a.get("sd") is not None else ""
        per = ", ".join(f"s{s} {v:.3f}" for s, v in zip(a["seeds"], a["values"], strict=True))
        lines.append(f"| {a['arm']} | {a['n']} | {ci} | {sd} | {per} |")
    lines += [
        "",
        f"| comparison | pairs (seeds) | paired difference [95% CI] | verdict (margin {rep['margin']:.2f}) "
        "| unpaired (Welch) [95% CI] |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in rep["comparisons"]:
        paired = f"{f(c['diff'])} [{f(c['ci95'][0])}, {f(c['ci95'][1])}]" if "diff" in c else ""
        welch = (f"{f(c['welch_diff'])} [{f(c['welch_ci95'][0])}, {f(c['welch_ci95'][1])}]"
                 if "welch_diff" in c else "")  # fmt: skip
        lines.append(
            f"| {c['a']} - {c['b']} | {c['n_pairs']} | {paired} | {c.get('verdict', '')} | {welch} |"
        )
    p = rep.get("power")
    if p:
        lines += [
            "",
            f"Pooled within-arm SD {p['pooled_sd']:.3f} (df {p['df']}); unpaired, 80% power at alpha 0.05 "
            f"needs {p['seeds_per_arm_for_0.10']} seeds per arm for a 0.10 gap; with "
            + (
                f"{p['n_smallest_arm']} in the smallest arm the detectable gap is "
                f"{p['detectable_gap_two_sample_at_n']:.3f} (the paired comparisons, blocked by seed, can do better)."
                if p["detectable_gap_two_sample_at_n"]
                else "one seed in the smallest arm no gap is detectable."
            ),
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="staleness_study results JSON (rows joined)")
    p.add_argument("--margin", type=float, default=MARGIN)
    p.add_argument("--json")
    p.add_argument("--md")
    p.add_argument("--plot", help="a PNG: per-arm held-out curves and last-3 means with their intervals")
    args = p.parse_args()
    rows = [r for f in args.results for r in json.loads(Path(f).read_text())["rows"]]
    rep = report(rows, args.margin)
    rep["curves"] = curves(rows)
    rep["sources"] = args.results
    if args.plot:
        plot(rep, Path(args.plot))
    text = markdown(rep)
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
