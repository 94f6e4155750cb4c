"""What an agreed snapshot transfer counts for (broadcast/tracker.py's credit rules, "What a claim can
move"): the Bw_hat and peers'-rate windows, one credit per relay and version, and the rate cap that a
relay's own receipt puts on what it forwards.

A relay forwards a version as it receives it, so its transfer counts only once its own receipt of
that version is credited (held until then, at most MAX_HELD per relay and version) and at most at
that receipt's rate; the chain's head received from the learner, whose streams the coordinator times
itself. Each relay earns at most one credit per version; a sample enters the medians clipped to
within a factor CLIP of the current estimate. Pure bookkeeping: no I/O, no clock, no lock (the
coordinator's state calls it under its own).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

from echo2.broadcast.plan import PEER_RATE_SAMPLES
from echo2.broadcast.transfers import Credit

MAX_HELD = 64
"""Transfers one relay served, held per version until its own receipt is credited."""
CLIP = 2.0
"""A credited rate enters the Bw_hat and peers'-rate windows clipped to [median / CLIP,
median * CLIP] of the window it joins: a handful of invented transfers at any rate shift a median by at most one order
statistic each, and even a window they fill moves by at most this factor per window."""

Record = Callable[[str, int, float, float], None]
"""A credited relay transfer for its score: (parent, bytes, seconds, now)."""


def clip(rate: float, window: deque[float]) -> float:
    """`rate` within a factor CLIP of the median of `window` (as it is once it holds
    PEER_RATE_SAMPLES; before that the first samples, not a configured guess, set the scale)."""
    if len(window) < PEER_RATE_SAMPLES:
        return rate
    estimate = statistics.median(window)
    return min(max(rate, estimate / CLIP), estimate * CLIP)


class RateCredits:
    def __init__(self) -> None:
        self.relay_credited: set[tuple[int, str]] = set()
        """(version, relay) pairs already credited: one credit per relay and version."""
        self.received_bps: dict[tuple[int, str], float] = {}
        """(version, worker): the fastest credited rate at which it received that version, from
        the learner (timed by the coordinator) or a relay (itself capped so): what it may be
        credited for forwarding that version at most."""
        self.held: dict[tuple[int, str], list[tuple[Credit, float]]] = {}
        """(version, relay): agreed transfers it served, held until its own receipt of that
        version is credited (then counted, capped at that receipt's rate)."""
        self.rates: deque[float] = deque(maxlen=20)
        self.relay_rates: deque[float] = deque(maxlen=20)
        """Rates of the last credited transfers a relay (not the learner) served: the peers' rate."""

    def bw_hat(self, default: float) -> float:
        """The median of the last credited transfer rates; `default` until there is one."""
        return statistics.median(self.rates) if self.rates else default

    def peer_bps(self) -> float | None:
        """The peers' measured relay rate (bytes/s), None until PEER_RATE_SAMPLES are credited."""
        return statistics.median(self.relay_rates) if len(self.relay_rates) >= PEER_RATE_SAMPLES else None

    def reference_bps(self, bw_hat: float) -> float:
        """What Speed is measured against: the lower quartile of the peers' recent relay rates
        (`bw_hat` until PEER_RATE_SAMPLES are credited). A relay whose median rate reaches it scores
        Speed 100: one as fast as most of its peers is not ranked by measurement noise."""
        if len(self.relay_rates) < PEER_RATE_SAMPLES:
            return bw_hat
        return statistics.quantiles(self.relay_rates, n=4, method="inclusive")[0]

    def forget(self, version: int) -> None:
        """An evicted version: its credits, caps and held transfers go."""
        self.relay_credited = {k for k in self.relay_credited if k[0] != version}
        self.received_bps = {k: r for k, r in self.received_bps.items() if k[0] != version}
        self.held = {k: c for k, c in self.held.items() if k[0] != version}

    def credit(self, version: int, credit: Credit | None, now: float, *, record: Record) -> None:
        """Count an agreed transfer: the learner's (timed by the coordinator itself) at once; a
        relay's once its own receipt of the version is credited (held until then). `record` gets
        each credited relay's (parent, bytes, seconds, now), for its score."""
        if credit is None:
            return
        parent = credit.parent_id
        if parent is not None and (version, parent) not in self.received_bps:
            held = self.held.setdefault((version, parent), [])
            if len(held) < MAX_HELD:
                held.append((credit, now))
            return
        ready = [(credit, now)]
        while ready:  # a chain's held transfers, down the chain
            credit, at = ready.pop()
            if self._count(version, credit, at, record):
                ready.extend(self.held.pop((version, credit.receiver_id), ()))

    def _count(self, version: int, credit: Credit, now: float, record: Record) -> bool:
        """A relay forwards a version as it receives it, so its rate is capped at the rate its own
        receipt was credited at (the learner's streams are timed by the coordinator; a relay's are
        capped so in turn): a pair confirming each other's invented transfers is credited at most
        at the rate an honest link upstream, or the learner, was measured at. The receiver's rate
        is noted (True: its first, so the transfers it served, held, may be counted); each relay
        earns one credit per version, its rate clipped (CLIP) for the medians."""
        parent, receiver = credit.parent_id, credit.receiver_id
        rate = credit.bytes / credit.seconds if credit.bytes > 0 else None
        if rate is not None and parent is not None:
            rate = min(rate, self.received_bps[(version, parent)])
        first_receipt = rate is not None and (version, receiver) not in self.received_bps
        if rate is not None:
            self.received_bps[(version, receiver)] = max(
                rate, self.received_bps.get((version, receiver), 0.0)
            )
        if parent is None or (version, parent) not in self.relay_credited:
            if parent is not None:
                self.relay_credited.add((version, parent))
            if rate is not None:
                self.rates.append(clip(rate, self.rates))
            if parent is not None:
                record(parent, credit.bytes, credit.bytes / rate if rate else 0.0, now)
                if rate is not None:
                    self.relay_rates.append(clip(rate, self.relay_rates))
        return first_receipt
