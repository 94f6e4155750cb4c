"""The simulated deployment: learner, workers, replay buffer, broadcast and scheduler as SimPy
processes, driven by the system's own pure policies.

Reused, not copied: the replay buffer and its staleness admission (`data.buffer.ReplayBuffer`),
peer scores and chain layout (`broadcast.plan`), the capacity model's mu_min (`control.capacity`),
the cheapest initial pool (`control.selection.exact`, as `echo2 plan` picks it) and the online
activation policy (`control.scheduler.Scheduler`). What is modelled here is only time:

- learner: waits until R admissible trajectories are buffered (the wait is the bubble), trains for
  T_train (times a jitter factor), advances its version, publishes every kappa steps;
- broadcast: the chunk schedule of `sim.broadcast.Transfer` over the planned chains or star; a
  worker installs when its last chunk arrives; a dropped relay is excised after the heartbeat
  timeout and its tail resumes from the new parent; a newer publication supersedes an unfinished
  one (workers that missed it take the newer snapshot);
- workers: generate rounds of `lease_groups` groups at mu_i (times slowdown and jitter) under the
  version installed when the round starts; with `keep_generating = false` they stop generating
  from publication until they install;
- scheduler: samples reported throughput every `interval_s`, marks silent workers lost after the
  heartbeat timeout, activates and releases; activated workers fetch the snapshot from storage.

The buffer holds one record per GRPO group (all samples of a group share a version, so admission is
the same as per trajectory). One `random.Random(seed)` drives every draw, so a seed fixes the run.
"""

from __future__ import annotations

import math
import random
import statistics

import simpy

from echo2.broadcast.plan import (
    ChainPlan,
    PeerInfo,
    build_chains,
    build_star,
    chain_broadcast_time,
    n_chains,
    star_broadcast_time,
)
from echo2.config import ConfigError
from echo2.control import capacity
from echo2.control.scheduler import Decision, Role, Scheduler, WorkerView
from echo2.control.selection import WorkerType, exact
from echo2.data.buffer import ReplayBuffer
from echo2.records import Trajectory
from echo2.sim.broadcast import Transfer
from echo2.sim.scenario import Scenario
from echo2.sim.state import (
    TARGET_QUANTILE,
    FaultRecord,
    Publication,
    SimWorker,
    StepRecord,
    lognormal_factor,
)


