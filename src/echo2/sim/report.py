"""What a simulated run measured: metrics (a JSON-ready dict), the text report, the timeline plot.

Steady-state metrics are taken over whole publication cycles after the warm-up steps, so a cycle's
idle time is never cut in half. The predictions beside them come from the capacity model
(`planning.capacity`) and the planner's broadcast formulas (`broadcast.plan`), evaluated with the
simulated T_train, T_bcast and pool throughput. Knows nothing of SimPy; reads a finished
`Simulation`.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import Counter
from typing import Any

from echo2.planning import capacity
from echo2.sim.model import Simulation


# ---------------------------------------------------------------------------- capacity curve
def step_value(points: list[tuple[float, float]], t: float, default: float = 0.0) -> float:
    """Value at time t of a step function given as sorted (time, value) change points."""
    i = bisect.bisect_right([p[0] for p in points], t)
    return points[i - 1][1] if i else default


def pool_capacity(sim: Simulation) -> tuple[list[float], list[float]]:
    """mu_pool(t) = sum of a_i(t) mu_i(t) (paper 3.4): the nominal throughput (times any slowdown)
    of the workers that are active, alive, hold a snapshot and are not lagging behind. A worker lags
    while it misses the newest published snapshot for longer than a normal broadcast takes (1% more
    than the longest T_bcast at q = 1 before the first fault): the tail of a broken or slowed chain,
    a replacement still fetching. Workers paused during a normal broadcast (`keep_generating = false`) still count.
    A step function: (change times, value from each time on)."""
    first_fault = min((f.time for f in sim.faults), default=math.inf)
    normal = [p for p in sim.publications if max(p.installs.values(), default=math.inf) < first_fault]
    t100 = [t for p in normal or sim.publications if (t := p.t_bcast(1.0, set(sim.workers))) is not None]
    lag_after = (max(t100) if t100 else 0.0) * 1.01 + 1e-6
    pub_t = [t for _, t in sim.published_at]
    pub_v = [v for v, _ in sim.published_at]
    times = set(pub_t) | {t + lag_after for t in pub_t}
    per_worker = []
    for w in sim.workers.values():
        billed = [(a, min(b, sim.end_time)) for a, b in w.billed]
        ver = w.versions
        fac = w.factors
        per_worker.append((w.spec.throughput, billed, [t for t, _ in ver], [v for _, v in ver], fac))
        times.update(t for a, b in billed for t in (a, b))
        times.update(t for t, _ in ver)
        times.update(t for t, _ in fac)
    ts = sorted(t for t in times if 0 <= t < sim.end_time) or [0.0]
    values = []
    for t in ts:
        k = bisect.bisect_right(pub_t, t)
        latest, published = (pub_v[k - 1], pub_t[k - 1]) if k else (0, 0.0)
        total = 0.0
        for mu, billed, ver_t, ver_v, fac in per_worker:
            if not any(a <= t < b for a, b in billed):
                continue
            j = bisect.bisect_right(ver_t, t)
            if not j:
                continue
            if ver_v[j - 1] < latest and t - published >= lag_after:
                continue
            total += mu * step_value(fac, t, default=1.0)
        values.append(total)
    return ts, values


def _value_before(ts: list[float], vs: list[float], t: float) -> float:
    i = bisect.bisect_left(ts, t)
    return vs[i - 1] if i else (vs[0] if vs else 0.0)


def fault_effects(sim: Simulation, horizon_s: float) -> list[dict[str, Any]]:
    """For every injected fault: the peak drop of mu_pool(t) relative to just before the fault, and
    two recovery times, from the fault to mu_pool back at the scheduler's target of the moment or
    at its pre-fault level, whichever is lower: `recovery_s`, the first time it is back (the paper's
    Table 4: "from fault injection to the moment mu_pool returns to mu_target"), and
    `recovered_for_good_s`, the time from which it stays back within `horizon_s` (a later dip, such
    as a broken chain's tail installing after the rest, counts). None: not back within the run."""
    ts, vs = pool_capacity(sim)
    out = []
    for f in sim.faults:
        before = _value_before(ts, vs, f.time)
        target = step_value(sim.targets, f.time, default=before) if sim.targets else before
        lo, hi = f.time, min(f.time + horizon_s, sim.end_time)
        # every moment mu_pool or the target changes
        points = sorted({lo} | {t for t in ts if lo < t < hi} | {t for t, _ in sim.targets if lo < t < hi})
        window = [(t, step_value(list(zip(ts, vs, strict=True)), t, default=before)) for t in points]
        low = min(v for _, v in window) if window else before
        recovered_at: float | None = lo
        first_back: float | None = lo
        dips, down = 0, False
        for k, (t, v) in enumerate(window):
            # back when mu_pool reaches the scheduler's target of the moment (or its old level)
            now_target = step_value(sim.targets, t, default=before) if sim.targets else before
            if v < min(now_target, before) * (1 - 1e-9):
                recovered_at = window[k + 1][0] if k + 1 < len(window) else None  # still down
                dips += not down
                down = True
                if dips == 1:
                    first_back = recovered_at
            else:
                down = False
        out.append(
            {
                "time": f.time,
                "worker": f.worker,
                "kind": f.kind,
                "stage": f.stage,
                "factor": f.factor,
                "mu_pool_before": before,
                "mu_target": target,
                "throughput_drop": 1 - low / before if before > 0 else 0.0,
                "recovery_s": None if first_back is None else first_back - f.time,
                "recovered_for_good_s": None if recovered_at is None else recovered_at - f.time,
            }
        )
    return out


# ---------------------------------------------------------------------------- metrics
def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def metrics(sim: Simulation) -> dict[str, Any]:
    sc, n = sim.sc, sim.sc.learner.group_size
    kappa = sim.kappa
    steps = sim.steps
    w0 = min(sc.warmup, max(0, len(steps) - 1))
    measured = len(steps) - w0
    w1 = w0 + (measured // kappa) * kappa if measured >= kappa else len(steps)
    window = steps[w0:w1]
    out: dict[str, Any] = {"name": sc.name, "seed": sc.seed, "steps": len(steps), "stalled": sim.stalled}
    if not window:
        return out
    t_start = window[0].requested
    t_end = window[-1].requested + window[-1].wait + window[-1].train
    duration = max(t_end - t_start, 1e-12)
    wait = sum(s.wait for s in window)
    train = sum(s.train for s in window)
    t_train = statistics.median(s.train for s in steps)

    alive = {w.id for w in sim.workers.values() if w.alive}
    t90 = [t for p in sim.publications if (t := p.t_bcast(0.9, alive)) is not None]
    t100 = [t for p in sim.publications if (t := p.t_bcast(1.0, alive)) is not None]
    receivers = [len(p.receivers) for p in sim.publications]

    active_s = {w.id: sum(_overlap(a, b, t_start, t_end) for a, b in w.billed) for w in sim.workers.values()}
    worker_cost = sum(active_s[w.id] * w.spec.price for w in sim.workers.values()) / 3600
    cost_window = sc.learner.price * duration / 3600 + worker_cost
    mu_pool = sum(active_s[w.id] * w.spec.throughput for w in sim.workers.values()) / duration
    total_cost = (
        sc.learner.price * sim.end_time / 3600
        + sum((b - a) * w.spec.price for w in sim.workers.values() for a, b in w.billed) / 3600
    )

    delivered = sum(g for t, g, _ in sim.deliveries if t_start <= t < t_end)
    hist = Counter(x for s in steps for x in s.staleness)
    timing = {"kappa": kappa, "t_train": t_train, "batch": sc.learner.batch}
    t_bcast = statistics.median(t90) if t90 else 0.0

    out.update(
        {
            "measured_steps": len(window),
            "wait_per_step": wait / len(window),
            "bubble_ratio": wait / (wait + train),
            "step_time": duration / len(window),
            "t_train": t_train,
            "t_bcast_q90": statistics.median(t90) if t90 else None,
            "t_bcast_q100": statistics.median(t100) if t100 else None,
            "t_bcast_q90_max": max(t90) if t90 else None,
            "t_bcast_q100_max": max(t100) if t100 else None,
            "broadcasts": len(sim.publications),
            "versions_skipped": len(sim.published_at) - len(sim.publications),
            "receivers": statistics.median(receivers) if receivers else 0,
            "t_bcast_formula": sim.broadcast_estimate(round(statistics.median(receivers)))
            if receivers
            else None,
            "active_workers": sum(active_s.values()) / duration,
            "mu_pool": mu_pool,
            "rollout_throughput": delivered * n / duration,
            "consumed_throughput": len(window) * sc.learner.batch / duration,
            "cost_per_hour": cost_window / duration * 3600,
            "cost_per_step": cost_window / len(window),
            "total_cost": total_cost,
            "staleness_histogram": {str(k): v * n for k, v in sorted(hist.items())},
            "max_staleness": max(hist) if hist else None,
            "dropped_stale": sim.buffer.rejected.get("stale", 0) * n,
            "lost_in_flight": sim.lost_groups * n,
            "predicted_bubble_ratio": capacity.bubble_ratio(**timing, t_bcast=t_bcast, mu_pool=mu_pool),
            "predicted_bubble_ratio_continuous": capacity.bubble_ratio_continuous(
                **timing, staleness=sc.learner.staleness, t_bcast=t_bcast, mu_pool=mu_pool
            ),
            "wait_per_step_series": [s.wait for s in steps],
            "train_per_step_series": [s.train for s in steps],
            "scheduler_decisions": sim.decisions,
        }
    )
    if sim.faults:
        horizon = 3 * kappa * t_train + (max(t100) if t100 else 0.0)
        out["faults"] = fault_effects(sim, horizon)
        first = min(f.time for f in sim.faults)
        hit = max((s.step for s in steps if s.requested <= first), default=0)
        out["fault_steps"] = [hit, min(len(steps), hit + 2 * kappa)]
        out["throughput_drop"] = max(f["throughput_drop"] for f in out["faults"])
        for key in ("recovery_s", "recovered_for_good_s"):
            recoveries = [f[key] for f in out["faults"]]
            out[key] = None if None in recoveries else max(recoveries)
    return out


def with_baseline(result: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """Add the fault-free run's bubble ratio and the increases over it (percentage points): over
    the measured steps, and over the 2 kappa steps from the one the first fault hit."""
    result = dict(result)
    result["baseline_bubble_ratio"] = baseline.get("bubble_ratio")
    if "bubble_ratio" in result and "bubble_ratio" in baseline:
        result["bubble_ratio_increase"] = result["bubble_ratio"] - baseline["bubble_ratio"]
    window = result.get("fault_steps")
    if window:
        lo, hi = window

        def ratio(m: dict[str, Any]) -> float:
            waits, trains = m["wait_per_step_series"][lo:hi], m["train_per_step_series"][lo:hi]
            return sum(waits) / (sum(waits) + sum(trains))

        result["fault_cycle_bubble_ratio_increase"] = ratio(result) - ratio(baseline)
    return result


# ---------------------------------------------------------------------------- text
def _fmt(v: Any, unit: str = "", pct: bool = False) -> str:
    if v is None:
        return "n/a"
    if pct:
        return f"{v:.2%}"
    return f"{v:.4g}{unit}"


def render(m: dict[str, Any]) -> str:
    if "bubble_ratio" not in m:
        return f"{m.get('name') or 'scenario'}: no step completed{' (stalled)' if m.get('stalled') else ''}"
    lines = [
        f"scenario                       {m['name'] or '(unnamed)'}  seed {m['seed']}"
        + ("  STALLED" if m["stalled"] else ""),
        f"steps (measured)               {m['steps']} ({m['measured_steps']})",
        f"learner wait per step          {_fmt(m['wait_per_step'], ' s')}",
        f"bubble ratio                   {_fmt(m['bubble_ratio'], pct=True)}  (capacity model "
        f"{_fmt(m['predicted_bubble_ratio'], pct=True)}, continuous "
        f"{_fmt(m['predicted_bubble_ratio_continuous'], pct=True)})",
        f"step time                      {_fmt(m['step_time'], ' s')}",
        f"T_bcast q=0.9 / q=1.0          {_fmt(m['t_bcast_q90'], ' s')} / {_fmt(m['t_bcast_q100'], ' s')} "
        f"(max {_fmt(m['t_bcast_q100_max'], ' s')}; formula {_fmt(m['t_bcast_formula'], ' s')}; "
        f"{m['broadcasts']} broadcasts, {m['versions_skipped']} versions skipped)",
        f"active workers / mu_pool       {m['active_workers']:.3g} / {m['mu_pool']:.4g} trajectories/s",
        f"rollout throughput             {m['rollout_throughput']:.4g} trajectories/s generated, "
        f"{m['consumed_throughput']:.4g} consumed",
        f"dropped (stale / in flight)    {m['dropped_stale']} / {m['lost_in_flight']} trajectories",
        f"staleness histogram            {m['staleness_histogram']}",
        f"cost                           ${m['cost_per_hour']:.2f}/h, ${m['cost_per_step']:.3f}/step, "
        f"${m['total_cost']:.2f} total",
    ]
    if "bubble_ratio_increase" in m:
        lines.append(
            f"bubble ratio without faults    {_fmt(m['baseline_bubble_ratio'], pct=True)} "
            f"(increase {m['bubble_ratio_increase'] * 100:+.2f} points; over the 2 kappa steps from "
            f"the fault {m.get('fault_cycle_bubble_ratio_increase', 0.0) * 100:+.2f} points)"
        )
    for f in m.get("faults", []):
        what = f"{f['kind']} {f['stage']} x{f['factor']}" if f["kind"] == "slow" else "drop"
        lines.append(
            f"fault at {f['time']:.0f} s: {f['worker']} {what}: throughput drop {f['throughput_drop']:.2%}, "
            + (
                "no recovery within the run"
                if f["recovery_s"] is None
                else f"recovery {f['recovery_s']:.0f} s"
                + (
                    ""
                    if f["recovered_for_good_s"] == f["recovery_s"]
                    else " (back for good after "
                    + (
                        "the run"
                        if f["recovered_for_good_s"] is None
                        else f"{f['recovered_for_good_s']:.0f} s"
                    )
                    + ")"
                )
            )
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- plot
def plot_timeline(sim: Simulation, path: str) -> None:
    """Learner busy/idle, each worker's installed version over time with broadcast arrivals, and
    mu_pool(t) against the scheduler's target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = list(sim.workers.values())
    fig, (ax_l, ax_w, ax_c) = plt.subplots(
        3,
        1,
        sharex=True,
        figsize=(11, 3 + 0.16 * len(workers) + 3),
        gridspec_kw={"height_ratios": [1, max(2, 0.16 * len(workers)), 2]},
    )
    h = 3600.0 if sim.end_time > 4 * 3600 else 1.0
    unit = "h" if h > 1 else "s"
    busy = [((s.requested + s.wait) / h, s.train / h) for s in sim.steps]
    idle = [(s.requested / h, s.wait / h) for s in sim.steps if s.wait > 0]
    ax_l.broken_barh(busy, (0.55, 0.4), color="tab:green", label="training")
    ax_l.broken_barh(idle, (0.05, 0.4), color="tab:red", label="waiting (bubble)")
    for _, t in sim.published_at:
        ax_l.axvline(t / h, color="0.6", lw=0.5)
    ax_l.set_yticks([])
    ax_l.set_ylabel("learner")
    ax_l.legend(loc="upper right", fontsize=7, ncol=2)

    cmap = plt.get_cmap("tab10")
    for row, w in enumerate(workers):
        versions = w.versions + [(sim.end_time, -1)]
        for (t0, v), (t1, _) in zip(versions, versions[1:], strict=False):
            for a, b in w.billed:
                lo, hi = max(t0, a), min(t1, b)
                if hi > lo:
                    color = cmap((v // sim.kappa) % 10)
                    ax_w.broken_barh([(lo / h, (hi - lo) / h)], (row - 0.4, 0.8), color=color, lw=0)
        gen = w.generating + [(sim.end_time, 0.0)]
        for (t0, rate), (t1, _) in zip(gen, gen[1:], strict=False):
            if rate == 0 and t1 > t0:
                for a, b in w.billed:
                    lo, hi = max(t0, a), min(t1, b)
                    if hi > lo:
                        ax_w.broken_barh(
                            [(lo / h, (hi - lo) / h)], (row - 0.4, 0.8), color="w", alpha=0.6, lw=0
                        )
        arrivals = [t / h for t, v in w.versions if t > 0]
        ax_w.plot(arrivals, [row] * len(arrivals), "k|", ms=5)
        if w.dropped_at is not None:
            ax_w.plot([w.dropped_at / h], [row], "rx", ms=6)
    ax_w.set_yticks(range(len(workers)), [w.id for w in workers], fontsize=6 if len(workers) > 20 else 8)
    ax_w.invert_yaxis()
    ax_w.set_ylabel("installed version (colour; pale:\nnot generating) | install, x drop")

    ts, vs = pool_capacity(sim)
    ax_c.step(
        [t / h for t in ts] + [sim.end_time / h],
        vs + vs[-1:],
        where="post",
        label="mu_pool(t): active, not lagging",
    )
    if sim.targets:
        ax_c.step(
            [t / h for t, _ in sim.targets],
            [v if math.isfinite(v) else float("nan") for _, v in sim.targets],
            where="post",
            ls="--",
            label="scheduler target",
        )
    for f in sim.faults:
        ax_c.axvline(f.time / h, color="tab:red", lw=0.8)
    ax_c.set_ylabel("trajectories/s")
    ax_c.set_xlabel(f"time ({unit})")
    ax_c.legend(loc="lower right", fontsize=7)
    ax_l.set_title(sim.sc.name or "echo2 simulate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
