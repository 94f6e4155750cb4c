"""Injected faults: a worker drops out, or its link or its rollout slows (for a while or for good),
at a fixed time or some seconds after the n-th publication.

A fault names a worker, or a role resolved at fault time from the broadcast plan ("forwarder": the
seed of a chain with a child; "tail": the tail of the longest chain). A dropped worker stops at
once. A relay's chain child notices first, as the runtime client does: it reads nothing for
`broadcast.progress_timeout_s`, reports its parent failed, and the coordinator excises the parent
and routes the child to the parent's own parent (broadcast/tracker.py `failure`). The coordinator
marks the worker lost, for the scheduler, only after the heartbeat timeout.

Owns the fault records and the detection delay. Knows nothing of how chains are scheduled, rounds
generated or workers billed: it changes a worker's state and tells dissemination, rollout and the
fleet.
"""

from __future__ import annotations

from echo2.config import ConfigError
from echo2.sim.dissemination import Dissemination
from echo2.sim.fleet import Fleet
from echo2.sim.rollout import Rollout
from echo2.sim.scenario import FaultSpec
from echo2.sim.state import FaultRecord, SimWorker, World


class FaultInjector:
    def __init__(self, world: World, dissemination: Dissemination, rollout: Rollout, fleet: Fleet) -> None:
        self.world = world
        self.dissemination = dissemination
        self.rollout = rollout
        self.fleet = fleet
        self.records: list[FaultRecord] = []
        self._reported: set[str] = set()
        """Dropped relays their child has reported (and scored) already."""

    def start(self) -> None:
        for i, f in enumerate(self.world.sc.faults):
            self.world.env.process(self._fault(i, f))

    def _pick_target(self, selector: str, index: int) -> str:
        if selector in self.world.workers:
            return selector
        workers = self.world.workers
        plan = self.dissemination.plan_now()
        chains = [c for c in plan.chains if all(workers[w].alive for w in c)] or list(plan.chains)
        if selector == "forwarder":
            with_child = [c for c in chains if len(c) > 1]
            if not with_child:
                raise ConfigError(  # a scenario mistake (exit 2), not a stall
                    f"faults.{index}.worker: 'forwarder', but no chain has a child at fault time "
                    "(with an unlimited broadcast.uplink_mbps every worker is a seed)"
                )
            return with_child[0][0]
        longest = max(len(c) for c in chains)
        return next(c for c in chains if len(c) == longest)[-1]

    def _fault(self, index: int, spec: FaultSpec):
        env, published_at = self.world.env, self.dissemination.published_at
        if spec.at_s is not None:
            yield env.timeout(spec.at_s)
        else:
            while len(published_at) < spec.publication:
                yield self.dissemination.next_publication()
            yield env.timeout(max(0.0, published_at[spec.publication - 1][1] + spec.offset_s - env.now))
        w = self.world.workers[self._pick_target(spec.worker, index)]
        self.records.append(
            FaultRecord(
                index=index,
                time=env.now,
                worker=w.id,
                kind=spec.kind,
                stage=spec.stage if spec.kind == "slow" else None,
                factor=spec.factor if spec.kind == "slow" else None,
            )
        )
        if not w.alive:
            return
        if spec.kind == "drop":
            w.dropped_at = env.now
            self.fleet.invalidate_target()
            self.fleet.stop_billing(w)  # no longer active
            self.rollout.poke(w)
            self.rollout.note_generating(w, False)
            self.dissemination.leave(w, detected=False)
            env.process(self._child_reports(w))
            env.process(self._detect(w))
        else:
            self._slow(w, spec.stage, spec.factor)
            if spec.duration_s is not None:
                yield env.timeout(spec.duration_s)
                self._slow(w, spec.stage, 1 / spec.factor)

    def _slow(self, w: SimWorker, stage: str, factor: float) -> None:
        if stage == "link":
            w.link_factor *= factor
            self.dissemination.link_changed()
        else:
            w.rollout_factor *= factor
            w.factors.append((self.world.env.now, w.rollout_factor))
            if w.busy:
                self.rollout.poke(w)

    def _child_reports(self, w: SimWorker):
        """A dropped relay's child reads nothing for the progress timeout (the socket read timeout
        of rollout/broadcast_client.py), reports its parent failed, and is routed around it."""
        sc = self.world.sc
        yield self.world.env.timeout(min(sc.broadcast.progress_timeout_s, sc.scheduler.heartbeat_timeout_s))
        if not w.lost and self.dissemination.feeds_someone(w):
            w.stats.record_failure(self.world.env.now)  # scored once: here, or else at its loss
            self._reported.add(w.id)
            self.dissemination.leave(w, detected=True)

    def _detect(self, w: SimWorker):
        """After the heartbeat timeout the coordinator marks the worker lost and rebuilds its chain."""
        yield self.world.env.timeout(self.world.sc.scheduler.heartbeat_timeout_s)
        w.lost = True
        self.fleet.invalidate_target()
        if w.id not in self._reported:  # its child's report scored it already
            w.stats.record_failure(self.world.env.now)
        self.dissemination.leave(w, detected=True)
