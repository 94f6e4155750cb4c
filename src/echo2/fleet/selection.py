"""Which workers to activate: the cheapest set whose throughput reaches a target (paper 3.4).

Two pure policies over a pool of `WorkerOffer`s (one kind of worker, `count` of them): the paper's
greedy heuristic (activate in increasing unit cost rho = c / mu) and the exact minimum-cost
selection, a small integer program solved with SciPy's `milp` (HiGHS) to a zero optimality gap,
so that its answer is the optimum and not one within HiGHS's default 0.01% of it (tested against
an independent dynamic program on pools of hundreds of types). The exact one never costs more than
the greedy one when both reach the target (property-tested).

A target counts as reached when the throughput is within `REL_TOL` (relative) below it: a target
computed in floating point from the very sum a pool achieves must not be called unreachable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

REL_TOL = 1e-6
"""Relative slack on the target: throughput >= target * (1 - REL_TOL) reaches it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerOffer:
    """A rentable worker (or `count` identical ones): what the planner selects from and what a
    provider can start. A live, registered worker is a different thing (coordinator/registry.py)."""

    name: str
    throughput: float
    """Trajectories per second of one worker."""
    price: float
    """USD per hour of one worker."""
    count: int = 1

    @property
    def rho(self) -> float:
        """Unit cost: USD per hour per trajectory/s (infinite for a worker that delivers nothing)."""
        return self.price / self.throughput if self.throughput > 0 else float("inf")


@dataclass(frozen=True, slots=True, kw_only=True)
class Selection:
    active: dict[str, int]
    throughput: float
    cost_per_hour: float
    feasible: bool
    """False when the whole pool cannot reach the target (then every worker is active)."""


def _selection(pool: list[WorkerOffer], counts: dict[str, int], target: float) -> Selection:
    by_name = {t.name: t for t in pool}
    mu = sum(by_name[n].throughput * k for n, k in counts.items())
    cost = sum(by_name[n].price * k for n, k in counts.items())
    return Selection(active=counts, throughput=mu, cost_per_hour=cost, feasible=mu >= _goal(target))


def _goal(target: float) -> float:
    """The least throughput that counts as reaching `target`."""
    return target * (1 - REL_TOL)


def greedy(pool: list[WorkerOffer], target: float) -> Selection:
    """Activate workers one at a time in increasing rho = price / throughput until the target is met."""
    counts = {t.name: 0 for t in pool}
    mu, goal = 0.0, _goal(target)
    for t in sorted(pool, key=lambda t: (t.rho, t.name)):
        for _ in range(t.count):
            if mu >= goal:
                break
            counts[t.name] += 1
            mu += t.throughput
    return _selection(pool, counts, target)


def exact(pool: list[WorkerOffer], target: float) -> Selection:
    """Minimum total price with total throughput >= target (integer program, HiGHS, gap 0)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    goal, total = _goal(target), sum(t.throughput * t.count for t in pool)
    if total < goal:
        return _selection(pool, {t.name: t.count for t in pool}, target)
    if goal <= 0:
        return _selection(pool, {t.name: 0 for t in pool}, target)
    price = np.array([t.price for t in pool], dtype=float)
    # The row scaled to the target, so HiGHS's absolute feasibility tolerance (1e-7) is a relative
    # one, well inside REL_TOL: an accepted point always reaches `goal`.
    share = np.array([[t.throughput / target for t in pool]], dtype=float)
    res = milp(
        c=price,
        constraints=LinearConstraint(share, lb=min(1 - REL_TOL / 2, total / target), ub=np.inf),
        integrality=np.ones(len(pool)),
        bounds=Bounds(0, np.array([t.count for t in pool], dtype=float)),
        options={"mip_rel_gap": 0.0},
    )
    # feasible by the check above; status 0 = proven optimal (a time or node limit would be 1)
    assert res.success and res.status == 0, res.message
    counts = {t.name: int(round(x)) for t, x in zip(pool, res.x, strict=True)}
    return _selection(pool, counts, target)
