"""The simulator's prediction for bench/headline.py's setting (issue 42 part 1), set beside what the
real processes measured.

Reads the raw runs (`headline_runs.jsonl`) and simulates each arm with `echo2.sim` twice:

* **links**: the broadcast from the links as shaped (B0, Bw, 4 MiB chunks, star of full snapshots
  or chains of deltas at the simulator's default delta ratio). T_bcast is then an independent
  prediction from the network alone.
* **measured T_bcast**: each worker's download rate set so that one snapshot takes the arm's
  measured median T_bcast (as bench/validate_sim.py does for the bubble benchmark), so the
  prediction tests the rollout, buffer and staleness model given measured timings.

Inputs, every one labelled in the output: R, group size, S, kappa, N and M are the bench's setting;
T_train is each arm's measured median training time per step (steps 1-19); the workers' rollout
throughput is **fitted** on the sync arm: (median learner wait - median T_bcast) is the time 4
workers take to make one batch of R under S = 0, so the sync arm's own step time is close to an
input, and only the echo2 arm's step time and bubble ratio are predictions. Measured figures are
over the steady state, steps 4-19 (the simulator's warm-up is 2 kappa steps; step 0 waits for the
first broadcast in both).

    python bench/headline_sim.py --raw docs/bench/headline_runs.jsonl --json docs/bench/headline_sim.json
"""

from __future__ import annotations

import argparse
import json
import statistics

from common import write_json

from echo2.sim.scenario import validate
from echo2.sim.sweep import run_point

SNAPSHOT_GB = 0.269  # SmolLM2-135M's bf16 snapshot as headline.py publishes it (its docstring)
CHUNK_MIB = 4.0  # broadcast.chunk_mb's default
STEADY_FROM = 4  # the simulator's warm-up for kappa = 2 (2 kappa), used for both arms
ARMS = {"echo2": {"staleness": 3, "kappa": 2, "topology": "chains", "delta": True},
        "sync": {"staleness": 0, "kappa": 1, "topology": "star", "delta": False}}  # fmt: skip


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def measured(run: dict) -> dict:
    rows = [r for r in run["rows"] if r["step"] >= STEADY_FROM]
    wait = sum(r["time/learner_wait"] for r in rows)
    train = sum(r["time/train"] for r in rows)
    return {
        "step_time": (wait + train) / len(rows),  # the mean, as the simulator's step_time
        "bubble_ratio": wait / (wait + train),
        "t_bcast_q90": run["summary"]["t_bcast"],
    }


def inputs(runs: list[dict]) -> dict:
    """Per arm: median T_train (steps >= 1), median T_bcast; the fitted rollout throughput."""
    out: dict = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        out[arm] = {
            "t_train": statistics.median(x["time/train"] for r in mine for x in r["rows"] if x["step"] >= 1),
            "t_bcast": statistics.median(r["summary"]["t_bcast"] for r in mine),
            "runs": len(mine),
        }
    sync = [r for r in runs if r["arm"] == "sync"]
    wait = statistics.median(x["time/learner_wait"] for r in sync for x in r["rows"] if x["step"] >= 1)
    out["generation_s_per_batch"] = wait - out["sync"]["t_bcast"]
    return out


def scenario(arm: str, inp: dict, setting: dict, *, batch: int, group_size: int, steps: int, mode: str):
    a = ARMS[arm]
    workers = setting["workers"]
    throughput = batch / inp["generation_s_per_batch"] / workers
    download = setting["bw"] if mode == "links" else SNAPSHOT_GB * 1e9 * 8 / 1e6 / inp[arm]["t_bcast"]
    return validate({
        "name": f"headline {arm} {mode}", "steps": steps, "warmup_steps": STEADY_FROM,
        "learner": {"t_train": inp[arm]["t_train"], "batch": batch, "group_size": group_size,
                    "staleness": a["staleness"], "kappa": a["kappa"], "snapshot_gb": SNAPSHOT_GB},
        "broadcast": {"topology": a["topology"], "uplink_mbps": setting["b0"] if mode == "links" else 1e6,
                      "chunk_mib": CHUNK_MIB, "delta": a["delta"] and mode == "links"},
        "rollout": {"keep_generating": True},
        "workers": [{"name": "w", "count": workers, "throughput": throughput, "download_mbps": download}],
    })  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--raw", default="docs/bench/headline_runs.jsonl")
    p.add_argument("--batch", type=int, default=32, help="R: the quickstart's 4 prompts x 8 samples")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runs = load(args.raw)
    setting = runs[0]["setting"]
    inp = inputs(runs)
    out: dict = {"inputs": inp, "setting": setting, "arms": {}}
    for arm in ARMS:
        got = [measured(r) for r in runs if r["arm"] == arm]
        m = {k: statistics.median(g[k] for g in got) for k in got[0]}
        m["range"] = {k: [min(g[k] for g in got), max(g[k] for g in got)] for k in got[0]}
        row: dict = {"measured_median": m}
        for mode in ("links", "measured_t_bcast"):
            sim = run_point(scenario(arm, inp, setting, batch=args.batch, group_size=args.group_size,
                                     steps=setting["steps"], mode=mode))  # fmt: skip
            row[mode] = {k: sim[k] for k in ("step_time", "bubble_ratio", "t_bcast_q90", "wait_per_step")}
        out["arms"][arm] = row
        print(f"{arm}: measured step {m['step_time']:.1f} s, bubble {m['bubble_ratio']:.3f}, T_bcast "
              f"{m['t_bcast_q90']:.1f} s; simulated (links) step {row['links']['step_time']:.1f} s, bubble "
              f"{row['links']['bubble_ratio']:.3f}, T_bcast {row['links']['t_bcast_q90']:.1f} s; simulated "
              f"(measured T_bcast) step {row['measured_t_bcast']['step_time']:.1f} s, bubble "
              f"{row['measured_t_bcast']['bubble_ratio']:.3f}")  # fmt: skip
    e, s = out["arms"]["echo2"], out["arms"]["sync"]
    out["step_time_ratio"] = {
        "measured": e["measured_median"]["step_time"] / s["measured_median"]["step_time"],
        **{mode: e[mode]["step_time"] / s[mode]["step_time"] for mode in ("links", "measured_t_bcast")},
    }
    print("echo2 / sync steady-state step time:", json.dumps(out["step_time_ratio"]))
    print(json.dumps(inp))
    write_json(args.json, out)


if __name__ == "__main__":
    main()
