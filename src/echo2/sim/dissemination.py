"""Simulated snapshot dissemination: the chunk schedule of `sim.broadcast.Transfer` over the plan
the runtime would make (`broadcast.plan.plan_broadcast`, from peer scores), and storage downloads
for workers activated later.

A worker installs when its last chunk arrives; a dropped relay is excised after the heartbeat
timeout and its tail resumes from the new parent; a newer publication supersedes an unfinished one
(workers that missed it take the newer snapshot). A finished transfer scores the peer that served
it, as the coordinator does. A relay whose upload falls below the relay floor (a fraction of the
peers' measured relay rate, `broadcast.plan.relay_floor`) is reported slow by its child once the
child's sliding window of `broadcast.progress_timeout_s` averages below the floor, as the runtime
client judges it: the relay leaves the plan, its tail moves behind another chain's free tail
(`ChainPlan.demote`), and it is only a tail in the next plan, as the coordinator does
(broadcast/tracker.py). With `broadcast.delta` the chains carry each publication's delta
(`planning.capacity.publication_bytes`) to workers holding the previous published version; a worker
further behind downloads the full snapshot directly, at its storage or download rate (the learner's
uplink share is not modelled for it), and is not a receiver of that publication's T_bcast.

Owns the publications (what was published when, every broadcast with its plan and install times),
the transfer in flight and T_bcast as measured. Knows nothing of the learner's loop (it is told
`publish(version)`), of generation (it calls rollout's `install` and `pause`), or of the scheduler
(`on_install` says T_bcast inputs changed).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable

import simpy

from echo2.broadcast.plan import (
    PEER_RATE_SAMPLES,
    ChainPlan,
    PeerInfo,
    broadcast_time,
    plan_broadcast,
    relay_floor,
)
from echo2.sim.broadcast import Transfer
from echo2.sim.rollout import Rollout
from echo2.sim.state import TARGET_QUANTILE, Publication, SimWorker, World


class Dissemination:
    def __init__(self, world: World, rollout: Rollout, *, on_install: Callable[[], None]) -> None:
        self.world = world
        self.rollout = rollout
        b = world.sc.broadcast
        self.mode = "star" if b.topology == "star" else "chain"
        self.published = 0
        """The newest version the learner published."""
        self.published_at: list[tuple[int, float]] = []
        """(version, time) of every snapshot the learner published."""
        self.publications: list[Publication] = []
        """Every broadcast, with its install times."""
        self._on_install = on_install
        self._published_evt: simpy.Event = world.env.event()
        self._transfer: Transfer | None = None
        self._epoch = 0
        self.relay_rates: deque[float] = deque(maxlen=20)
        """Rates of the last transfers a relay served (the coordinator's peers' rate)."""
        self._watched: set[tuple[str, str]] = set()
        """(receiver, relay) links of the broadcast in flight checked against the relay floor."""
        self._slow_reported: set[str] = set()
        """Receivers that reported a relay slow in the broadcast in flight (one each)."""
        self._size = world.snapshot_bytes
        """Bytes each receiver of the broadcast in flight gets (the snapshot, or its delta)."""

    # ------------------------------------------------------------------ planning
    def estimate(self, n: int) -> float:
        """T_bcast predicted by the planner's formulas for n receivers (offline calibration)."""
        workers = self.world.workers
        if n <= 0 or not workers:
            return 0.0
        b = self.world.sc.broadcast
        return broadcast_time(
            n,
            mode=self.mode,
            size_bytes=self.world.publication_bytes(1),  # steady state: all hold the previous one
            chunk_bytes=b.chunk_bytes,
            uplink_bps=self.world.uplink_bps,
            worker_bps=statistics.median(w.spec.down_bps for w in workers.values()),
            hop_delay_s=b.hop_delay_s,
            n_ch=b.chains,
        )

    def peer_bps(self) -> float | None:
        """The peers' measured relay rate, as the coordinator's (None until enough transfers)."""
        return statistics.median(self.relay_rates) if len(self.relay_rates) >= PEER_RATE_SAMPLES else None

    def plan(self, receivers: list[str]) -> ChainPlan:
        """The broadcast plan now: a star, or chains laid out by the planner from peer scores
        (Speed against the peers' rate; demoted or repeatedly failed relays only at tails)."""
        now, workers = self.world.env.now, self.world.workers
        bw = statistics.median(workers[w].spec.down_bps for w in receivers)
        reference = self.peer_bps() or bw
        peers = [
            PeerInfo(
                worker_id=w,
                score=workers[w].stats.score(now, reference),
                inbound=workers[w].spec.inbound and workers[w].stats.may_relay(),
            )
            for w in receivers
        ]
        return plan_broadcast(
            peers,
            mode=self.mode,
            uplink_bps=self.world.uplink_bps,
            worker_bps=bw,
            n_ch=self.world.sc.broadcast.chains,
        )

    def plan_now(self) -> ChainPlan:
        """The plan in flight, else the one a broadcast would use now (active, alive workers)."""
        if self.broadcasting():
            assert self._transfer is not None
            return self._transfer.plan
        return self.plan([w.id for w in self.world.workers.values() if w.active and w.alive])

    def behind(self, w: SimWorker, version: int) -> int | None:
        """Publications between `w`'s installed version and `version` (None: nothing installed)."""
        if w.installed < 0:
            return None
        return sum(1 for v, _ in self.published_at if w.installed < v <= version)

    def measured_t_bcast(self, q: float = TARGET_QUANTILE) -> float | None:
        alive = {w.id for w in self.world.workers.values() if w.alive}
        values = [t for p in self.publications if (t := p.t_bcast(q, alive)) is not None]
        return statistics.median(values) if values else None

    # ------------------------------------------------------------------ publication
    def publish(self, version: int) -> None:
        self.published = version
        self.published_at.append((version, self.world.env.now))
        self._published_evt.succeed()
        self._published_evt = self.world.env.event()
        if not self.broadcasting():
            self._start_broadcast()
        # else: the newest snapshot goes out when the broadcast in flight ends (skipping versions)

    def next_publication(self) -> simpy.Event:
        """Triggered at the next publication."""
        return self._published_evt

    def broadcasting(self) -> bool:
        tr = self._transfer
        if tr is None:
            return False
        workers, version = self.world.workers, self.publications[-1].version
        return any(workers[w].alive and workers[w].installed < version for w in tr.plan.workers())

    def _link_cap(self, sender: str | None, receiver: str) -> float:
        down = self.world.workers[receiver].spec.down_bps
        if sender is None:
            return down
        s = self.world.workers[sender]
        return min(s.spec.up_bps * s.link_factor, down)

    def _start_broadcast(self) -> None:
        now, version, workers = self.world.env.now, self.published, self.world.workers
        # Workers the coordinator believes active: one that dropped out unnoticed is still planned.
        receivers = [
            w.id
            for w in workers.values()
            if w.known_active and 0 <= w.installed < version and w.fetch is None
        ]
        self._size = self.world.snapshot_bytes
        delta = self.world.publication_bytes(1)
        if delta < self._size:  # the chains carry the delta; a worker too far behind for it (or
            # new) downloads the full snapshot directly, out of the chains, as the runtime's does
            full = [
                wid
                for wid in receivers
                if self.world.publication_bytes(self.behind(workers[wid], version)) > delta
            ]
            for wid in full:
                self.fetch(workers[wid], boot=False)
            receivers, self._size = [wid for wid in receivers if wid not in full], delta
        if not receivers:
            self._transfer = None
            return
        plan = self.plan(receivers)
        for wid in receivers:  # a demoted relay has sat out this plan as a tail
            workers[wid].stats.demoted = False
        self._watched.clear()
        self._slow_reported.clear()
        published = dict(self.published_at)[version]
        self.publications.append(
            Publication(version=version, time=published, started=now, receivers=receivers, plan=plan)
        )
        if not self.world.sc.rollout.keep_generating:
            for wid in receivers:
                if workers[wid].alive:
                    self.rollout.pause(workers[wid])
        b = self.world.sc.broadcast
        self._transfer = Transfer(
            plan=plan,
            size_bytes=self._size,
            chunk_bytes=b.chunk_bytes,
            hop_delay_s=b.hop_delay_s,
            uplink_bps=self.world.uplink_bps,
            link_cap=self._link_cap,
            t0=now,
        )
        for wid in receivers:
            if not workers[wid].alive:
                self._transfer.drop(wid, now)
        self._schedule_installs()

    def _after_change(self) -> None:
        """Reschedule installs; when the broadcast is over and a newer snapshot waits, send it."""
        if self.broadcasting():
            self._schedule_installs()
        elif self.publications and self.published > self.publications[-1].version:
            self._start_broadcast()

    # ------------------------------------------------------------------ installs
    def _schedule_installs(self) -> None:
        self._epoch += 1
        tr = self._transfer
        if tr is None:
            return
        version = self.publications[-1].version
        for wid in tr.plan.workers():
            w = self.world.workers[wid]
            t = tr.install_time(wid)
            if w.alive and w.installed < version and t < math.inf:
                self.world.env.process(self._install_at(w, t, version, self._epoch))
        self._watch_slow(tr)

    # ------------------------------------------------------------------ slow relays
    def _slow_link(self, tr: Transfer, receiver: str) -> str | None:
        """The relay feeding `receiver` if its upload is below the relay floor (None otherwise).
        The receiver measures its parent's upload, not its own download cap (the runtime client
        does not count the time its own download bucket takes)."""
        floor = relay_floor(self.peer_bps(), self.world.sc.broadcast.slow_relay_fraction)
        link, w = tr.links[receiver], self.world.workers[receiver]
        if floor is None or self.mode != "chain" or link.sender is None or link.dead or link.orphaned:
            return None
        if not w.alive or receiver in self._slow_reported or tr.install_time(receiver) <= self.world.env.now:
            return None
        s = self.world.workers[link.sender]
        up = s.spec.up_bps * s.link_factor
        return link.sender if up < floor and up < w.spec.down_bps else None

    def _watch_slow(self, tr: Transfer, prior: dict[str, tuple[str | None, float]] | None = None) -> None:
        """Schedule the slow report of every link now below the relay floor. The receiver judges
        the last progress timeout W of reading (meter.py's `RelayMeter`): a link that fell from R0 to
        R1 (`prior`: sender and rate before the change) is caught W (R0 - F) / (R0 - R1) later, one
        slow from its start after W."""
        window = self.world.sc.broadcast.progress_timeout_s
        floor = relay_floor(self.peer_bps(), self.world.sc.broadcast.slow_relay_fraction)
        for receiver in tr.plan.workers():
            sender = self._slow_link(tr, receiver)
            if sender is None or floor is None or (receiver, sender) in self._watched:
                continue
            delay = window
            before, rate = (prior or {}).get(receiver, (None, 0.0)), tr.links[receiver].rate
            if before[0] == sender and before[1] > floor > rate:
                delay = window * (before[1] - floor) / (before[1] - rate)
            self._watched.add((receiver, sender))
            self.world.env.process(self._report_slow(tr, receiver, sender, delay))

    def _report_slow(self, tr: Transfer, receiver: str, sender: str, delay: float):
        """After `delay` the receiver reports its relay slow, if it still is."""
        env = self.world.env
        yield env.timeout(delay)
        self._watched.discard((receiver, sender))
        if self._transfer is not tr or self._slow_link(tr, receiver) != sender:
            if self._transfer is tr:
                self._watch_slow(tr)  # a new parent may be slow too
            return
        self._slow_reported.add(receiver)
        self.world.workers[sender].stats.record_slow(env.now)
        self.publications[-1].demoted.append((env.now, sender))
        workers = self.world.workers
        open_tails = {
            c[-1]
            for c in tr.plan.chains
            if workers[c[-1]].alive and workers[c[-1]].spec.inbound and workers[c[-1]].stats.may_relay()
        }
        tr.demote(sender, env.now, open_tails)
        self._after_change()

    def _install_at(self, w: SimWorker, t: float, version: int, epoch: int):
        env = self.world.env
        yield env.timeout(max(0.0, t - env.now))
        if epoch != self._epoch or not w.alive or w.installed >= version:
            return
        tr = self._transfer
        assert tr is not None
        sender = tr.links[w.id].sender
        if sender is not None:  # as the coordinator does: a transfer scores the peer that served it
            seconds = env.now - tr.first_byte(w.id)
            self.world.workers[sender].stats.record_transfer(int(self._size), seconds, env.now)
            if seconds > 0:
                self.relay_rates.append(self._size / seconds)
        self.publications[-1].installs[w.id] = env.now
        self._on_install()
        self.rollout.install(w, version)
        if not self.broadcasting():
            self._after_change()

    def fetch(self, w: SimWorker, *, boot: bool = True) -> None:
        """An activated worker boots and fetches the current snapshot from storage (once at a time);
        with deltas, a receiver too far behind for the delta fetches it so too (`boot=False`)."""
        if w.fetch is None:
            w.fetch = self.world.env.process(self._fetch(w, boot))

    def _fetch(self, w: SimWorker, boot: bool):
        env, sc = self.world.env, self.world.sc
        if boot:
            yield env.timeout(sc.scheduler.startup_s)
        while w.alive and w.active and w.installed < self.published:
            version = self.published
            storage = sc.broadcast.storage_mbps
            rate = storage * 1e6 / 8 if storage is not None else w.spec.down_bps
            yield env.timeout(self.world.publication_bytes(self.behind(w, version)) / rate)
            if w.alive and w.active:
                self.rollout.install(w, version)
        w.fetch = None

    # ------------------------------------------------------------------ changes
    def leave(self, w: SimWorker, *, detected: bool) -> None:
        """A worker stopped: its chain child stalls; once detected, the chain is rebuilt."""
        tr = self._transfer
        if tr is None or not self.broadcasting() or w.id not in tr.plan.workers():
            return
        if not tr.links[w.id].dead:
            tr.drop(w.id, self.world.env.now)
        if detected:
            tr.reattach(w.id, self.world.env.now)
        self._after_change()

    def feeds_someone(self, w: SimWorker) -> bool:
        """`w` is still the sender of a receiver in the broadcast in flight."""
        tr = self._transfer
        return tr is not None and self.broadcasting() and bool(tr.children(w.id))

    def link_changed(self) -> None:
        """A worker's upload rate changed: reschedule the transfer in flight from now."""
        if self.broadcasting():
            tr = self._transfer
            assert tr is not None
            prior = {w: (link.sender, link.rate) for w, link in tr.links.items()}
            tr.recompute(self.world.env.now)
            self._watch_slow(tr, prior)
            self._after_change()
