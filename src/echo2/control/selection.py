"""Which workers to activate: the cheapest set whose throughput reaches a target (paper 3.4).

Two pure policies over a pool of `WorkerOffer`s (one kind of worker, `count` of them): the paper's
greedy heuristic (activate in increasing unit cost rho = c / mu) and the exact minimum-cost
selection, a small integer program solved with SciPy's `milp` (HiGHS). The exact one never costs more than the greedy one when both reach the
target (property-tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerOffer:
    """A rentable worker (or `count` identical ones): what the planner selects from and what a
    provider can start. A live, registered worker is a different thing (control/registry.py)."""

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
    return Selection(active=counts, throughput=mu, cost_per_hour=cost, feasible=mu >= target * (1 - 1e-9))


def greedy(pool: list[WorkerOffer], target: float) -> Selection:
    """Activate workers one at a time in increasing rho = price / throughput until the target is met."""
    counts = {t.name: 0 for t in pool}
    mu = 0.0
    for t in sorted(pool, key=lambda t: (t.rho, t.name)):
        for _ in range(t.count):
            if mu >= target:
                break
            counts[t.name] += 1
            mu += t.throughput
    return _selection(pool, counts, target)


def exact(pool: list[WorkerOffer], target: float) -> Selection:
    """Minimum total price with total throughput >= target (integer program, HiGHS)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    if sum(t.throughput * t.count for t in pool) < target:
        return _selection(pool, {t.name: t.count for t in pool}, target)
    price = np.array([t.price for t in pool], dtype=float)
    mu = np.array([[t.throughput for t in pool]], dtype=float)
    res = milp(
        c=price,
        constraints=LinearConstraint(mu, lb=target, ub=np.inf),
        integrality=np.ones(len(pool)),
        bounds=Bounds(0, np.array([t.count for t in pool], dtype=float)),
    )
    assert res.success, res.message  # feasible by the check above
    counts = {t.name: int(round(x)) for t, x in zip(pool, res.x, strict=True)}
    return _selection(pool, counts, target)
