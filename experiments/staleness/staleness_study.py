"""The staleness study: held-out accuracy and reward against a controlled rollout lag and the
off-policy correction, on the quickstart task (docs/staleness.md).

Each row is one `echo2 run` (in-process loop, `--rollout.lag=k --learner.staleness=k`), or the one
real-worker row (`echo2 run --workers 2 --learner.staleness=4`). Rows run one after another in
order of importance; after every row the results JSON, the markdown table and the plot are
rewritten, so a partial study is reportable. A row already in the results is skipped (--force
reruns it). Run one row alone with --only:

    python experiments/staleness/staleness_study.py                                   # the powered grid
    python experiments/staleness/staleness_study.py --grid pilot --only lag=4,correction=tis,seed=0
    python experiments/staleness/staleness_study.py --only workers=2,seed=0
    python experiments/staleness/staleness_study.py --only seed=3 --set learner.device=cuda --json a.json  # on a GPU
    python experiments/staleness/staleness_study.py --merge a.json b.json --json docs/bench/staleness_gpu.json

--set KEY=VALUE passes a config override to every row (recorded in the results' settings); --merge
joins results files written by several instances (one per seed, say) into one JSON, table and plot.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # the harness the benchmarks share: bench/common.py, bench/stats.py
from common import write_json  # noqa: E402

# (lag, correction, seed) in the order the study runs them: the comparisons the recommendation
# rests on first (lag 0 and 8 with clip, lag 4 with clip, lag 8 under each correction).
PILOT: list[dict] = [
    {"lag": 0, "correction": "clip", "seed": 0},
    {"lag": 8, "correction": "clip", "seed": 0},
    {"lag": 4, "correction": "clip", "seed": 0},
    {"lag": 8, "correction": "dual_clip", "seed": 0},
    {"lag": 8, "correction": "tis", "seed": 0},
    {"lag": 0, "correction": "clip", "seed": 1},
    {"lag": 8, "correction": "clip", "seed": 1},
    {"lag": 8, "correction": "decoupled", "seed": 0},
    {"workers": 2, "staleness": 4, "correction": "clip", "seed": 0},
    {"lag": 2, "correction": "clip", "seed": 0},
    {"lag": 1, "correction": "clip", "seed": 0},
    {"lag": 4, "correction": "dual_clip", "seed": 0},
    {"lag": 4, "correction": "tis", "seed": 0},
    {"lag": 4, "correction": "decoupled", "seed": 0},
    # second seeds where the machine allows, most important first
    {"lag": 4, "correction": "clip", "seed": 1},
    {"lag": 8, "correction": "dual_clip", "seed": 1},
    {"lag": 8, "correction": "tis", "seed": 1},
    {"lag": 2, "correction": "clip", "seed": 1},
    {"lag": 1, "correction": "clip", "seed": 1},
]


# The powered study (issue: lag 0 vs 4 vs 8, `clip` and `dual_clip`, about 6 seeds per arm to see a
# 0.10 gap at 80% power from the pilot's SD): seeds interleaved across the arms, so that a study cut
# short by the machine's budget is balanced, and resumable across sessions (done rows are skipped).
# Every arm runs the same 48 updates; lag 8 reaches its steady state (learner 8 versions ahead) at
# step 8 and then runs 40 steps at lag 8. Lag 0 has one arm: at lag 0 the ratio is 1 and `dual_clip`
# is `clip`.
POWERED_ARMS = [(0, "clip"), (8, "clip"), (4, "clip"), (8, "dual_clip"), (4, "dual_clip")]
POWERED: list[dict] = [
    {"lag": lag, "correction": correction, "seed": seed}
    for seed in range(8)
    for lag, correction in POWERED_ARMS
]
GRIDS = {
    "pilot": (
        PILOT,
        {"steps": 14, "lr": 3e-5, "eval_every": 0, "out": "staleness_study", "plot": "docs/staleness.png"},
    ),
    # lr 1e-5 (the quickstart's): a first lag-0 row at the pilot's 3e-5 peaked at step 16 (0.691) and
    # fell to 0.485 / 0.529 at steps 32 / 48 (docs/bench/staleness_powered_lr3e-5.json), so 48 steps
    # at 3e-5 measure the instability of the lr, not staleness.
    "powered": (
        POWERED,
        {
            "steps": 48,
            "lr": 1e-5,
            # held-out every 8 steps: the last 3 evaluations are at steps 32, 40 and 48 (a first row
            # with every 16 read 0.353 / 0.853 / 0.824 at 16 / 32 / 48: its "last 3" spanned the run)
            "eval_every": 8,
            "out": "staleness_powered",
            "plot": "docs/staleness_powered.png",
        },
    ),
}


def row_name(row: dict) -> str:
    if "workers" in row:
        return (
            f"workers={row['workers']},S={row['staleness']},correction={row['correction']},seed={row['seed']}"
        )
    return f"lag={row['lag']},correction={row['correction']},seed={row['seed']}"


def matches(row: dict, only: str) -> bool:
    """--only k=v,k=v: every given key equals the row's value (as text)."""
    wanted = dict(part.split("=", 1) for part in only.split(","))
    return all(str(row.get(k)) == v for k, v in wanted.items())


