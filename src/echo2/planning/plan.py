"""`echo2 plan`: how much rollout throughput keeps the learner busy, and the cheapest pool for it.

Pure: validated inputs in, a JSON-ready dict out (the CLI prints it); `load_pool` reads the pool
file that `echo2 plan --pool` and the `local` provider share. Uses the capacity model (capacity.py)
and both selection policies (selection.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from echo2.config import ConfigError, check_kappa, publish_every, read_toml, validation_message
from echo2.fleet.selection import WorkerOffer, exact, greedy
from echo2.planning import capacity as cap


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkerOfferConfig(_Strict):
    name: str = Field(min_length=1)
    """Worker type name."""
    count: int = Field(ge=1)
    """How many of this type are available."""
    throughput: float = Field(gt=0, allow_inf_nan=False)
    """Trajectories per second of one worker."""
    price: float = Field(ge=0, allow_inf_nan=False)
    """USD per hour of one worker."""


class Pool(_Strict):
    workers: list[WorkerOfferConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> Pool:
        names = [w.name for w in self.workers]
        if len(set(names)) != len(names):
            raise ValueError("workers: names must be unique")
        return self


def load_pool(path) -> Pool:
    """A POOL.toml (`echo2 plan --pool`, `scheduler.pool`); a mistake names the file and the key."""
    try:
        return Pool.model_validate(read_toml(path))
    except ValidationError as e:
        raise ConfigError(f"{path}: {validation_message(e)}") from None


class PlanInput(_Strict):
    t_train: float = Field(gt=0, allow_inf_nan=False)
    t_bcast: float = Field(ge=0, allow_inf_nan=False)
    batch: float = Field(gt=0, allow_inf_nan=False)
    staleness: int = Field(ge=0)
    kappa: int | None = Field(None, ge=1)
    gamma: float = Field(1.1, ge=1, allow_inf_nan=False)
    learner_price: float = Field(0.0, ge=0, allow_inf_nan=False)
    model: cap.CapacityModel = "continuous"
    """"continuous": echo2's workers, which keep generating during a broadcast (default);
    "paper": the paper's cycle model, in which they stop (to reproduce the paper)."""
    wire: Literal["bf16", "fp32"] = "bf16"
    """Dtype of the published snapshot (`learner.dtype`): picks the measured delta ratio."""
    delta_ratio: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    """Delta bytes / full snapshot bytes for the delta prediction; None: the measured median for
    `wire` and kappa (`capacity.delta_ratio`)."""

    @model_validator(mode="after")
    def _kappa_bound(self) -> PlanInput:
        check_kappa(self.kappa, self.staleness, key="kappa")  # the learner's rule (config/schema.py)
        return self

    @property
    def resolved_kappa(self) -> int:
        return publish_every(self.kappa, self.staleness)

    @property
    def resolved_delta_ratio(self) -> float:
        if self.delta_ratio is not None:
            return self.delta_ratio
        return cap.delta_ratio(self.resolved_kappa, self.wire)


STUDIED_STALENESS = 8
"""The largest rollout lag the staleness study measured (docs/staleness.md: lag 0-8 on the
quickstart task; the paper reports S = 11 unstable)."""
STUDIED_RESOLUTION = (
    "6 seeds per arm bound the cost at 0.10 in held-out accuracy (lag 8 - lag 0 with clip: -0.023, "
    "95% interval [-0.087, +0.042]; lag 4: +0.010 [-0.032, +0.051]); a loss up to about 0.09 at S = 8 "
    "is not ruled out"
)
"""What the powered study's intervals support (experiments/staleness/staleness_report.py: paired by seed, 6 seeds per
`clip` arm, 48 steps on the quickstart task)."""


def staleness_note(staleness: int) -> str:
    """What the staleness study says of S (printed by `echo2 plan`)."""
    if staleness <= STUDIED_STALENESS:
        return (
            f"S = {staleness} is inside the lags measured (<= {STUDIED_STALENESS}): "
            f"{STUDIED_RESOLUTION}; docs/staleness.md"
        )
    return (
        f"S = {staleness} is BEYOND the lags measured (<= {STUDIED_STALENESS}, docs/staleness.md); "
        "the paper reports S = 11 unstable"
    )


def _sized(inp: PlanInput, types: list[WorkerOffer], t_bcast: float) -> dict[str, Any]:
    """The target, the cheapest pool for it and what it gives, at this T_bcast."""
    kappa = inp.resolved_kappa
    timing = {"kappa": kappa, "t_train": inp.t_train, "t_bcast": t_bcast, "batch": inp.batch}
    mu_min = cap.required_throughput(inp.model, staleness=inp.staleness, **timing)
    pool_mu = sum(t.throughput * t.count for t in types)
    if mu_min is None:  # no throughput can hide the broadcast at this kappa
        target, chosen, heuristic = None, exact(types, pool_mu), greedy(types, pool_mu)
    else:
        target = inp.gamma * mu_min
        chosen, heuristic = exact(types, target), greedy(types, target)
    mu_pool = chosen.throughput
    bubble = cap.predicted_bubble(inp.model, staleness=inp.staleness, **timing, mu_pool=mu_pool)
    if inp.model == "paper":
        overlap = cap.overlap_holds(**timing, mu_pool=mu_pool)
        bound = (
            cap.staleness_bound_overlap(kappa=kappa, t_train=inp.t_train, t_bcast=t_bcast)
            if overlap
            else cap.staleness_bound(**timing, mu_pool=mu_pool)
        )
    else:  # the learner advances one version per step of max(T_train, R / mu) (bubble benchmark)
        t_step = max(inp.t_train, inp.batch / mu_pool) if mu_pool > 0 else inp.t_train
        bound = cap.staleness_bound(**{**timing, "t_train": t_step}, mu_pool=mu_pool) if mu_pool > 0 else None
    cost_per_hour = inp.learner_price + chosen.cost_per_hour
    step_seconds = inp.t_train / (1 - bubble) if bubble < 1 else float("inf")
    return {
        "t_bcast": t_bcast,
        "mu_min": mu_min,
        "mu_target": target,
        "feasible": mu_min is not None and chosen.feasible,
        "smallest_feasible_kappa": cap.smallest_feasible_kappa(t_train=inp.t_train, t_bcast=t_bcast),
        "staleness_bound": bound,
        "staleness_bound_within_s": bound is not None and bound <= inp.staleness,
        "active": chosen.active,
        "throughput": mu_pool,
        "cost_per_hour": cost_per_hour,
        "cost_per_step": cost_per_hour * step_seconds / 3600,
        "greedy_active": heuristic.active,
        "greedy_cost_per_hour": inp.learner_price + heuristic.cost_per_hour,
        "bubble_ratio": bubble,
        "step_seconds": step_seconds,
    }


