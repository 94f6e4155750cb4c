"""Chunk-level store-and-forward schedule of one snapshot over a broadcast plan (no SimPy, no clock).

A snapshot of M bytes travels as K = ceil(M / c) chunks. Every receiver has one inbound link (from
its parent in the `ChainPlan`, or from the learner) that sends chunks one after another; a chunk
can leave a relay only once the relay has received all of it (store-and-forward), and arrives one
hop delay d after its last byte left. So on each link, for chunk k:

    start[k] = max(arrival of chunk k at the sender, end[k-1]);  end[k] = start[k] + size_k / rate
    arrival[k] = end[k] + d

which for a chain of L hops at rate Bw gives the closed form L*d + (M/c + L - 1) * c / Bw. Instead
of one event per chunk per hop, the whole schedule is computed at once and recomputed from `now`
when something changes (a link slows, a relay drops out, a chain is rebuilt): chunks already sent
keep their times, a chunk on the wire finishes its remaining bytes at the new rate.

Links fed by the learner share its uplink B0: each gets a max-min fair share, capped by its
receiver's download, recomputed at every change (not when another flow finishes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from echo2.broadcast.plan import ChainPlan

INF = math.inf


def fair_shares(total: float, caps: list[float]) -> list[float]:
    """Max-min fair split of `total` among flows capped by `caps` (water-filling)."""
    shares = [0.0] * len(caps)
    left = total
    order = sorted(range(len(caps)), key=lambda i: caps[i])
    for n, i in enumerate(order):
        share = min(caps[i], left / (len(order) - n)) if left < INF else caps[i]
        shares[i] = share
        left -= share
    return shares


@dataclass(slots=True)
class _Link:
    sender: str | None
    """Parent worker id; None = the learner."""
    rate: float = 0.0
    """Bytes/s the current schedule was computed with."""
    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    restart: bool = False
    """Re-parented: chunks not yet received restart on the new link at the next recompute."""
    orphaned: bool = False
    """The sender dropped out and no new parent is known yet: nothing more arrives."""
    dead: bool = False
    """The receiver itself dropped out."""


class Transfer:
    """The schedule of one snapshot over one plan, from publication time `t0`."""

    def __init__(
        self,
        *,
        plan: ChainPlan,
        size_bytes: float,
        chunk_bytes: float,
        hop_delay_s: float,
        uplink_bps: float,
        link_cap: Callable[[str | None, str], float],
        t0: float,
    ) -> None:
        """`link_cap(sender, receiver)`: bytes/s of a link (for the learner as sender, the
        receiver's download cap; the uplink share is applied here)."""
        self.plan = plan
        self.t0 = t0
        self.delay = hop_delay_s
        self.uplink = uplink_bps
        self.link_cap = link_cap
        k = max(1, math.ceil(size_bytes / chunk_bytes - 1e-9))
        self.sizes = [chunk_bytes] * (k - 1) + [size_bytes - chunk_bytes * (k - 1)]
        self.links: dict[str, _Link] = {
            w: _Link(sender=plan.parent_of(w), start=[INF] * k, end=[INF] * k) for w in plan.workers()
        }
        self.recompute(t0)

    # ------------------------------------------------------------------ queries
    def install_time(self, worker: str) -> float:
        """When the last chunk has arrived (inf while the worker's feed is broken)."""
        link = self.links[worker]
        return INF if link.dead else link.end[-1] + self.delay

    def first_byte(self, worker: str) -> float:
        return self.links[worker].start[0]

    def arrivals(self, worker: str) -> list[float]:
        return [e + self.delay for e in self.links[worker].end]

    # ------------------------------------------------------------------ changes
    def children(self, worker: str) -> list[str]:
        """The receivers `worker` sends to (its plan child, and while a demoted relay's child is
        moved, a parent may briefly feed two)."""
        return [w for w, link in self.links.items() if link.sender == worker]

    def drop(self, worker: str, now: float) -> None:
        """`worker` vanished at `now`: it installs nothing, and its children receive nothing that
        had not fully left it by then, until `reattach`."""
        self.links[worker].dead = True
        for child in self.children(worker):
            link = self.links[child]
            link.orphaned = True
            for k in range(len(self.sizes)):
                if link.end[k] > now:
                    link.start[k] = link.end[k] = INF
        self.recompute(now)

    def reattach(self, worker: str, now: float) -> str | None:
        """Excise a dropped `worker` from the plan (its tail reattaches to its parent, paper C.3)
        and resume its child's transfer from that parent at `now`. Returns the child (None at a
        tail)."""
        children = self._move_children(worker)
        self.plan = self.plan.excise(worker)
        self.recompute(now)
        return children[0] if children else None

    def demote(self, worker: str, now: float, open_tails: set[str]) -> list[str]:
        """Remove a live relay found slow (`ChainPlan.demote`): its tail moves behind the tail of
        another chain in `open_tails` (else to its own parent), restarting the chunk on the wire,
        while it keeps receiving from its own parent; the plan lists it as a chain of its own from
        now on, since it has no child. Returns the children that moved."""
        plan = self.plan.demote(worker, open_tails)
        children = self.children(worker)
        for child in children:
            new_parent = plan.parent_of(child) if child in plan.workers() else self.links[worker].sender
            self._relink(child, new_parent)
        self.plan = ChainPlan(chains=(*plan.chains, (worker,)), mode=plan.mode)
        self.recompute(now)
        return children

    def _move_children(self, worker: str) -> list[str]:
        children = self.children(worker)
        for child in children:
            self._relink(child, self.links[worker].sender)
        return children

    def _relink(self, child: str, sender: str | None) -> None:
        link = self.links[child]
        link.sender = sender
        link.orphaned = False
        link.restart = True

    def recompute(self, now: float) -> None:
        """Recompute every chunk not yet sent from `now`, with the current link caps."""
        learner_fed = [
            w
            for w, link in self.links.items()
            if link.sender is None and not (link.dead or link.orphaned) and link.end[-1] > now
        ]
        shares = fair_shares(self.uplink, [self.link_cap(None, w) for w in learner_fed])
        share_of = dict(zip(learner_fed, shares, strict=True))
        for chain in self.plan.chains:
            for w in chain:
                link = self.links[w]
                if link.dead or link.orphaned:
                    continue
                rate = share_of.get(w) if link.sender is None else self.link_cap(link.sender, w)
                if rate is None:  # learner-fed and already complete
                    continue
                self._schedule(link, rate, now)

    def _schedule(self, link: _Link, rate: float, now: float) -> None:
        sizes, start, end = self.sizes, link.start, link.end
        k = next((i for i, e in enumerate(end) if e > now), len(sizes))
        if k == len(sizes):
            return
        if link.restart:  # the chunk on the old link is lost; resend from k on the new link
            link.restart = False
            prev = now
        elif start[k] <= now < end[k] < INF:  # on the wire: its remaining bytes go at the new rate
            remaining = (end[k] - now) * link.rate
            end[k] = now + remaining / rate
            prev = end[k]
            k += 1
        else:
            prev = max(now, end[k - 1]) if k > 0 else now
        link.rate = rate
        if link.sender is None:
            avail = [self.t0] * len(sizes)
        else:
            avail = [e + self.delay for e in self.links[link.sender].end]
        for i in range(k, len(sizes)):
            s = max(avail[i], prev)
            start[i] = s
            prev = end[i] = s + sizes[i] / rate if s < INF else INF