def command(row: dict, args, run_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "echo2.cli", "run", args.config]
    if "workers" in row:
        cmd += [f"--workers={row['workers']}", f"--learner.staleness={row['staleness']}"]
    else:
        cmd += [f"--rollout.lag={row['lag']}", f"--learner.staleness={row['lag']}"]
    return (
        cmd
        + [f"--{kv}" for kv in args.set]
        + [
            f"--learner.correction={row['correction']}",
            f"--run.seed={row['seed']}",
            f"--learner.steps={args.steps}",
            f"--learner.lr={args.lr}",
            f"--rollout.prompts_per_step={args.prompts_per_step}",
            f"--rollout.group_size={args.group_size}",
            f"--run.eval_size={args.eval_size}",
            f"--run.eval_every={args.eval_every}",
            f"--run.threads={args.threads}",
            f"--run.dir={run_dir}",
            "-q",
        ]
    )


def summarise(row: dict, run_dir: Path, wall_s: float, cmd: list[str]) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tail = metrics[-5:]

    def mean(key: str, rows=metrics) -> float | None:
        values = [m[key] for m in rows if key in m]
        return statistics.fmean(values) if values else None

    before = summary["eval_before"]["eval/accuracy"]
    evals = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]
    after = summary["eval_after"]["eval/accuracy"]
    return {
        **row,
        "name": row_name(row),
        "steps": summary["steps"],
        "accuracy_before": before,
        "accuracy_after": after,
        # held-out accuracy as the mean of the last 3 evaluations (the powered study's measure)
        "accuracy_last3": statistics.fmean(evals[-3:]) if len(evals) >= 3 else None,
        "eval_count": summary["eval_after"]["eval/count"],
        "reward_first5": mean("reward/mean", metrics[:5]),
        "reward_last5": mean("reward/mean", tail),
        "ratio_p99_mean": mean("offpolicy/ratio_p99"),
        "ratio_p99_max": max(m.get("offpolicy/ratio_p99", 0.0) for m in metrics),
        "ratio_max": max(m.get("offpolicy/ratio_max", 0.0) for m in metrics),
        "corrected_fraction_mean": mean("offpolicy/corrected_fraction"),
        "kl_behaviour_mean": mean("offpolicy/kl_behaviour"),
        "staleness_mean": mean("staleness/mean"),
        "staleness_histogram": summary["staleness_histogram"],
        "curve": {
            "step": [m["step"] for m in metrics],
            "reward": [m["reward/mean"] for m in metrics],
            "ratio_p99": [m.get("offpolicy/ratio_p99") for m in metrics],
            "eval_step": [0] + [m["step"] + 1 for m in metrics if "eval/accuracy" in m],
            "eval_accuracy": [before] + [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m],
        },
        "time_step_median_s": statistics.median(m["time/step"] for m in metrics),
        "wall_s": wall_s,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "command": " ".join(["python", *cmd[1:]]),
    }


