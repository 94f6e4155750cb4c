"""Plot reward per step of one or more runs (metrics.jsonl) into a PNG, with a moving average.

python scripts/plot_runs.py runs/quickstart-seed0 runs/quickstart-seed1 --out runs/quickstart_reward.png

A run without metrics.jsonl exits with status 2 and one line naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from echo2.metrics import read_metrics  # noqa: E402


def moving_average(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--window", type=int, default=10)
    args = p.parse_args()
    for run in args.runs:
        if not (run / "metrics.jsonl").is_file():
            print(f"plot_runs: {run}: no metrics.jsonl (not a run directory?)", file=sys.stderr)
            return 2
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in args.runs:
        rows = read_metrics(run / "metrics.jsonl")
        steps = [r["step"] for r in rows]
        reward = [r["reward/mean"] for r in rows]
        label = run.name
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
        if summary.get("eval_before") and summary.get("eval_after"):
            label += (
                f": held-out {summary['eval_before']['eval/accuracy']:.2f}"
                f" -> {summary['eval_after']['eval/accuracy']:.2f}"
            )
        (line,) = ax.plot(steps, moving_average(reward, args.window), label=label)
        ax.plot(steps, reward, color=line.get_color(), alpha=0.25, linewidth=0.8)
    ax.set_xlabel("learner step")
    ax.set_ylabel(f"mean rollout reward ({args.window}-step moving average)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
