"""A scenario over a parameter list (`[sweep]`): one run per series and x value, a table, a plot.

Every point is validated before the first one runs. With `plan_threshold`, each series also gets
the smallest worker count that `echo2 plan` (`planning.plan.make_plan`, gamma = 1) calls feasible,
fed with the simulated T_train and T_bcast of that point, to set beside the simulated curve.
"""

from __future__ import annotations

import math
from typing import Any

from echo2.broadcast.plan import lower_bound
from echo2.planning.plan import PlanInput, Pool, make_plan
from echo2.sim.model import simulate
from echo2.sim.report import metrics, with_baseline
from echo2.sim.scenario import Scenario, SweepSpec


def run_point(sc: Scenario) -> dict[str, Any]:
    """Metrics of one scenario; with faults, also the fault-free run's bubble ratio beside it."""
    result = metrics(simulate(sc))
    if sc.faults:
        result = with_baseline(result, metrics(simulate(sc, faults=False)))
    return result


def plan_feasible(sc: Scenario, m: dict[str, Any]) -> bool | None:
    """Whether `echo2 plan` (gamma = 1) finds this point's pool enough, with its simulated timings."""
    if m.get("t_train") is None:
        return None
    pool = Pool.model_validate(
        {
            "workers": [
                {"name": w.name, "count": w.count, "throughput": w.throughput, "price": w.price}
                for w in sc.workers
            ]
        }
    )
    inp = PlanInput(
        t_train=m["t_train"],
        t_bcast=m["t_bcast_q90"] or 0.0,
        batch=sc.learner.batch,
        staleness=sc.learner.staleness,
        kappa=sc.learner.publish_every,
        gamma=1.0,
        learner_price=sc.learner.price,
        model=sc.capacity_model,
    )
    return bool(make_plan(inp, pool)["feasible"])


def run_sweep(points: list[tuple[str, float | None, Scenario]], sweep: SweepSpec) -> dict[str, Any]:
    rows = []
    paper = {s.label: s.paper for s in sweep.series}
    for label, x, sc in points:
        m = run_point(sc)
        for per_step in ("wait_per_step_series", "train_per_step_series"):
            m.pop(per_step, None)  # a sweep reports the summary of each point
        row = {"series": label, "x": x, **m}
        if paper.get(label) and x is None:
            row["paper"] = paper[label]
        if sweep.plan_threshold:
            row["plan_feasible"] = plan_feasible(sc, m)
        if sc.workers:
            row["lower_bound"] = lower_bound(sc.publication_bytes(1), min(w.down_bps for w in sc.workers))
        rows.append(row)
    out: dict[str, Any] = {"x": sweep.x, "metrics": sweep.metrics, "rows": rows}
    if sweep.plan_threshold:
        out["plan_threshold"] = {
            s.label: min(
                (r["x"] for r in rows if r["series"] == s.label and r["plan_feasible"]), default=None
            )
            for s in sweep.series
        }
    return out


def _cell(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def render_sweep(result: dict[str, Any]) -> str:
    cols = (["x"] if result["x"] else []) + list(result["metrics"])
    note = any(r.get("paper") for r in result["rows"])
    lines = ["| series | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in result["rows"]:
        paper = r.get("paper", {})
        cells = [_cell(r.get(c)) + (f" ({_cell(paper[c])})" if c in paper else "") for c in cols]
        lines.append(f"| {r['series']} | " + " | ".join(cells) + " |")
    if note:
        lines += ["", "(in parentheses: the paper's value)"]
    if "plan_threshold" in result:
        lines.append("")
        for label, x in result["plan_threshold"].items():
            lines.append(f"echo2 plan threshold ({label}): {_cell(x)}")
    return "\n".join(lines)


def plot_sweep(result: dict[str, Any], sweep: SweepSpec, path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics_ = sweep.metrics
    rows = result["rows"]
    labels = list(dict.fromkeys(r["series"] for r in rows))
    if result["x"]:
        fig, grid = plt.subplots(len(metrics_), 1, figsize=(7.5, 3.4 * len(metrics_)), squeeze=False)
    else:
        ncols = min(3, len(metrics_))
        nrows = math.ceil(len(metrics_) / ncols)
        fig, grid = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.6 * nrows), squeeze=False)
        for ax in grid.flat[len(metrics_) :]:
            ax.set_visible(False)
    axes = grid.reshape(-1, 1)
    for ax, metric in zip(axes[:, 0], metrics_, strict=False):
        for i, label in enumerate(labels):
            pts = [r for r in rows if r["series"] == label]
            color = f"C{i % 10}"
            if result["x"]:
                xs = [r["x"] for r in pts]
                ys = [r.get(metric) if r.get(metric) is not None else math.nan for r in pts]
                ax.plot(xs, ys, "o-", color=color, label=label or None, ms=4)
                thr = result.get("plan_threshold", {}).get(label)
                if thr is not None:
                    ax.axvline(thr, color=color, ls=":", lw=1.2)
            else:
                v = pts[0].get(metric)
                paper = pts[0].get("paper", {}).get(metric)
                width = 0.4 if any(r.get("paper", {}).get(metric) is not None for r in rows) else 0.8
                ax.bar(
                    i,
                    v if v is not None else 0.0,
                    width=width,
                    color=color,
                    label="simulated" if i == 0 else None,
                )
                if paper is not None:
                    ax.bar(i + width, paper, width=width, color="0.75", hatch="//", edgecolor="0.4",
                           label="paper" if not ax.get_legend_handles_labels()[1].count("paper") else None)  # fmt: skip
        if not result["x"]:
            with_paper = any(r.get("paper", {}).get(metric) is not None for r in rows)
            shift = 0.2 if with_paper else 0.0
            ax.set_xticks(
                [i + shift for i in range(len(labels))], labels, rotation=20, fontsize=7, ha="right"
            )
            if with_paper:
                ax.legend(fontsize=7)
        else:
            ax.set_xlabel(result["x"])
        if sweep.lower_bound and metric.startswith("t_bcast"):
            ax.axhline(
                rows[0].get("lower_bound", math.nan), color="k", ls="--", lw=0.8, label="lower bound M / Bw"
            )
        ax.set_ylabel(metric)
        if sweep.log_y:
            ax.set_yscale("log")
        if result["x"] and (len(labels) > 1 or sweep.lower_bound):
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if "plan_threshold" in result:
        axes[0, 0].set_title(
            (title + "\n" if title else "") + "dotted: threshold predicted by echo2 plan", fontsize=9
        )
    elif title:
        axes[0, 0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
