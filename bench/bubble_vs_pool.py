"""Benchmark: learner bubble ratio versus pool size, measured with EMULATED workers and predicted.

For each S and pool size N, runs the real learner (a random Llama, 16 x 16 trajectories per step, so
that a step takes about two seconds while the snapshot stays small, 25 MB) with N local workers whose engines are emulated at RATE trajectories/s each
(`echo2 run --workers N --emulate RATE`; kappa = max(1, S - 1)). Measured bubble = learner wait /
(wait + train) over the steps after the first `--warmup` (worker start-up excluded). Two
predictions from planning/capacity.py, with T_train (mean over the measured steps) and T_bcast
(median over the run) measured in the same run:
`bubble_ratio` (the paper's conservative cycle model: rollouts wait for each broadcast) and
`bubble_ratio_continuous` (workers keep generating under their installed version while the
staleness bound holds, as echo2's do). The threshold is the smallest N with bubble < 5%.

    python bench/bubble_vs_pool.py --staleness 2 3 5 --pools 1 2 3 4 5 6 --rate 35 \
        --json docs/bench/bubble.json --plot docs/bench/bubble.png
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import write_json

from echo2.config import publish_every
from echo2.planning.capacity import bubble_ratio, bubble_ratio_continuous


def one(args, s: int, n: int, tmp: Path) -> dict:
    run_dir = tmp / f"s{s}-n{n}"
    cmd = [
        sys.executable,
        "-m",
        "echo2.cli",
        "run",
        "configs/tiny.toml",
        f"--workers={n}",
        f"--emulate={args.rate}",
        f"--learner.staleness={s}",
        f"--learner.steps={args.steps}",
        "--run.eval_size=0",
        f"--model.hidden_size={args.hidden}",
        f"--model.num_layers={args.layers}",
        f"--rollout.prompts_per_step={args.prompts}",
        f"--rollout.group_size={args.n}",
        f"--coordinator.heartbeat_interval={args.heartbeat}",
        "--coordinator.groups_per_lease=1",
        f"--run.dir={run_dir}",
        "-q",
    ]
    subprocess.run(cmd, check=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][args.warmup :]
    wait = sum(r["time/learner_wait"] for r in rows)
    train = sum(r["time/train"] for r in rows)
    kappa = publish_every(None, s)
    batch = args.prompts * args.n
    measured = {
        "staleness": s,
        "kappa": kappa,
        "pool": n,
        "rate": args.rate,
        "batch": batch,
        # mean over the measured steps: the bubble is a ratio of sums over those same steps
        "t_train": train / len(rows),
        "t_train_median_all": summary["t_train"],
        "t_bcast": summary["t_bcast"] or 0.0,
        "measured_bubble": wait / (wait + train),
        "max_staleness": max(r["staleness/max"] for r in rows),
    }
    return {**measured, **predict(measured)}


def predict(m: dict) -> dict:
    """Both models' bubble ratio for one measured point (its own T_train and T_bcast)."""
    timing = dict(
        kappa=m["kappa"],
        t_train=m["t_train"],
        t_bcast=m["t_bcast"],
        batch=m["batch"],
        mu_pool=m["pool"] * m["rate"],
    )
    return {
        "predicted_bubble": bubble_ratio_continuous(staleness=m["staleness"], **timing),
        "paper_cycle_bubble": bubble_ratio(**timing),
    }


def threshold(rows: list[dict], key: str) -> int | None:
    ok = [r["pool"] for r in rows if r[key] < 0.05]
    return min(ok) if ok else None


def plot(results: dict[int, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for s, rows in results.items():
        pools = [r["pool"] for r in rows]
        (line,) = ax.plot(pools, [r["measured_bubble"] for r in rows], "o-", label=f"S={s} measured")
        c = line.get_color()
        ax.plot(pools, [r["predicted_bubble"] for r in rows], "--", color=c, label=f"S={s} predicted")
        ax.plot(
            pools, [r["paper_cycle_bubble"] for r in rows], ":", color=c, label=f"S={s} paper cycle model"
        )
    ax.axhline(0.05, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("pool size (emulated workers)")
    ax.set_ylabel("learner bubble ratio")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--staleness", type=int, nargs="+", default=[2, 3, 5])
    p.add_argument("--pools", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    p.add_argument("--rate", type=float, default=35.0, help="trajectories/s per emulated worker")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heartbeat", type=float, default=0.2, help="coordinator.heartbeat_interval (s)")
    p.add_argument("--json")
    p.add_argument("--plot")
    p.add_argument(
        "--from-json",
        metavar="FILE",
        help="measure nothing: recompute the predictions for the points measured in FILE (this bench's --json)",
    )
    args = p.parse_args()
    results: dict[int, list[dict]] = {}
    if args.from_json:
        for s, d in json.loads(Path(args.from_json).read_text()).items():
            results[int(s)] = [{**row, **predict(row)} for row in d["rows"]]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for s in args.staleness:
                results[s] = []
                for n in args.pools:
                    row = one(args, s, n, Path(tmp))
                    print(json.dumps(row), flush=True)
                    results[s].append(row)
    summary = {
        str(s): {
            "measured_threshold": threshold(rows, "measured_bubble"),
            "predicted_threshold": threshold(rows, "predicted_bubble"),
            "paper_cycle_threshold": threshold(rows, "paper_cycle_bubble"),
            "rows": rows,
        }
        for s, rows in results.items()
    }
    print(json.dumps({s: {k: v for k, v in d.items() if k != "rows"} for s, d in summary.items()}, indent=2))
    write_json(args.json, summary)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
