"""Bubble-ratio thresholds four ways, on the pools the bubble benchmark measured (issue 14).

For each S, the threshold is the smallest pool of N EMULATED 35 trajectories/s workers whose learner
bubble ratio is under 5%. No new runs: everything below is read from, or computed on, the recorded
runs of bench/bubble_vs_pool.py (docs/bench/bubble.json: N = 1..6, R = 256, kappa = max(1, S - 1)).

1. measured: the recorded bubble of each run.
2. `echo2 plan`: the pure planner `echo2.planning.plan.make_plan` with PlanInput's defaults (the
   "continuous" real-worker model, gamma 1.1), batch R, S and kappa, T_train and T_bcast the medians
   over the S's six runs (T_train: each run's mean over its measured steps, as the benchmark
   predicts with), and a pool of 6 x 35/s workers at one price. Reported: the workers it activates
   (gamma * mu_min; also with gamma = 1), and the smallest N whose bubble under the planner's model
   (`capacity.predicted_bubble`) is below 5%, with those medians and, as a check, with each run's own.
3. the scheduler: the target the runtime computes (`capacity.target_throughput` with
   SchedulerConfig's defaults, as `remote.LearnerSide.target_throughput` calls it: the median
   learner step time and median T_bcast, recorded per run as `t_train_median_all` and `t_bcast`;
   medians over the six runs), given to `Scheduler.decide` (SchedulerConfig's sustain_s and
   release_margin) with six 35/s standby workers: the number it activates. Also per run.
4. the simulator: `echo2 simulate`'s engine with its default (real-worker) rollout, each point built
   exactly as bench/validate_sim.py builds it (`bubble_point`: that run's T_train, T_bcast, N, S,
   kappa); freshly simulated here (seconds each), and the value recorded in
   docs/bench/validation.json beside it.

    python bench/bubble_thresholds.py --bubble docs/bench/bubble.json \\
        --validation docs/bench/validation.json --json docs/bench/bubble_thresholds.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Any

from common import write_json

from echo2.config import SchedulerConfig
from echo2.fleet.scheduler import Action, Role, Scheduler, WorkerView
from echo2.planning import capacity as cap
from echo2.planning.plan import PlanInput, Pool, make_plan

THRESHOLD = 0.05
"""A pool is enough when its bubble ratio is below this (as in bench/bubble_vs_pool.py)."""
PRICE = 1.0
"""USD/h of every worker: one price, so only the count matters."""
COMMAND = (
    "python bench/bubble_thresholds.py --bubble docs/bench/bubble.json "
    "--validation docs/bench/validation.json --json docs/bench/bubble_thresholds.json"
)


def smallest(bubbles: dict[int, float]) -> int | None:
    """The smallest N with bubble < 5% (None: no measured pool is enough)."""
    return min((n for n, b in bubbles.items() if b < THRESHOLD), default=None)


def plan_way(rows: list[dict]) -> dict[str, Any]:
    """`echo2 plan` on the S's pools: what it activates, and its model's threshold."""
    r0, pool_max = rows[0], max(r["pool"] for r in rows)
    rate = r0["rate"]
    t_train = statistics.median(r["t_train"] for r in rows)
    t_bcast = statistics.median(r["t_bcast"] for r in rows)
    inp = PlanInput(
        t_train=t_train, t_bcast=t_bcast, batch=r0["batch"], staleness=r0["staleness"], kappa=r0["kappa"]
    )
    pool = Pool(workers=[{"name": "emu", "count": pool_max, "throughput": rate, "price": PRICE}])
    plan = make_plan(inp, pool)
    no_headroom = make_plan(PlanInput(**{**inp.model_dump(), "gamma": 1.0}), pool)  # what gamma adds

    def bubble(row_t_train: float, row_t_bcast: float, n: int) -> float:
        return cap.predicted_bubble(
            inp.model,
            kappa=inp.resolved_kappa,
            staleness=inp.staleness,
            t_train=row_t_train,
            t_bcast=row_t_bcast,
            batch=inp.batch,
            mu_pool=n * rate,
        )

    median_bubbles = {r["pool"]: bubble(t_train, t_bcast, r["pool"]) for r in rows}
    own_bubbles = {r["pool"]: bubble(r["t_train"], r["t_bcast"], r["pool"]) for r in rows}
    return {
        "model": inp.model,
        "gamma": inp.gamma,
        "t_train": t_train,
        "t_bcast": t_bcast,
        "mu_min": plan["mu_min"],
        "mu_target": plan["mu_target"],
        "feasible": plan["feasible"],
        "active": plan["active"]["emu"],
        "active_gamma_1": no_headroom["active"]["emu"],
        "plan_bubble": plan["bubble_ratio"],
        "bubble_by_pool": median_bubbles,
        "threshold": smallest(median_bubbles),
        "bubble_by_pool_own_timings": own_bubbles,
        "threshold_own_timings": smallest(own_bubbles),
    }


def scheduler_activates(target: float, *, rate: float, count: int, config: SchedulerConfig) -> int:
    """How many of `count` standby workers of `rate` the online scheduler activates for `target`:
    `Scheduler.decide` twice, `sustain_s` apart (a shortfall must last that long)."""
    sched = Scheduler(sustain_s=config.sustain_s, release_margin=config.release_margin)
    workers = [
        WorkerView(worker_id=f"emu-{i}", throughput=rate, price=PRICE, role=Role.STANDBY)
        for i in range(count)
    ]
    decisions = sched.decide(workers, target=target, now=0.0)
    decisions += sched.decide(workers, target=target, now=config.sustain_s)
    return sum(d.action is Action.ACTIVATE for d in decisions)


def scheduler_target(config: SchedulerConfig, row: dict, *, t_train: float, t_bcast: float) -> float:
    """`remote.LearnerSide.target_throughput` with these medians (it calls exactly this)."""
    return cap.target_throughput(
        kappa=row["kappa"],
        staleness=row["staleness"],
        model=config.model,
        t_train=t_train,
        t_bcast=t_bcast,
        batch=row["batch"],
        gamma=config.gamma,
    )


def scheduler_way(rows: list[dict]) -> dict[str, Any]:
    config = SchedulerConfig()
    r0, count = rows[0], max(r["pool"] for r in rows)
    t_train = statistics.median(r["t_train_median_all"] for r in rows)
    t_bcast = statistics.median(r["t_bcast"] for r in rows)
    target = scheduler_target(config, r0, t_train=t_train, t_bcast=t_bcast)
    per_run = {}
    for r in rows:
        t = scheduler_target(config, r, t_train=r["t_train_median_all"], t_bcast=r["t_bcast"])
        per_run[r["pool"]] = {
            "target": t,
            "active": scheduler_activates(t, rate=r["rate"], count=count, config=config),
        }
    return {
        "model": config.model,
        "gamma": config.gamma,
        "t_train": t_train,
        "t_bcast": t_bcast,
        "target": target,
        "target_over_rate": target / r0["rate"],
        "ceil_target_over_rate": math.ceil(target / r0["rate"]),
        "active": scheduler_activates(target, rate=r0["rate"], count=count, config=config),
        "per_run": per_run,
        "active_range_per_run": [
            min(v["active"] for v in per_run.values()),
            max(v["active"] for v in per_run.values()),
        ],
    }


def simulator_way(rows: list[dict], recorded: dict[tuple[int, int], float], meta: dict) -> dict[str, Any]:
    from validate_sim import bubble_point  # the scenario construction of the validation, unchanged

    fresh = {r["pool"]: bubble_point(r, meta)["simulated"] for r in rows}
    s = rows[0]["staleness"]
    rec = {r["pool"]: recorded[(s, r["pool"])] for r in rows if (s, r["pool"]) in recorded}
    return {
        "bubble_by_pool": fresh,
        "threshold": smallest(fresh),
        "recorded_bubble_by_pool": rec,
        "recorded_threshold": smallest(rec) if len(rec) == len(rows) else None,
    }


def check_defaults() -> dict[str, Any]:
    """The defaults the four ways rely on: the real-worker ("continuous") model everywhere."""
    from echo2.sim.scenario import RolloutSpec

    defaults = {
        "plan_model": PlanInput.model_fields["model"].default,
        "plan_gamma": PlanInput.model_fields["gamma"].default,
        "scheduler_model": SchedulerConfig().model,
        "scheduler_gamma": SchedulerConfig().gamma,
        "simulator_keep_generating": RolloutSpec().keep_generating,
    }
    assert defaults["plan_model"] == "continuous" and defaults["scheduler_model"] == "continuous", defaults
    assert defaults["simulator_keep_generating"] is True, defaults
    return defaults


def thresholds(bubble: dict, validation: dict | None, meta: dict, *, simulate: bool = True) -> dict[str, Any]:
    recorded = {(v["staleness"], v["pool"]): v["simulated"] for v in (validation or {}).get("bubble", [])}
    out: dict[str, Any] = {"command": COMMAND, "bubble_threshold": THRESHOLD, "defaults": check_defaults()}
    per_s = {}
    for s, entry in bubble.items():
        rows = sorted(entry["rows"], key=lambda r: r["pool"])
        measured = {r["pool"]: r["measured_bubble"] for r in rows}
        m = smallest(measured)
        plan = plan_way(rows)
        sched = scheduler_way(rows)
        sim = simulator_way(rows, recorded, meta) if simulate else None
        ways = {"echo2 plan": plan["threshold"], "scheduler": sched["active"]}
        if sim is not None:
            ways["simulator"] = sim["threshold"]
        per_s[s] = {
            "staleness": rows[0]["staleness"],
            "kappa": rows[0]["kappa"],
            "measured": {"bubble_by_pool": measured, "threshold": m},
            "plan": plan,
            "scheduler": sched,
            "simulator": sim,
            "summary": {
                "measured": m,
                "echo2 plan threshold": plan["threshold"],
                "echo2 plan activates": plan["active"],
                "scheduler activates": sched["active"],
                "simulator": sim["threshold"] if sim else None,
                "simulator (validation.json)": sim["recorded_threshold"] if sim else None,
            },
            "within_one_worker": {
                k: v is not None and m is not None and abs(v - m) <= 1
                for k, v in {**ways, "echo2 plan activates": plan["active"]}.items()
            },
        }
    out["per_staleness"] = per_s
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bubble", default="docs/bench/bubble.json")
    p.add_argument("--validation", default="docs/bench/validation.json")
    p.add_argument("--steps", type=int, default=12, help="learner steps of the bubble bench")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps the bubble bench excluded")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--json")
    args = p.parse_args()
    validation = json.load(open(args.validation)) if args.validation else None
    meta = {"steps": args.steps, "warmup": args.warmup, "group_size": args.group_size}
    result = thresholds(json.load(open(args.bubble)), validation, meta)
    print("S | measured | echo2 plan (activates) | scheduler activates | simulator (validation.json)")
    for s, v in result["per_staleness"].items():
        x = v["summary"]
        print(
            f"{s} | {x['measured']} | {x['echo2 plan threshold']} ({x['echo2 plan activates']}) | "
            f"{x['scheduler activates']} | {x['simulator']} ({x['simulator (validation.json)']})"
        )
    write_json(args.json, result)


if __name__ == "__main__":
    main()
