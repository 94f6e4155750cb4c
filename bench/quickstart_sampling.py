"""The quickstart under each `rollout.sampling`, side by side (issue 41 item 2): held-out accuracy
before and after, and the median time per step, from one `echo2 run configs/quickstart.toml` per
arm, the arms run one after the other on the same machine (never at once: each takes every core).

    cd bench && python quickstart_sampling.py --json ../docs/bench/quickstart_sampling.json

`--arms` picks the arms (default multinomial, then gumbel); `--steps` shortens both runs alike.
Each arm's run directory is kept under `--out` (default a temporary folder) with its metrics.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import write_json

ROOT = Path(__file__).resolve().parents[1]


def run_arm(sampling: str, run_dir: Path, steps: int | None) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "echo2.cli",
        "run",
        str(ROOT / "configs/quickstart.toml"),
        f"--rollout.sampling={sampling}",
        f"--run.dir={run_dir}",
    ]
    if steps is not None:
        cmd.append(f"--learner.steps={steps}")
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps_s = [r["time/step"] for r in rows]
    return {
        "sampling": sampling,
        "steps": len(rows),
        "accuracy_before": summary["eval_before"]["eval/accuracy"],
        "accuracy_after": summary["eval_after"]["eval/accuracy"],
        "step_s_median": statistics.median(steps_s),
        "step_s_mean": statistics.fmean(steps_s),
        "reward_first10": statistics.fmean(r["reward/mean"] for r in rows[:10]),
        "reward_last10": statistics.fmean(r["reward/mean"] for r in rows[-10:]),
        "tokens_mean": statistics.fmean(r["response/tokens_mean"] for r in rows),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", nargs="+", default=["multinomial", "gumbel"])
    ap.add_argument("--steps", type=int)
    ap.add_argument("--out")
    ap.add_argument("--json")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="quickstart-sampling-"))
    arms = []
    for sampling in args.arms:
        arm = run_arm(sampling, out / sampling, args.steps)
        print(json.dumps(arm), flush=True)
        arms.append(arm)
    base = arms[0]["step_s_median"]
    result = {"arms": arms, "step_ratio_to_first": [a["step_s_median"] / base for a in arms]}
    print(json.dumps(result["step_ratio_to_first"]))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
