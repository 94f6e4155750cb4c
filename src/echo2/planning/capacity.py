"""Capacity model of ECHO-2 (paper section 3.3 and Appendix B): pure functions, no I/O.

Units: times in seconds, R in trajectories per learner step, throughputs mu in trajectories per
second. Shared by `echo2 plan`, the online scheduler, the simulator and the tests.

Two models of the same system, chosen by name (`CapacityModel`):
- "continuous" (the default): how echo2's workers behave. They keep generating under their
  installed version while a snapshot is in flight, so only throughput limits the learner, as long
  as the records stay within S (`mu_min_continuous`, `bubble_ratio_continuous`). The bubble
  benchmark (docs/benchmarks.md) measured its threshold exactly for S in {2, 3, 5}.
- "paper": the paper's conservative cycle model (Equation 1, Appendix B): workers stop while a
  snapshot is broadcast (`mu_min`, `bubble_ratio`). Kept to reproduce the paper's numbers.
"""

from __future__ import annotations

import math
from typing import Literal

CapacityModel = Literal["continuous", "paper"]
MODELS: tuple[str, ...] = ("continuous", "paper")


def overlap_holds(*, kappa: int, t_train: float, t_bcast: float, batch: float, mu_pool: float) -> bool:
    """Equation 1: kappa * T_train >= T_bcast + kappa * R / mu_pool (the learner never waits)."""
    return mu_pool > 0 and kappa * t_train >= t_bcast + kappa * batch / mu_pool


def smallest_feasible_kappa(*, t_train: float, t_bcast: float) -> int:
    """The least kappa with kappa * T_train > T_bcast (otherwise no throughput is enough)."""
    return math.floor(t_bcast / t_train) + 1


def mu_min(*, kappa: int, t_train: float, t_bcast: float, batch: float) -> float | None:
    """Equation 1 solved for the pool: kappa * R / (kappa * T_train - T_bcast); None when
    kappa * T_train <= T_bcast, where no rollout throughput can hide the broadcast."""
    slack = kappa * t_train - t_bcast
    return kappa * batch / slack if slack > 0 else None


def mu_min_continuous(
    *, kappa: int, staleness: int, t_train: float, t_bcast: float, batch: float
) -> float | None:
    """The least pool throughput with `bubble_ratio_continuous` = 0. Either the learner never
    waits (mu >= R / T_train) while the staleness bound of Appendix B.2, kappa + ceil((T_bcast +
    R/mu) / T_train) - 1, stays within S, i.e. mu >= R / ((S - kappa + 1) T_train - T_bcast); or,
    where records would go stale, workers wait for each snapshot (the coordinator leases nothing to
    a worker too far behind) and the paper's Equation 1 applies. The smaller of the two (None when
    neither is reachable)."""
    paper = mu_min(kappa=kappa, t_train=t_train, t_bcast=t_bcast, batch=batch)
    fresh = (staleness - kappa + 1) * t_train - t_bcast
    if fresh <= 0:
        return paper
    own = max(batch / t_train, batch / fresh)
    return own if paper is None else min(own, paper)


def required_throughput(
    model: CapacityModel, *, kappa: int, staleness: int, t_train: float, t_bcast: float, batch: float
) -> float | None:
    """mu_min under `model` (None: no throughput is enough at this kappa)."""
    timing = {"kappa": kappa, "t_train": t_train, "t_bcast": t_bcast, "batch": batch}
    if model == "paper":
        return mu_min(**timing)
    return mu_min_continuous(staleness=staleness, **timing)


def predicted_bubble(
    model: CapacityModel,
    *,
    kappa: int,
    staleness: int,
    t_train: float,
    t_bcast: float,
    batch: float,
    mu_pool: float,
) -> float:
    """The learner's idle share under `model`."""
    timing = {"kappa": kappa, "t_train": t_train, "t_bcast": t_bcast, "batch": batch, "mu_pool": mu_pool}
    if model == "paper":
        return bubble_ratio(**timing)
    return bubble_ratio_continuous(staleness=staleness, **timing)


def target_throughput(
    *,
    kappa: int,
    staleness: int,
    t_train: float,
    t_bcast: float,
    batch: float,
    gamma: float,
    model: CapacityModel = "continuous",
) -> float:
    """The pool throughput the scheduler keeps (paper 4.3): gamma * mu_min under `model`, with
    gamma >= 1 the headroom; infinite where no pool is enough. The runtime (measured T_train and
    T_bcast) and the simulator (modelled ones) both ask this."""
    mu = required_throughput(
        model, kappa=kappa, staleness=staleness, t_train=t_train, t_bcast=t_bcast, batch=batch
    )
    return math.inf if mu is None else gamma * mu


def staleness_bound(*, kappa: int, t_train: float, t_bcast: float, batch: float, mu_pool: float) -> int:
    """Conservative bound (Appendix B.2): kappa + ceil((T_bcast + R / mu_pool) / T_train) - 1."""
    return kappa + math.ceil((t_bcast + batch / mu_pool) / t_train) - 1


def staleness_bound_overlap(*, kappa: int, t_train: float, t_bcast: float) -> int:
    """Tightened bound under the overlap condition (Appendix B.3):
    kappa + ceil((1 - 1/kappa) * T_bcast / T_train)."""
    return kappa + math.ceil((1 - 1 / kappa) * t_bcast / t_train)