class Simulation:
    def __init__(self, scenario: Scenario, *, faults: bool = True) -> None:
        self.sc = sc = scenario
        self.env = simpy.Environment()
        self.rng = random.Random(sc.seed)
        self.kappa = sc.learner.publish_every
        self.group_size = sc.learner.group_size
        self.groups_per_step = sc.learner.batch // sc.learner.group_size
        self.size = sc.learner.snapshot_bytes
        self.uplink = sc.broadcast.uplink_mbps * 1e6 / 8
        self.buffer = ReplayBuffer(staleness=sc.learner.staleness, group_size=1)
        self.workers = {
            f"{spec.name}-{i}": SimWorker(id=f"{spec.name}-{i}", spec=spec)
            for spec in sc.workers
            for i in range(spec.count)
        }
        self.version = 0
        self.published = 0
        self.learner_versions: list[tuple[float, int]] = [(0.0, 0)]
        self.steps: list[StepRecord] = []
        self.published_at: list[tuple[int, float]] = []
        """(version, time) of every snapshot the learner published."""
        self.publications: list[Publication] = []
        """Every broadcast, with its install times."""
        self.faults: list[FaultRecord] = []
        self.decisions: list[dict] = []
        self.targets: list[tuple[float, float]] = []
        """(time, scheduler target in trajectories/s) at every scheduler run."""
        self.deliveries: list[tuple[float, int, int]] = []
        """(time, groups delivered, groups admitted) of every finished round."""
        self.lost_groups = 0
        """Groups in flight on a worker that dropped out or was released."""
        self.stalled = False
        self.end_time = 0.0
        self.initial_target: float | None = None
        self._data = self.env.event()
        self._published_evt = self.env.event()
        self._transfer: Transfer | None = None
        self._epoch = 0
        self._group_seq = 0
        self._train_times: list[float] = []
        self.scheduler = (
            Scheduler(sustain_s=sc.scheduler.sustain_s, release_margin=sc.scheduler.release_margin)
            if sc.scheduler.enabled and sc.scheduler.policy == "cost"
            else None
        )
        self._below_since: float | None = None  # random policy
        self._lost_seen: set[str] = set()
        self._target_cache: float | None = None
        self._initial_pool()
        pool_mu = sum(w.spec.throughput for w in self.workers.values()) or math.inf
        self.give_up_s = 20 * (
            self.kappa * sc.learner.t_train
            + self.broadcast_estimate(len(self.workers))
            + self.kappa * sc.learner.batch / pool_mu
        )
        """The learner gives up (the run is reported stalled) after waiting this long for a batch."""
        for w in self.workers.values():
            self.env.process(self._worker(w))
        self._learner_proc = self.env.process(self._learner())
        if sc.scheduler.enabled:
            self.env.process(self._scheduler_loop())
        if faults:
            for i, f in enumerate(sc.faults):
                self.env.process(self._fault(i, f))

    # ------------------------------------------------------------------ running
    def run(self) -> Simulation:
        try:
            self.env.run(until=self._learner_proc)
            # Let the last broadcast finish, so its T_bcast is measured (the learner is done).
            done = self.env.now
            while self._broadcasting() and self.env.now - done < self.give_up_s:
                self.env.step()
        except (RuntimeError, simpy.core.EmptySchedule):  # no events left: nothing can happen
            self.stalled = self.stalled or not self._learner_proc.triggered
        self.end_time = self.env.now
        for w in self.workers.values():
            for period in w.billed:
                period[1] = min(period[1], self.end_time)
        return self

    # ------------------------------------------------------------------ pool
    def broadcast_estimate(self, n: int) -> float:
        """T_bcast predicted by the planner's formulas for n receivers (offline calibration)."""
        if n <= 0 or not self.workers:
            return 0.0
        b = self.sc.broadcast
        bw = statistics.median(w.spec.down_bps for w in self.workers.values())
        if b.topology == "star":
            return star_broadcast_time(n, self.size, self.uplink, bw)
        n_ch = b.chains or n_chains(self.uplink, bw, n)
        return chain_broadcast_time(n, min(n_ch, n), self.size, b.chunk_bytes, bw, b.hop_delay_s)

    def _target_for(self, t_train: float, t_bcast: float) -> float:
        mu = capacity.mu_min(kappa=self.kappa, t_train=t_train, t_bcast=t_bcast, batch=self.sc.learner.batch)
        return math.inf if mu is None else self.sc.scheduler.gamma * mu

    def _initial_pool(self) -> None:
        """Without a scheduler every worker is active. With one, the run starts with the pool the
        policy picks for the target gamma * mu_min, T_bcast estimated for that pool's size."""
        sched = self.sc.scheduler
        if not sched.enabled:
            chosen = list(self.workers)
        else:
            n = len(self.workers)
            for _ in range(4):  # T_bcast depends on the pool size, the pool on T_bcast
                target = self._target_for(self.sc.learner.t_train, self.broadcast_estimate(n))
                chosen = self._pick(target)
                if len(chosen) == n:
                    break
                n = len(chosen)
            self.initial_target = target
        for wid in chosen:
            w = self.workers[wid]
            self._start_billing(w)
            w.installed = 0
            w.versions.append((0.0, 0))

    def _pick(self, target: float) -> list[str]:
        if math.isinf(target):
            return list(self.workers)
        if self.sc.scheduler.policy == "cost":
            types = [
                WorkerType(name=s.name, count=s.count, throughput=s.throughput, price=s.price)
                for s in self.sc.workers
            ]
            counts = exact(types, target).active
            return [f"{name}-{i}" for name, k in counts.items() for i in range(k)]
        order = list(self.workers)
        self.rng.shuffle(order)
        chosen, mu = [], 0.0
        for wid in order:
            if mu >= target:
                break
            chosen.append(wid)
            mu += self.workers[wid].spec.throughput
        return chosen

    def _start_billing(self, w: SimWorker) -> None:
        w.active = True
        w.billed.append([self.env.now, math.inf])

    def _stop_billing(self, w: SimWorker) -> None:
        w.active = False
        if w.billed and math.isinf(w.billed[-1][1]):
            w.billed[-1][1] = self.env.now

    # ------------------------------------------------------------------ learner
    def _learner(self):
        env, sc = self.env, self.sc
        for step in range(sc.steps):
            requested = env.now
            while not sc.learner.colocated and self.buffer.num_ready_groups() < self.groups_per_step:
                if env.now - requested > self.give_up_s:
                    self.stalled = True  # e.g. every worker lost, or records always stale
                    return
                if self._data.triggered:
                    self._data = env.event()
                yield self._data | env.timeout(self.give_up_s)
            wait = env.now - requested
            _, staleness = self.buffer.take(self.groups_per_step)
            train = sc.learner.t_train * lognormal_factor(self.rng, sc.learner.jitter)
            self._train_times.append(train)
            self._target_cache = None
            yield env.timeout(train)
            self.steps.append(
                StepRecord(step=step, requested=requested, wait=wait, train=train, staleness=staleness)
            )
            self.version += 1
            self.buffer.set_learner_version(self.version)
            self.learner_versions.append((env.now, self.version))
            if self.version % self.kappa == 0:
                self._publish(self.version)

    # ------------------------------------------------------------------ workers
    def _changed(self, w: SimWorker) -> simpy.Event:
        if w.changed is None or w.changed.triggered:
            w.changed = self.env.event()
        return w.changed

    def _poke(self, w: SimWorker) -> None:
        """Make a worker re-read its state (rate, pause, stop) now."""
        if w.changed is not None and not w.changed.triggered:
            w.changed.succeed()

    def _note_generating(self, w: SimWorker, on: bool) -> None:
        rate = w.mu if on else 0.0
        if not w.generating or w.generating[-1][1] != rate:
            w.generating.append((self.env.now, rate))

    def _worker(self, w: SimWorker):
        env, spec = self.env, w.spec
        size = self.sc.rollout.lease_groups * self.group_size  # trajectories per round
        while w.alive:
            # As the coordinator does, no lease for a worker whose version is already too old to be
            # admitted: it waits for the next snapshot.
            if not w.can_generate or w.installed < self.buffer.min_version():
                self._note_generating(w, False)
                yield self._changed(w)
                continue
            version = w.installed
            remaining = float(size)
            jitter = lognormal_factor(self.rng, spec.jitter)
            w.busy = True
            while remaining > 0 and w.alive and w.active:
                if w.paused:  # conservative mode: stop until the new snapshot is installed;
                    self._note_generating(w, False)  # the rest of the round then runs under it
                    yield self._changed(w)
                    version = w.installed
                    continue
                self._note_generating(w, True)
                rate = w.mu * jitter
                t = env.now
                done = env.timeout(remaining / rate)
                yield done | self._changed(w)
                remaining = 0.0 if done.processed else max(0.0, remaining - (env.now - t) * rate)
            w.busy = False
            if remaining > 0:  # stopped mid-round (dropped out or released): the round is lost
                self.lost_groups += self.sc.rollout.lease_groups
                continue
            self._deliver(w, version)

    def _deliver(self, w: SimWorker, version: int) -> None:
        records = []
        for _ in range(self.sc.rollout.lease_groups):
            self._group_seq += 1
            gid = f"g{self._group_seq}"
            records.append(
                Trajectory(
                    group_id=gid,
                    prompt_ids=(0,),
                    response_ids=(),
                    behaviour_logprobs=(),
                    loss_mask=(),
                    reward=0.0,
                    version=version,
                    record_id=gid,
                )
            )
        w.produced += len(records)
        admitted = self.buffer.add(records)
        self.deliveries.append((self.env.now, len(records), admitted))
        if not self._data.triggered:
            self._data.succeed()

    # ------------------------------------------------------------------ broadcast
    def _link_cap(self, sender: str | None, receiver: str) -> float:
        down = self.workers[receiver].spec.down_bps
        if sender is None:
            return down
        s = self.workers[sender]
        return min(s.spec.up_bps * s.link_factor, down)

    def current_plan(self, receivers: list[str]) -> ChainPlan:
        """The broadcast plan now: a star, or chains laid out by the planner from peer scores."""
        if self.sc.broadcast.topology == "star":
            return build_star(receivers)
        now = self.env.now
        bw = statistics.median(self.workers[w].spec.down_bps for w in receivers)
        n_ch = self.sc.broadcast.chains or n_chains(self.uplink, bw, len(receivers))
        peers = [
            PeerInfo(
                worker_id=w, score=self.workers[w].stats.score(now), inbound=self.workers[w].spec.inbound
            )
            for w in receivers
        ]
        return build_chains(peers, min(n_ch, len(receivers)))

    def _publish(self, version: int) -> None:
        self.published = version
        self.published_at.append((version, self.env.now))
        self._signal_publication()
        if not self._broadcasting():
            self._start_broadcast()
        # else: the newest snapshot goes out when the broadcast in flight ends (skipping versions)

    def _broadcasting(self) -> bool:
        tr = self._transfer
        if tr is None:
            return False
        version = self.publications[-1].version
        return any(self.workers[w].alive and self.workers[w].installed < version for w in tr.plan.workers())

    def _start_broadcast(self) -> None:
        now, version = self.env.now, self.published
        # Workers the coordinator believes active: one that dropped out unnoticed is still planned.
        receivers = [
            w.id
            for w in self.workers.values()
            if w.known_active and 0 <= w.installed < version and w.fetch is None
        ]
        if not receivers:
            self._transfer = None
            return
        plan = self.current_plan(receivers)
        published = dict(self.published_at)[version]
        self.publications.append(
            Publication(version=version, time=published, started=now, receivers=receivers, plan=plan)
        )
        if not self.sc.rollout.keep_generating:
            for wid in receivers:
                if self.workers[wid].alive:
                    self.workers[wid].paused = True
                    self._poke(self.workers[wid])
        b = self.sc.broadcast
        self._transfer = Transfer(
            plan=plan,
            size_bytes=self.size,
            chunk_bytes=b.chunk_bytes,
            hop_delay_s=b.hop_delay_s,
            uplink_bps=self.uplink,
            link_cap=self._link_cap,
            t0=now,
        )
        for wid in receivers:
            if not self.workers[wid].alive:
                self._transfer.drop(wid, now)
        self._schedule_installs()

    def _after_change(self) -> None:
        """Reschedule installs; when the broadcast is over and a newer snapshot waits, send it."""
        if self._broadcasting():
            self._schedule_installs()
        elif self.publications and self.published > self.publications[-1].version:
            self._start_broadcast()

    def _signal_publication(self) -> None:
        self._published_evt.succeed()
        self._published_evt = self.env.event()

    def _schedule_installs(self) -> None:
        self._epoch += 1
        tr = self._transfer
        if tr is None:
            return
        version = self.publications[-1].version
        for wid in tr.plan.workers():
            w = self.workers[wid]
            t = tr.install_time(wid)
            if w.alive and w.installed < version and t < math.inf:
                self.env.process(self._install_at(w, t, version, self._epoch))

    def _install_at(self, w: SimWorker, t: float, version: int, epoch: int):
        yield self.env.timeout(max(0.0, t - self.env.now))
        if epoch != self._epoch or not w.alive or w.installed >= version:
            return
        tr = self._transfer
        assert tr is not None
        sender = tr.links[w.id].sender
        if sender is not None:  # as the coordinator does: a transfer scores the peer that served it
            seconds = self.env.now - tr.first_byte(w.id)
            self.workers[sender].stats.record_transfer(int(self.size), seconds, self.env.now)
        self.publications[-1].installs[w.id] = self.env.now
        self._target_cache = None
        self._install(w, version)
        if not self._broadcasting():
            self._after_change()

    def _install(self, w: SimWorker, version: int) -> None:
        w.installed = version
        w.versions.append((self.env.now, version))
        if w.paused:
            w.paused = False
            self._poke(w)
        elif not w.busy:
            self._poke(w)

    def _fetch(self, w: SimWorker):
        """An activated worker boots and fetches the current snapshot from storage."""
        yield self.env.timeout(self.sc.scheduler.startup_s)
        while w.alive and w.active and w.installed < self.published:
            version = self.published
            storage = self.sc.broadcast.storage_mbps
            rate = storage * 1e6 / 8 if storage is not None else w.spec.down_bps
            yield self.env.timeout(self.size / rate)
            if w.alive and w.active:
                self._install(w, version)
        w.fetch = None

    def _leave_transfer(self, w: SimWorker, *, detected: bool) -> None:
        """A worker stopped: its chain child stalls; once detected, the chain is rebuilt."""
        tr = self._transfer
        if tr is None or not self._broadcasting() or w.id not in tr.plan.workers():
            return
        if not tr.links[w.id].dead:
            tr.drop(w.id, self.env.now)
        if detected:
            tr.reattach(w.id, self.env.now)
        self._after_change()

    # ------------------------------------------------------------------ scheduler
    def measured_t_bcast(self, q: float = TARGET_QUANTILE) -> float | None:
        alive = {w.id for w in self.workers.values() if w.alive}
        values = [t for p in self.publications if (t := p.t_bcast(q, alive)) is not None]
        return statistics.median(values) if values else None

    def _target(self) -> float:
        """gamma * mu_min from measured T_train and T_bcast (the offline estimates until then).
        Cached until a step ends, a worker installs, drops out or is activated."""
        if self._target_cache is None:
            t_train = statistics.median(self._train_times) if self._train_times else self.sc.learner.t_train
            t_bcast = self.measured_t_bcast()
            if t_bcast is None:
                n = sum(w.active and w.alive for w in self.workers.values())
                t_bcast = self.broadcast_estimate(n)
            self._target_cache = self._target_for(t_train, t_bcast)
        return self._target_cache

    def _report(self, w: SimWorker, now: float) -> float:
        """Windowed mean of the throughput a worker reported (its declared rate before any report)."""
        window = self.sc.scheduler.window_s
        if w.active and w.alive:  # heartbeats with the engine's current rate
            w.samples.append((now, w.mu))
            w.sample_sum += w.mu
        while w.samples and w.samples[0][0] < now - window:
            w.sample_sum -= w.samples.popleft()[1]
        return w.sample_sum / len(w.samples) if w.samples else w.mu

    def _scheduler_loop(self):
        interval = self.sc.scheduler.interval_s
        last: tuple | None = None
        while True:
            yield self.env.timeout(interval)
            now = self.env.now
            target = self._target()
            if not self.targets or self.targets[-1][1] != target:
                self.targets.append((now, target))
            state = tuple(
                (
                    w.id,
                    Role.LOST if w.lost else Role.ACTIVE if w.known_active else Role.STANDBY,
                    self._report(w, now),
                )
                for w in self.workers.values()
            )
            if not any(role is not Role.LOST for _, role, _ in state):
                self.stalled = True  # nobody left to produce or to activate
                return
            # The policy's answer only changes with its inputs, or while a deviation is sustained.
            pending = self.scheduler is None or self.scheduler.pending
            if (state, target) == last and not pending:
                continue
            last = (state, target)
            views = [
                WorkerView(worker_id=wid, throughput=mu, price=self.workers[wid].spec.price, role=role)
                for wid, role, mu in state
            ]
            if self.scheduler is not None:
                decisions = self.scheduler.decide(views, target=target, now=now)
            else:
                decisions = self._random_decide(views, target, now)
            for d in decisions:
                self._apply(d)
            if decisions:
                last = None

    def _random_decide(self, views: list[WorkerView], target: float, now: float) -> list[Decision]:
        """The w/o-Cost ablation: replace lost workers and fill a sustained shortfall with workers
        drawn uniformly at random; never release."""
        capacity_now = sum(v.throughput for v in views if v.role is Role.ACTIVE)
        newly_lost = [
            v.worker_id for v in views if v.role is Role.LOST and v.worker_id not in self._lost_seen
        ]
        self._lost_seen.update(newly_lost)
        if capacity_now >= target:
            self._below_since = None
            return []
        if self._below_since is None:
            self._below_since = now
        if not newly_lost and now - self._below_since < self.sc.scheduler.sustain_s:
            return []
        standby = sorted(v.worker_id for v in views if v.role is Role.STANDBY)
        self.rng.shuffle(standby)
        out = []
        for wid in standby:
            if capacity_now >= target:
                break
            capacity_now += self.workers[wid].mu
            out.append(Decision(action="activate", worker_id=wid, reason="random activation (w/o Cost)"))
        self._below_since = None if capacity_now >= target else now
        return out

    def _apply(self, d: Decision) -> None:
        w = self.workers[d.worker_id]
        self.decisions.append({"time": self.env.now, "action": d.action, "worker": w.id, "reason": d.reason})
        self._target_cache = None
        if d.action == "activate":
            self._start_billing(w)
            w.samples.clear()
            w.sample_sum = 0.0
            if w.fetch is None:
                w.fetch = self.env.process(self._fetch(w))
            self._poke(w)
        else:
            self._stop_billing(w)
            w.samples.clear()
            w.sample_sum = 0.0
            self._poke(w)
            self._leave_transfer(w, detected=True)

    # ------------------------------------------------------------------ faults
    def _pick_target(self, selector: str, index: int) -> str:
        if selector in self.workers:
            return selector
        if self._broadcasting():
            plan = self._transfer.plan
        else:
            plan = self.current_plan([w.id for w in self.workers.values() if w.active and w.alive])
        chains = [c for c in plan.chains if all(self.workers[w].alive for w in c)] or list(plan.chains)
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

    def _fault(self, index: int, spec):
        if spec.at_s is not None:
            yield self.env.timeout(spec.at_s)
        else:
            while len(self.published_at) < spec.publication:
                yield self._published_evt
            yield self.env.timeout(
                max(0.0, self.published_at[spec.publication - 1][1] + spec.offset_s - self.env.now)
            )
        w = self.workers[self._pick_target(spec.worker, index)]
        self.faults.append(
            FaultRecord(
                index=index,
                time=self.env.now,
                worker=w.id,
                kind=spec.kind,
                stage=spec.stage if spec.kind == "slow" else None,
                factor=spec.factor if spec.kind == "slow" else None,
            )
        )
        if not w.alive:
            return
        if spec.kind == "drop":
            w.dropped_at = self.env.now
            self._target_cache = None
            self._stop_billing(w)
            w.active = False
            self._poke(w)
            self._note_generating(w, False)
            self._leave_transfer(w, detected=False)
            self.env.process(self._detect(w))
        else:
            self._slow(w, spec.stage, spec.factor)
            if spec.duration_s is not None:
                yield self.env.timeout(spec.duration_s)
                self._slow(w, spec.stage, 1 / spec.factor)

    def _slow(self, w: SimWorker, stage: str, factor: float) -> None:
        if stage == "link":
            w.link_factor *= factor
            if self._broadcasting():
                assert self._transfer is not None
                self._transfer.recompute(self.env.now)
                self._after_change()
        else:
            w.rollout_factor *= factor
            w.factors.append((self.env.now, w.rollout_factor))
            if w.busy:
                self._poke(w)

    def _detect(self, w: SimWorker):
        """After the heartbeat timeout the coordinator marks the worker lost and rebuilds its chain."""
        yield self.env.timeout(self.sc.scheduler.heartbeat_timeout_s)
        w.lost = True
        self._target_cache = None
        w.stats.record_failure(self.env.now)
        self._leave_transfer(w, detected=True)


def simulate(scenario: Scenario, *, faults: bool = True) -> Simulation:
    """Run one scenario to its last learner step (or until nothing can produce any more)."""
    return Simulation(scenario, faults=faults).run()
