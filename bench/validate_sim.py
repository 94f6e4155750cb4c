"""Validation: the simulator against measured runs of the real system, on the same parameters.

Reads the raw results of two benchmarks and simulates each of their points with `echo2.sim`:
- the capacity benchmark (bench/bubble_vs_pool.py -> docs/bench/bubble.json): the learner's bubble
  ratio with N EMULATED workers. Simulator inputs: the run's measured T_train, R, group size, S,
  kappa, N and the per-worker rate; its measured T_bcast enters as the worker download rate
  (snapshot size / T_bcast), since loopback has no configured bandwidth.
- the broadcast benchmark (bench/broadcast_sweep.py -> docs/bench/broadcast.json): T_bcast at
  q = 0.9 for chain and star. Simulator inputs: N, M, chunk size, B0 and BW times the bench's
  pacing factor (its learner and relays send at that share of the shaped rates), no hop delay.

Nothing is fitted to the measured outputs. Writes docs/bench/validation.json and prints a table.

    python bench/validate_sim.py --bubble docs/bench/bubble.json --broadcast docs/bench/broadcast.json \\
        --json docs/bench/validation.json
"""

from __future__ import annotations

import argparse
import json

from common import write_json

from echo2.sim.scenario import validate
from echo2.sim.sweep import run_point

SNAPSHOT_GB = 0.025  # any size works: the download rate is derived from it and the measured T_bcast


def bubble_point(row: dict, meta: dict) -> dict:
    mbps = SNAPSHOT_GB * 1e9 * 8 / 1e6 / max(row["t_bcast"], 1e-3)
    sc = validate(
        {
            "name": f"bubble S={row['staleness']} N={row['pool']}",
            "steps": meta["steps"],
            "warmup_steps": meta["warmup"],
            "learner": {
                "t_train": row["t_train"],
                "batch": row["batch"],
                "group_size": meta["group_size"],
                "staleness": row["staleness"],
                "kappa": row["kappa"],
                "snapshot_gb": SNAPSHOT_GB,
            },
            "broadcast": {"topology": "star"},
            "rollout": {"keep_generating": True, "lease_groups": 1},
            "workers": [
                {"name": "emu", "count": row["pool"], "throughput": row["rate"], "download_mbps": mbps}
            ],
        }
    )
    sim = run_point(sc)
    return {
        "staleness": row["staleness"],
        "pool": row["pool"],
        "measured": row["measured_bubble"],
        "simulated": sim["bubble_ratio"],
        "abs_error": abs(sim["bubble_ratio"] - row["measured_bubble"]),
        # relative error only where there is a bubble to speak of (5% or more)
        "rel_error": abs(sim["bubble_ratio"] - row["measured_bubble"]) / row["measured_bubble"]
        if row["measured_bubble"] >= 0.05
        else None,
    }


def broadcast_point(row: dict) -> dict:
    pace = row.get("pace", 1.0)
    sc = validate(
        {
            "name": f"broadcast {row['mode']} N={row['workers']}",
            "steps": 2,
            "warmup_steps": 0,
            "learner": {
                "t_train": 100 * row["lower_bound_s"],
                "batch": 1,
                "group_size": 1,
                "staleness": 1,
                "snapshot_gb": row["snapshot_mb"] / 1e3,
            },
            "broadcast": {
                "topology": "chains" if row["mode"] == "chain" else "star",
                "uplink_mbps": row["uplink_mbps"] * pace,
                "chunk_mib": row["chunk_mb"],
                "chains": row["n_chains"] if row["mode"] == "chain" else None,
            },
            "workers": [
                {
                    "name": "w",
                    "count": row["workers"],
                    "throughput": 1.0,
                    "download_mbps": row["worker_mbps"] * pace,
                }
            ],
        }
    )
    sim = run_point(sc)
    measured, simulated = row["t_bcast_q90_s"], sim["t_bcast_q90"]
    return {
        "mode": row["mode"],
        "workers": row["workers"],
        "measured": measured,
        "simulated": simulated,
        "rel_error": abs(simulated - measured) / measured,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bubble", default="docs/bench/bubble.json")
    p.add_argument("--broadcast", default="docs/bench/broadcast.json")
    p.add_argument("--steps", type=int, default=12, help="learner steps of the bubble bench")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps the bubble bench excluded")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--json")
    args = p.parse_args()
    meta = {"steps": args.steps, "warmup": args.warmup, "group_size": args.group_size}
    bubble = [
        bubble_point(row, meta) for rows in json.load(open(args.bubble)).values() for row in rows["rows"]
    ]
    bcast = [broadcast_point(row) for row in json.load(open(args.broadcast))["rows"]]
    print("bubble ratio: S  N  measured  simulated  |error|  relative")
    for r in bubble:
        rel = f"{r['rel_error']:.1%}" if r["rel_error"] is not None else "-"
        print(
            f"  {r['staleness']}  {r['pool']}  {r['measured']:.3f}  {r['simulated']:.3f}  {r['abs_error']:.3f}  {rel}"
        )
    print("T_bcast q=0.9: mode  N  measured  simulated  error")
    for r in bcast:
        print(
            f"  {r['mode']}  {r['workers']}  {r['measured']:.2f}s  {r['simulated']:.2f}s  {r['rel_error']:.1%}"
        )
    summary = {
        "bubble": bubble,
        "broadcast": bcast,
        "bubble_max_abs_error": max(r["abs_error"] for r in bubble),
        "bubble_max_rel_error": max(
            (r["rel_error"] for r in bubble if r["rel_error"] is not None), default=None
        ),
        "broadcast_max_rel_error": max(r["rel_error"] for r in bcast),
    }
    print(
        f"max |bubble error| {summary['bubble_max_abs_error']:.3f} "
        f"(relative {summary['bubble_max_rel_error'] or 0:.1%} where bubble >= 5%); "
        f"max T_bcast error {summary['broadcast_max_rel_error']:.1%}"
    )
    write_json(args.json, summary)


if __name__ == "__main__":
    main()
