"""Simulated snapshot dissemination: the chunk schedule of `sim.broadcast.Transfer` over the plan
the runtime would make (`broadcast.plan.plan_broadcast`, from peer scores), and storage downloads
for workers activated later.

A worker installs when its last chunk arrives; a dropped relay is excised after the heartbeat
timeout and its tail resumes from the new parent; a newer publication supersedes an unfinished one
(workers that missed it take the newer snapshot). A finished transfer scores the peer that served
it, as the coordinator does.

Owns the publications (what was published when, every broadcast with its plan and install times),
the transfer in flight and T_bcast as measured. Knows nothing of the learner's loop (it is told
`publish(version)`), of generation (it calls rollout's `install` and `pause`), or of the scheduler
(`on_install` says T_bcast inputs changed).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import simpy

from echo2.broadcast.plan import ChainPlan, PeerInfo, broadcast_time, plan_broadcast
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
            size_bytes=self.world.snapshot_bytes,
            chunk_bytes=b.chunk_bytes,
            uplink_bps=self.world.uplink_bps,
            worker_bps=statistics.median(w.spec.down_bps for w in workers.values()),
            hop_delay_s=b.hop_delay_s,
            n_ch=b.chains,
        )

    def plan(self, receivers: list[str]) -> ChainPlan:
        """The broadcast plan now: a star, or chains laid out by the planner from peer scores."""
        now, workers = self.world.env.now, self.world.workers
        bw = statistics.median(workers[w].spec.down_bps for w in receivers)
        peers = [
            PeerInfo(worker_id=w, score=workers[w].stats.score(now, bw), inbound=workers[w].spec.inbound)
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
        if not receivers:
            self._transfer = None
            return
        plan = self.plan(receivers)
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
            size_bytes=self.world.snapshot_bytes,
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
            self.world.workers[sender].stats.record_transfer(int(self.world.snapshot_bytes), seconds, env.now)
        self.publications[-1].installs[w.id] = env.now
        self._on_install()
        self.rollout.install(w, version)
        if not self.broadcasting():
            self._after_change()

    def fetch(self, w: SimWorker) -> None:
        """An activated worker boots and fetches the current snapshot from storage (once at a time)."""
        if w.fetch is None:
            w.fetch = self.world.env.process(self._fetch(w))

    def _fetch(self, w: SimWorker):
        env, sc = self.world.env, self.world.sc
        yield env.timeout(sc.scheduler.startup_s)
        while w.alive and w.active and w.installed < self.published:
            version = self.published
            storage = sc.broadcast.storage_mbps
            rate = storage * 1e6 / 8 if storage is not None else w.spec.down_bps
            yield env.timeout(self.world.snapshot_bytes / rate)
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

    def link_changed(self) -> None:
        """A worker's upload rate changed: reschedule the transfer in flight from now."""
        if self.broadcasting():
            assert self._transfer is not None
            self._transfer.recompute(self.world.env.now)
            self._after_change()