def bubble_ratio(*, kappa: int, t_train: float, t_bcast: float, batch: float, mu_pool: float) -> float:
    """Predicted learner idle share in steady state.

    One publication cycle is kappa learner steps. Rollouts for the next cycle can only start once
    the snapshot is installed (T_bcast after publication) and take kappa * R / mu_pool, so the cycle
    lasts max(kappa * T_train, T_bcast + kappa * R / mu_pool) and the learner idles for the
    difference. Zero exactly when Equation 1 holds.
    """
    if mu_pool <= 0:
        return 1.0
    busy = kappa * t_train
    cycle = max(busy, t_bcast + kappa * batch / mu_pool)
    return (cycle - busy) / cycle


def bubble_ratio_continuous(
    *, kappa: int, staleness: int, t_train: float, t_bcast: float, batch: float, mu_pool: float
) -> float:
    """Predicted learner idle share when workers never stop generating (how echo2's workers behave).

    `bubble_ratio` charges every cycle with the whole broadcast, as if rollouts for the next cycle
    waited for the snapshot. echo2's workers keep generating under their installed version while a
    broadcast is in flight. Then only throughput limits the learner: a step takes
    T_step = max(T_train, R / mu_pool), and the idle share is max(0, 1 - mu_pool * T_train / R),
    as long as those records stay admissible: the staleness bound of Appendix B.2 (`staleness_bound`)
    with the learner advancing one version per T_step (it cannot go faster than its data arrive) must
    be within S. Otherwise records go stale and this falls back to the conservative cycle model.
    """
    if mu_pool <= 0:
        return 1.0
    t_step = max(t_train, batch / mu_pool)
    bound = staleness_bound(kappa=kappa, t_train=t_step, t_bcast=t_bcast, batch=batch, mu_pool=mu_pool)
    if bound > staleness:
        return bubble_ratio(kappa=kappa, t_train=t_train, t_bcast=t_bcast, batch=batch, mu_pool=mu_pool)
    return max(0.0, 1.0 - mu_pool * t_train / batch)


# ---------------------------------------------------------------------------- delta snapshots
MEASURED_DELTA_RATIO: dict[tuple[str, int], float] = {
    ("bf16", 1): 0.00659,
    ("bf16", 4): 0.0137,
    ("fp32", 1): 0.310,
    ("fp32", 4): 0.372,
}
"""Bytes of a publication's delta over the full snapshot's, by wire dtype (`learner.dtype`) and the
learner steps the delta spans (kappa): the median over 8 (kappa 1) and 5 (kappa 4) publications of
the quickstart GRPO run (SmolLM2-135M, lr 1e-6, Adam), docs/bench/snapshot_delta.json (summary keys
"lr1e-06_WIRE_kKAPPA"), measured by `OMP_NUM_THREADS=1 python bench/snapshot_delta.py --lr 1e-6
1e-5 --steps 8 --json docs/bench/snapshot_delta.json`. At lr 1e-5 they were about twice as large
(bf16: 0.0150 and 0.0336). A 135M model's ratio applied to other models is an extrapolation."""

MEASURED_DELTA_KAPPAS = (1, 4)

DELTA_MAX_BEHIND = 1
"""A publication's delta is from the previous published version (coordinator/publisher.py): a worker
more publications behind, or a new one, receives the full snapshot."""


def delta_ratio(kappa: int, wire: str = "bf16") -> float:
    """The measured ratio for a delta spanning kappa steps: kappa 1 as measured; 2-4 the kappa-4
    measurement (an upper bound: every delta over fewer steps measured smaller); beyond 4 the kappa-4
    ratio times kappa / 4 (an extrapolation, at most 1; from 1 to 4 steps it grew only 2.1x)."""
    if kappa <= 1:
        return MEASURED_DELTA_RATIO[(wire, 1)]
    top = MEASURED_DELTA_KAPPAS[-1]
    ratio = MEASURED_DELTA_RATIO[(wire, top)]
    return ratio if kappa <= top else min(1.0, ratio * kappa / top)


def publication_bytes(
    full_bytes: float,
    *,
    behind: int | None,
    delta: bool = True,
    ratio: float,
    max_behind: int = DELTA_MAX_BEHIND,
) -> float:
    """Bytes one worker receives for a publication of a `full_bytes` snapshot. `behind`: how many
    publications its installed version is behind the new one (1: it holds the previous published
    version, the delta's base; 0: it holds this one; None: a new worker, nothing installed). With
    deltas on, a worker 1..max_behind behind receives ratio x full_bytes (a delta is only sent when
    smaller, so at most full_bytes); a new or further-behind worker, or any with deltas off, the full
    snapshot. `echo2 plan`, the simulator's broadcasts and its scheduler's T_bcast estimate all ask this."""
    if behind == 0:
        return 0.0
    if delta and behind is not None and 1 <= behind <= max_behind:
        return full_bytes * min(1.0, ratio)
    return full_bytes


def delta_t_bcast(t_bcast: float, *, ratio: float) -> float:
    """T_bcast of a steady-state publication (every worker holds the previous one) with deltas, from
    the full snapshot's T_bcast, in the fluid model (a transfer's time proportional to its bytes;
    the chunk pipeline's fill and hop delays are not scaled: the simulator models them)."""
    return t_bcast * publication_bytes(1.0, behind=1, ratio=ratio)