def make_plan(inp: PlanInput, pool: Pool) -> dict[str, Any]:
    """The plan at the given T_bcast (the full snapshot's, as measured or assumed), and under
    "delta" the same plan at the T_bcast deltas are predicted to give (`capacity.delta_t_bcast`
    with the measured ratio): a prediction, not a measurement."""
    types = [
        WorkerOffer(name=w.name, count=w.count, throughput=w.throughput, price=w.price) for w in pool.workers
    ]
    plan = _sized(inp, types, inp.t_bcast)
    ratio = inp.resolved_delta_ratio
    delta = _sized(inp, types, cap.delta_t_bcast(inp.t_bcast, ratio=ratio))
    delta.pop("greedy_active")
    return {
        "model": inp.model,
        **plan,
        "kappa": inp.resolved_kappa,
        "staleness": inp.staleness,
        "staleness_studied": inp.staleness <= STUDIED_STALENESS,
        "delta": {
            "prediction": True,
            "ratio": ratio,
            "ratio_source": "given" if inp.delta_ratio is not None else "measured",
            "wire": inp.wire,
            **delta,
        },
    }


def _count(active: dict[str, int]) -> int:
    return sum(active.values())


def delta_line(plan: dict[str, Any]) -> str:
    """What deltas are predicted to change (printed by `echo2 plan`)."""
    d = plan["delta"]
    source = "given"
    if d["ratio_source"] == "measured":
        k, top = plan["kappa"], cap.MEASURED_DELTA_KAPPAS[-1]
        at = "kappa 1" if k <= 1 else f"kappa {top}"
        if 1 < k < top:
            at += f", an upper bound for kappa {k}"
        elif k > top:
            at += f", extrapolated to kappa {k}"
        source = f"measured median, {d['wire']}, lr 1e-6, {at}, SmolLM2-135M; docs/bench/snapshot_delta.json"
    mu = (
        "infeasible -> infeasible"
        if plan["mu_min"] is None and d["mu_min"] is None
        else f"{_fmt(plan['mu_min'])} -> {_fmt(d['mu_min'])}/s"
    )
    return (
        f"delta snapshots (PREDICTION)   T_bcast {plan['t_bcast']:.4g} s full -> {d['t_bcast']:.4g} s delta "
        f"(ratio {d['ratio']:.2%}, {source}; bytes scaled, fluid model)\n"
        f"  with deltas                  target {'reachable' if d['feasible'] else 'NOT reachable'}, "
        f"mu_min {mu}, workers {_count(plan['active'])} -> "
        f"{_count(d['active'])}, ${plan['cost_per_step']:.3f} -> ${d['cost_per_step']:.3f} per step, "
        f"staleness bound {plan['staleness_bound'] or 'none'} -> {d['staleness_bound'] or 'none'}, "
        f"smallest feasible kappa {plan['smallest_feasible_kappa']} -> {d['smallest_feasible_kappa']}"
    )


def _fmt(x: float | None) -> str:
    return "infeasible" if x is None else f"{x:.4g}"


def render(plan: dict[str, Any]) -> str:
    """The human-readable report of `echo2 plan`."""
    lines = []
    if plan["mu_min"] is None:
        lines.append(
            f"INFEASIBLE at kappa = {plan['kappa']}: kappa * T_train <= T_bcast; "
            f"the smallest feasible kappa is {plan['smallest_feasible_kappa']}"
        )
    else:
        lines.append(
            f"required throughput mu_min     {plan['mu_min']:.4g} trajectories/s ({plan['model']} model)"
        )
        lines.append(
            f"target gamma * mu_min          {plan['mu_target']:.4g} trajectories/s "
            f"({'reachable' if plan['feasible'] else 'NOT reachable with this pool'})"
        )
    active = ", ".join(f"{k} x{v}" for k, v in plan["active"].items() if v) or "none"
    lines += [
        f"active workers (exact)         {active}  ->  {plan['throughput']:.4g} trajectories/s",
        f"cost per hour                  ${plan['cost_per_hour']:.2f} (greedy by unit cost: "
        f"${plan['greedy_cost_per_hour']:.2f})",
        f"predicted bubble ratio         {plan['bubble_ratio']:.1%}",
        f"predicted step time            {plan['step_seconds']:.1f} s",
        f"cost per learner step          ${plan['cost_per_step']:.3f}",
        f"kappa / staleness bound        {plan['kappa']} / {plan['staleness_bound'] or 'none'} "
        f"({'within' if plan['staleness_bound_within_s'] else 'EXCEEDS'} S = {plan['staleness']})",
        f"staleness study                {staleness_note(plan['staleness'])}",
        delta_line(plan),
    ]
    return "\n".join(lines)
