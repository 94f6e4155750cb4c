"""Time to accuracy, echo2 against TRL, paired by seed (issue 42 part 2): reads the raw output of
`time_to_accuracy.py --seeds ...` and says what it resolves.

A seed fixes the training problems on both sides, so the comparison is paired: per seed the ratio
echo2 seconds / TRL seconds to the target, its geometric mean with a t-interval on the log ratios,
and the sign test over seeds. Beside it, the same at other thresholds (from every run's evaluations),
the per-step time (the resolved figure), and how many seeds would resolve the observed log ratio
with 80% power (one-sample t on the paired log ratios, exact noncentral t).

    python experiments/time_to_accuracy/paired_report.py docs/bench/time_to_accuracy_seeds.json \
        --json docs/bench/time_to_accuracy_paired.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import numpy as np  # noqa: E402
from scipy import stats as sps  # noqa: E402
from stats import LEVEL, mean_ci  # noqa: E402

SIDES = ("echo2-hf", "trl")


def seconds_to(run: dict, target: float) -> float | None:
    """Training seconds at the first evaluation at or above `target` (None: never reached)."""
    for _step, seconds, accuracy in run["evals"]:
        if accuracy >= target - 1e-12:
            return float(seconds)
    return None


def one_sample_power(gap: float, sd: float, n: int, alpha: float = 1 - LEVEL) -> float:
    """Power of the two-sided one-sample t-test of mean 0 when the true mean is `gap`."""
    df, nc = n - 1, abs(gap) / (sd / math.sqrt(n))
    q = sps.t.ppf(1 - alpha / 2, df)
    return float(sps.nct.sf(q, df, nc) + sps.nct.cdf(-q, df, nc))


def seeds_to_resolve(gap: float, sd: float, power: float = 0.8, most: int = 10_000) -> int:
    n = 2
    while one_sample_power(gap, sd, n) < power:
        n += 1
        if n > most:
            raise ValueError(f"more than {most} seeds")
    return n


def paired(runs: list[dict], target: float) -> dict:
    """Per seed seconds to `target` on both sides and the paired ratio's figures."""
    by = {(r["side"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    rows = []
    for s in seeds:
        a, b = seconds_to(by[SIDES[0], s], target), seconds_to(by[SIDES[1], s], target)
        rows.append({"seed": s, "echo2_s": a, "trl_s": b, "ratio": a / b if a and b else None})
    both = [r for r in rows if r["ratio"] is not None]
    out: dict = {"target": target, "seeds": rows, "n_paired": len(both)}
    out["median_s"] = {
        SIDES[0]: float(np.median([r["echo2_s"] for r in rows if r["echo2_s"] is not None])),
        SIDES[1]: float(np.median([r["trl_s"] for r in rows if r["trl_s"] is not None])),
    }
    if len(both) >= 2:
        logs = np.log([r["ratio"] for r in both])
        iv = mean_ci(logs)
        faster = sum(1 for r in both if r["ratio"] < 1)
        out["geomean_ratio"] = {
            "estimate": math.exp(iv.estimate),
            "low": math.exp(iv.low),
            "high": math.exp(iv.high),
        }
        out["sign_test"] = {
            "echo2_faster": faster,
            "n": len(both),
            "p_two_sided": float(sps.binomtest(faster, len(both)).pvalue),
        }
        out["resolved"] = not (iv.low <= 0.0 <= iv.high)
        sd = float(np.std(logs, ddof=1))
        out["seeds_for_80pct_power"] = seeds_to_resolve(float(logs.mean()), sd) if sd > 0 else None
    return out


def per_step(runs: list[dict]) -> dict:
    seconds = {s: [r["seconds_per_step"] for r in runs if r["side"] == s] for s in SIDES}
    a, b = mean_ci(seconds[SIDES[0]]), mean_ci(seconds[SIDES[1]])
    return {
        "seconds_per_step": {
            s: {"mean": iv.estimate, "low": iv.low, "high": iv.high}
            for s, iv in zip(SIDES, (a, b), strict=True)
        },
        "ratio_of_means": b.estimate / a.estimate,
    }


def report(raw: dict, targets: list[float]) -> dict:
    runs = raw["runs"]
    return {
        "source": raw.get("setup"),
        "per_step": per_step(runs),
        "thresholds": [paired(runs, t) for t in targets],
    }


def lines(rep: dict) -> list[str]:
    ps = rep["per_step"]["seconds_per_step"]
    out = [
        f"per step: echo2 {ps[SIDES[0]]['mean']:.1f} s [{ps[SIDES[0]]['low']:.1f}, {ps[SIDES[0]]['high']:.1f}], "
        f"TRL {ps[SIDES[1]]['mean']:.1f} s [{ps[SIDES[1]]['low']:.1f}, {ps[SIDES[1]]['high']:.1f}]: "
        f"{rep['per_step']['ratio_of_means']:.2f}x"
    ]
    for t in rep["thresholds"]:
        head = f"to {t['target']}: medians echo2 {t['median_s'][SIDES[0]]:.0f} s, TRL {t['median_s'][SIDES[1]]:.0f} s"
        if "geomean_ratio" in t:
            g, st = t["geomean_ratio"], t["sign_test"]
            head += (
                f"; paired ratio (geometric mean) {g['estimate']:.2f} [95% {g['low']:.2f}, {g['high']:.2f}], "
                f"echo2 faster on {st['echo2_faster']} of {st['n']} seeds (sign test p = {st['p_two_sided']:.4f}): "
                f"{'resolved' if t['resolved'] else 'not resolved'}; "
                f"{t['seeds_for_80pct_power']} seeds would resolve this ratio with 80% power"
            )
        out.append(head)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", type=Path, help="time_to_accuracy.py's --json output with several seeds")
    ap.add_argument("--targets", type=float, nargs="+", default=[0.8, 0.75])
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    args = ap.parse_args(argv)
    rep = report(json.loads(args.raw.read_text()), args.targets)
    print("\n".join(lines(rep)))
    if args.json is not None:
        args.json.write_text(json.dumps(rep, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
