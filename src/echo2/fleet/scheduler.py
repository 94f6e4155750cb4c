"""Online activation policy (paper 4.3 and C.2.1): keep pool throughput at gamma * mu_min, cheaply.

Pure: the caller passes the workers it knows (throughput, price, state) and the target;
the scheduler returns decisions, each with its reason. Deviations must persist for `sustain_s`
before anything changes, so throughput jitter around the target causes no flapping; a lost worker
is replaced at once. Standby workers are activated in increasing rho = price / throughput, as many
as reach the target; one whose throughput is not known yet (0) comes after every known one, and is
activated alone in its decision: what it adds is unknown until it has been measured, so an
unmeasured reserve is never activated all at once. Knows no sockets and no clock of its own (the
caller passes `now`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Action(StrEnum):
    ACTIVATE = "activate"
    RELEASE = "release"


class Kind(StrEnum):
    """What a `WorkerView.worker_id` names."""

    WORKER = "worker"
    """A registered worker: the id is its worker id."""
    SLOT = "slot"
    """A provider's slot with no registered worker (not started, or started and not registered
    yet): the id is the offer's name."""


class Role(StrEnum):
    ACTIVE = "active"
    STANDBY = "standby"
    LOST = "lost"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerView:
    worker_id: str
    throughput: float
    """Trajectories/s the coordinator believes (coordinator/registry.py: `Registry.throughput`): what the
    worker delivered once measured, else its own figure (calibrated or declared); 0: not known yet
    (or it delivered nothing)."""
    price: float
    role: Role
    kind: Kind = Kind.WORKER

    @property
    def rho(self) -> float:
        return self.price / self.throughput if self.throughput > 0 else float("inf")


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    action: Action
    worker_id: str
    reason: str
    kind: Kind = Kind.WORKER


@dataclass(slots=True, kw_only=True)
class Scheduler:
    sustain_s: float = 30.0
    """A deviation from the target must last this long before workers are activated or released."""
    release_margin: float = 0.15
    """Release only while capacity exceeds the target by more than this share."""
    _below_since: float | None = field(default=None, init=False)
    _above_since: float | None = field(default=None, init=False)
    _lost_seen: set[str] = field(default_factory=set, init=False)

    @property
    def pending(self) -> bool:
        """A deviation from the target is being timed (a decision may come without any change)."""
        return self._below_since is not None or self._above_since is not None

    def decide(self, workers: list[WorkerView], *, target: float, now: float) -> list[Decision]:
        active = [w for w in workers if w.role is Role.ACTIVE]
        standby = sorted((w for w in workers if w.role is Role.STANDBY), key=lambda w: (w.rho, w.worker_id))
        capacity = sum(w.throughput for w in active)
        newly_lost = [
            w.worker_id for w in workers if w.role is Role.LOST and w.worker_id not in self._lost_seen
        ]
        self._lost_seen.update(newly_lost)

        if capacity < target:
            self._above_since = None
            if self._below_since is None:
                self._below_since = now
            if newly_lost or now - self._below_since >= self.sustain_s:
                why = (
                    f"replacing lost {', '.join(newly_lost)}"
                    if newly_lost
                    else f"capacity {capacity:.3g}/s below target {target:.3g}/s for {now - self._below_since:.0f}s"
                )
                decisions = []
                for w in standby:
                    if capacity >= target:
                        break
                    unknown = w.throughput <= 0
                    if unknown and decisions:
                        break  # an unmeasured worker is activated alone, in a decision of its own
                    capacity += w.throughput
                    decisions.append(
                        Decision(
                            action=Action.ACTIVATE,
                            worker_id=w.worker_id,
                            kind=w.kind,
                            reason=f"{why}; "
                            + (
                                "throughput not known yet: one at a time"
                                if unknown
                                else f"lowest unit cost rho={w.rho:.3g}"
                            ),
                        )
                    )
                    if unknown:
                        break
                self._below_since = None if capacity >= target else now
                return decisions
            return []

        self._below_since = None
        if capacity <= target * (1 + self.release_margin):
            self._above_since = None
            return []
        if self._above_since is None:
            self._above_since = now
        if now - self._above_since < self.sustain_s:
            return []
        decisions = []
        for w in sorted(active, key=lambda w: (-w.price, w.worker_id)):  # most expensive first
            if capacity - w.throughput >= target:
                capacity -= w.throughput
                decisions.append(
                    Decision(
                        action=Action.RELEASE,
                        worker_id=w.worker_id,
                        kind=w.kind,
                        reason=(
                            f"capacity above target {target:.3g}/s by more than {self.release_margin:.0%} for "
                            f"{now - self._above_since:.0f}s; most expensive (${w.price:.3g}/h)"
                        ),
                    )
                )
        self._above_since = None
        return decisions
