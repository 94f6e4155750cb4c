"""Benchmark: `echo2 run --workers K` on the quickstart task for several staleness bounds S.

For each S, runs the real learner with K local worker processes (loopback HTTP, shared cores) for a
few steps and reads the run's summary: bubble ratio (learner idle / (idle + train)), observed
staleness histogram of consumed records, median T_train and T_bcast (q = 0.9).

    python bench/staleness_sweep.py --workers 2 --steps 8 --staleness 0 1 2 4 --json docs/bench/staleness.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import write_json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/quickstart.toml")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the steady-state bubble ratio")
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in args.staleness:
            run_dir = Path(tmp) / f"s{s}"
            cmd = [
                sys.executable,
                "-m",
                "echo2.cli",
                "run",
                args.config,
                f"--workers={args.workers}",
                f"--learner.staleness={s}",
                f"--learner.steps={args.steps}",
                "--run.eval_size=0",
                f"--run.dir={run_dir}",
                "-q",
            ]
            subprocess.run(cmd, check=True)
            summary = json.loads((run_dir / "summary.json").read_text())
            metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            steady = metrics[args.warmup :]  # the first steps wait for workers to load the model
            wait = sum(m["time/learner_wait"] for m in steady)
            train = sum(m["time/train"] for m in steady)
            row = {
                "staleness": s,
                "workers": args.workers,
                "steps": args.steps,
                "bubble_ratio_all_steps": summary["bubble_ratio"],
                "bubble_ratio_steady": wait / (wait + train),
                "t_train": summary["t_train"],
                "t_bcast": summary["t_bcast"],
                "staleness_histogram": summary["staleness_histogram"],
                "max_staleness": max(m["staleness/max"] for m in metrics),
                "reward_mean": sum(m["reward/mean"] for m in metrics) / len(metrics),
                "ingest_rejected": summary["ingest_rejected"],
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
