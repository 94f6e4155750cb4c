"""How big a lease is and when it is due, from the worker's throughput, and how the coordinator
measures that throughput from what the worker delivers (`Delivery`). Pure: the caller's clock, no
I/O, no lock. A lease fits well inside the lease timeout on a worker as fast as its figure says, and
a step's batch is split across the workers by their throughput."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

LEASE_SAFETY = 0.5
"""Share of the lease timeout a lease should take on a worker as fast as its throughput figure."""
SPELLS = 8
"""Spells of lease time a worker's delivered rate is measured over (`Delivery`)."""


def lease_groups(
    *,
    throughput: float | None,
    pool_throughput: float,
    groups_per_step: int,
    group_size: int,
    lease_timeout: float,
    cap: int,
    safety: float = LEASE_SAFETY,
) -> int:
    """Groups in one lease for a worker of `throughput` trajectories/s.

    The least of: the groups it generates in `safety * lease_timeout`; its share of a step's batch
    of `groups_per_step` groups, in proportion to its throughput over the active pool's
    `pool_throughput` (rounded up, so the shares cover the batch); and `cap`. At least one group:
    one for a worker measured at zero (its leases expired undelivered). A worker with no figure at
    all (None: it declared none and reported none) gets `cap`; its first lease measures it."""
    assert cap >= 1 and group_size >= 1 and lease_timeout > 0
    if throughput is None:
        return cap
    if throughput <= 0:
        return 1
    in_time = math.floor(safety * lease_timeout * throughput / group_size)
    # relative slack: a pool summed in floating point must not round a whole share up to one more
    share = math.ceil(groups_per_step * throughput / max(pool_throughput, throughput) * (1 - 1e-9))
    return max(1, min(cap, in_time, share))


def lease_deadline(
    *,
    groups: int,
    throughput: float | None,
    group_size: int,
    lease_timeout: float,
    safety: float = LEASE_SAFETY,
) -> float:
    """Seconds a lease of `groups` groups is held before it is reissued: the lease timeout, or, for a
    worker so slow that even this lease takes over `safety * lease_timeout`, its expected time over
    `safety` (a dead worker is caught sooner, by its missing heartbeats)."""
    if throughput is None or throughput <= 0:
        return lease_timeout
    return max(lease_timeout, groups * group_size / throughput / safety)


@dataclass(slots=True, kw_only=True)
class Delivery:
    """What one worker delivered: records accepted per second of lease time (the time it holds at
    least one lease), over its last `SPELLS` spells of it. A spell ends when the worker holds no
    lease any more. It counts when its leases were completed or expired; a lease given back
    (returned, released, refused as stale, its worker lost) voids the spell, as time cut short
    says nothing of the worker's rate."""

    open: int = 0
    since: float = 0.0
    records: int = 0
    void: bool = False
    spells: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=SPELLS))

    def opened(self, now: float) -> None:
        if self.open == 0:
            self.since, self.records, self.void = now, 0, False
        self.open += 1

    def accepted(self, n: int) -> None:
        self.records += n

    def closed(self, now: float | None) -> None:
        """A lease closed at `now` (completed or expired); None: given back (voids the spell)."""
        assert self.open > 0
        self.open -= 1
        self.void = self.void or now is None
        if self.open == 0 and not self.void and now > self.since:
            self.spells.append((self.records, now - self.since))

    @property
    def rate(self) -> float | None:
        """Trajectories/s delivered, or None before a spell has counted."""
        seconds = sum(s for _, s in self.spells)
        return sum(n for n, _ in self.spells) / seconds if seconds > 0 else None