def fmt(value, digits: int = 3) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def table(results: list[dict]) -> str:
    lines = [
        "| row | lag / S | correction | seed | held-out before | after | mean of last 3 evals | reward first 5 | last 5 "
        "| ratio p99 (mean / max over steps) | clipped/truncated | KL(mu ‖ pi), k3 | median step s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lag = f"S={r['staleness']} (workers)" if "workers" in r else str(r["lag"])
        lines.append(
            f"| `{r['name']}` | {lag} | {r['correction']} | {r['seed']} | {fmt(r['accuracy_before'])} "
            f"| **{fmt(r['accuracy_after'])}** | {fmt(r.get('accuracy_last3'))} | {fmt(r['reward_first5'], 2)} | {fmt(r['reward_last5'], 2)} "
            f"| {fmt(r['ratio_p99_mean'])} / {fmt(r['ratio_p99_max'])} | {fmt(r['corrected_fraction_mean'])} "
            f"| {fmt(r['kl_behaviour_mean'], 4)} | {fmt(r['time_step_median_s'], 1)} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {0: "black", 1: "tab:blue", 2: "tab:green", 4: "tab:orange", 8: "tab:red"}
    styles = {"clip": "-", "dual_clip": "--", "tis": ":", "decoupled": "-."}
    fig, (ax_acc, ax_rew) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        colour = "tab:purple" if "workers" in r else colours.get(r["lag"], "grey")
        kw = {"color": colour, "linestyle": styles[r["correction"]], "label": r["name"], "alpha": 0.85}
        c = r["curve"]
        ax_acc.plot(c["eval_step"], c["eval_accuracy"], marker="o", **kw)
        window = 5
        smooth = [
            statistics.fmean(c["reward"][max(0, i - window + 1) : i + 1]) for i in range(len(c["reward"]))
        ]
        ax_rew.plot(c["step"], smooth, **kw)
    ax_acc.set(xlabel="learner step", ylabel="held-out greedy accuracy", title="held-out accuracy")
    ax_rew.set(xlabel="learner step", ylabel="rollout reward (moving mean of 5)", title="reward per step")
    ax_rew.legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def write_results(args, grid: list[dict], settings: dict, results: list[dict]) -> None:
    """The results JSON, the markdown table and the plot, rows in the grid's order."""
    order = [row_name(g) for g in grid]
    results.sort(key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
    write_json(args.json, {"settings": settings, "rows": results})
    Path(args.table).write_text(table(results))
    plot(results, Path(args.plot))


def merge(args, grid: list[dict]) -> None:
    """--merge: one results file from several with the same settings (a row in two files is an error)."""
    parts = [json.loads(Path(f).read_text()) for f in args.merge]
    for part in parts:  # files written before --set existed ran with none
        part["settings"].setdefault("set", [])
    settings = parts[0]["settings"]
    for f, part in zip(args.merge, parts, strict=True):
        if part["settings"] != settings:
            sys.exit(f"--merge: {f} was run with other settings ({part['settings']} vs {settings})")
    rows = [r for part in parts for r in part["rows"]]
    names = [r["name"] for r in rows]
    if len(set(names)) != len(names):
        sys.exit(f"--merge: a row is in two files: {sorted(n for n in set(names) if names.count(n) > 1)}")
    write_results(args, grid, settings, rows)
    print(f"{len(rows)} rows from {len(parts)} files -> {args.json}, {args.table}, {args.plot}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/quickstart.toml")
    p.add_argument(
        "--grid", choices=sorted(GRIDS), default="powered", help="pilot: the 14-step grid of 2026-12-01"
    )
    p.add_argument("--steps", type=int, help="default: the grid's (pilot 14, powered 48)")
    p.add_argument("--lr", type=float, help="default: the grid's (pilot 3e-5, powered 1e-5)")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument(
        "--eval-size", type=int, default=100, help="held-out problems (68 distinct at difficulty 1)"
    )
    p.add_argument("--eval-every", type=int, help="default: the grid's (pilot 0, powered 8)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", help="run only the rows matching k=v,k=v (e.g. lag=4,correction=tis,seed=0)")
    p.add_argument("--force", action="store_true", help="rerun rows already in the results")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every row, e.g. learner.device=cuda (repeatable)")  # fmt: skip
    p.add_argument("--drop-checkpoints", action="store_true",
                   help="delete each row's checkpoint once summarised (1.6 GB a row; the study reads none)")  # fmt: skip
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join these results files; run nothing")
    p.add_argument("--runs", help="run directories, one per row (default runs/<grid's name>)")
    p.add_argument("--json", help="default docs/bench/<grid's name>.json")
    p.add_argument("--table", help="default docs/bench/<grid's name>.md")
    p.add_argument("--plot", help="default: the grid's")
    args = p.parse_args()
    grid, defaults = GRIDS[args.grid]
    args.steps = args.steps if args.steps is not None else defaults["steps"]
    args.eval_every = args.eval_every if args.eval_every is not None else defaults["eval_every"]
    args.lr = args.lr if args.lr is not None else defaults["lr"]
    args.runs = args.runs or f"runs/{defaults['out']}"
    args.json = args.json or f"docs/bench/{defaults['out']}.json"
    args.table = args.table or f"docs/bench/{defaults['out']}.md"
    args.plot = args.plot or defaults["plot"]

    if args.merge:
        merge(args, grid)
        return
    rows = [r for r in grid if not args.only or matches(r, args.only)]
    if not rows:
        sys.exit(f"--only: no row of the grid matches {args.only!r}")
    out = Path(args.json)
    results = json.loads(out.read_text())["rows"] if out.exists() else []
    settings = {k: getattr(args, k) for k in ("config", "steps", "lr", "prompts_per_step", "group_size", "eval_size", "eval_every", "threads", "set")}  # fmt: skip
    path = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]  # keep a caller's entries
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    for row in rows:
        name = row_name(row)
        if not args.force and any(r["name"] == name for r in results):
            print(f"skip {name} (in {out}; --force reruns it)", flush=True)
            continue
        run_dir = Path(args.runs) / name.replace(",", "_").replace("=", "")
        shutil.rmtree(run_dir, ignore_errors=True)  # a row reruns from scratch
        cmd = command(row, args, run_dir)
        print(f"{time.strftime('%H:%M:%S')} start {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        done = subprocess.run(cmd, env=env, cwd=ROOT, check=False)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            print(f"{name}: exit status {done.returncode}, not recorded", flush=True)
            continue
        result = summarise(row, run_dir, wall, cmd)
        if args.drop_checkpoints:
            shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)
        results = [r for r in results if r["name"] != name] + [result]
        write_results(args, grid, settings, results)
        print(
            f"{time.strftime('%H:%M:%S')} done {name} in {wall:.0f} s: held-out "
            f"{result['accuracy_before']:.3f} -> {result['accuracy_after']:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
