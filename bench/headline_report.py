"""The headline benchmark's report (headline.py writes the raw runs): per arm and seed, wall time
and cost to a fixed held-out accuracy, worker-seconds, learner idle fraction, broadcast time per
version and final accuracy; echo2 against sync paired by seed, with 95% intervals; a plot of
held-out accuracy against cost for both arms.

    python bench/headline_report.py docs/bench/headline_runs.jsonl --json docs/bench/headline.json --plot docs/bench/headline.png

Clock: time zero is the end of each run's step 0 (every worker has loaded the model and installed
version 0, and the learner has trained once); evaluations run on the learner's core and count.
Price model (paper Table 1, USD/hour): the learner's machine `--learner-price` (one A100, 3.06)
and each worker `--worker-price` (one RTX 5090, 0.35, as headline.py passed to the workers), paid
for every worker for the whole run (rented, busy or idle): cost = time x (learner + N workers).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from common import write_json
from stats import mean_ci, paired_ci, word_comparison

THRESHOLDS = (0.6, 0.7)
"""Fixed before the runs (headline.py's docstring): 0.6 is the primary threshold."""
LEARNER_PRICE = 3.06
WORKER_PRICE = 0.35


def per_run(record: dict[str, Any], *, learner_price: float, worker_price: float) -> dict[str, Any]:
    """One run's figures. Times in seconds from the end of step 0; None where never reached."""
    rows = record["rows"]
    t0 = rows[0]["time/wall"]
    per_hour = learner_price + record["workers"] * worker_price
    evals = [(r["step"], r["time/wall"] - t0, r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    before = record["summary"]["eval_before"]["eval/accuracy"]
    after = record["summary"]["eval_after"]["eval/accuracy"]
    end = rows[-1]["time/wall"] - t0
    curve = [(0.0, before), *[(t, a) for _, t, a in evals]]
    if not evals or evals[-1][0] != rows[-1]["step"]:
        curve.append((end, after))
    to = {}
    for thr in THRESHOLDS:
        hit = next((t for t, a in curve if a >= thr), None)
        to[str(thr)] = {"time_s": hit, "cost_usd": None if hit is None else hit * per_hour / 3600}
    bcast = {int(r["bcast/version"]): r["bcast/t_q90"] for r in rows if "bcast/version" in r}
    bcast.pop(0, None)  # version 0 is installed while the workers load the model
    return {
        "arm": record["arm"],
        "seed": record["seed"],
        "steps": len(rows),
        "to": to,
        "run_time_s": end,
        "run_cost_usd": end * per_hour / 3600,
        "worker_seconds": end * record["workers"],
        "worker_cpu_s": sum(x for x in record["worker_cpu_s"] if x is not None),
        "bubble_ratio": record["summary"]["bubble_ratio"],
        "bcast_s_median": statistics.median(bcast.values()) if bcast else None,
        "bcast_versions": len(bcast),
        "accuracy_before": before,
        "accuracy_after": after,
        "curve": [(t, t * per_hour / 3600, a) for t, a in curve],
    }


def _ratio_ci(a: Sequence[float], b: Sequence[float]) -> dict[str, Any] | None:
    """Geometric mean of a[i] / b[i] with the t-interval of the mean log ratio, exponentiated."""
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x and y]
    if len(pairs) < 2:
        return None
    iv = mean_ci([math.log(x / y) for x, y in pairs])
    low, high = math.exp(iv.low), math.exp(iv.high)
    words = "not resolved" if low <= 1.0 <= high else ("echo2 lower" if high < 1.0 else "echo2 higher")
    return {"ratio": math.exp(iv.estimate), "low": low, "high": high, "n": len(pairs), "verdict": words}


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """echo2 against sync, paired by seed: ratios (time, cost, worker-seconds, broadcast) and the
    difference of final accuracy and of the bubble ratio. Seeds with both arms only."""
    by_seed: dict[int, dict[str, dict]] = defaultdict(dict)
    for r in runs:
        by_seed[r["seed"]][r["arm"]] = r
    seeds = sorted(s for s, arms in by_seed.items() if {"echo2", "sync"} <= arms.keys())
    e = [by_seed[s]["echo2"] for s in seeds]
    y = [by_seed[s]["sync"] for s in seeds]
    out: dict[str, Any] = {"seeds": seeds}
    for thr in THRESHOLDS:
        k = str(thr)
        reached = [(a["to"][k]["time_s"], b["to"][k]["time_s"]) for a, b in zip(e, y, strict=True)]
        out[f"time_to_{k}"] = _ratio_ci([a for a, _ in reached], [b for _, b in reached])
        out[f"time_to_{k}_not_reached"] = {
            "echo2": sum(a is None for a, _ in reached),
            "sync": sum(b is None for _, b in reached),
        }
    for key in ("run_time_s", "bcast_s_median"):
        out[key] = _ratio_ci([a[key] for a in e], [b[key] for b in y])
    for key in ("accuracy_after", "bubble_ratio"):
        if len(seeds) >= 2:
            iv = paired_ci([a[key] for a in e], [b[key] for b in y])
            out[key] = {"diff": iv.estimate, "low": iv.low, "high": iv.high, "n": iv.n}
            out[key]["words"] = word_comparison(iv, a="echo2", b="sync").text
    return out


def plot(runs: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    colours = {"echo2": "tab:blue", "sync": "tab:orange"}
    for r in runs:
        xs = [c for _, c, _ in r["curve"]]
        ys = [a for _, _, a in r["curve"]]
        label = r["arm"] if r["seed"] == min(x["seed"] for x in runs if x["arm"] == r["arm"]) else None
        ax.plot(xs, ys, marker="o", ms=3, lw=1, color=colours.get(r["arm"], "grey"), alpha=0.8, label=label)
    for thr in THRESHOLDS:
        ax.axhline(thr, color="grey", lw=0.5, ls="--")
    ax.set_xlabel("cost from the end of step 0, USD (price model in headline_report.py)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("ECHO-2 (S=3, chains, deltas) vs synchronous (S=0, star, full)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("raw")
    p.add_argument("--learner-price", type=float, default=LEARNER_PRICE)
    p.add_argument("--worker-price", type=float, default=WORKER_PRICE)
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    records = [json.loads(line) for line in open(args.raw) if line.strip()]
    failed = [r for r in records if "error" in r]
    runs = [
        per_run(r, learner_price=args.learner_price, worker_price=args.worker_price)
        for r in records
        if "error" not in r
    ]
    result = {"runs": runs, "failed": failed, "comparison": compare(runs), "thresholds": THRESHOLDS}
    result["prices"] = {"learner": args.learner_price, "worker": args.worker_price}
    for r in runs:
        times = ", ".join(f"{k}: {v['time_s'] and round(v['time_s'])} s" for k, v in r["to"].items())
        print(
            f"{r['arm']:5} seed {r['seed']}: to {times}; run {r['run_time_s']:.0f} s, "
            f"bubble {r['bubble_ratio']:.2f}, bcast {r['bcast_s_median']}, acc {r['accuracy_before']:.3f} -> "
            f"{r['accuracy_after']:.3f}"
        )
    print(json.dumps(result["comparison"], indent=1))
    write_json(args.json, result)
    if args.plot and runs:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
