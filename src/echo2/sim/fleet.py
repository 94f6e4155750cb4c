"""The simulated fleet: which workers are rented and when, driven by the system's own policies.

- Initial pool: without a scheduler every worker is active; with one, the run starts with the pool
  the policy picks for the target gamma * mu_min (`planning.capacity.target_throughput`), T_bcast
  estimated for that pool's size. The "cost" policy picks as `echo2 plan` does
  (`fleet.selection.exact`); the "random" policy (the w/o-Cost ablation) draws workers uniformly.
- Scheduler loop: every `interval_s` it samples reported throughput, marks silent workers lost
  after the heartbeat timeout, asks the policy (`fleet.scheduler.Scheduler`, or
  `RandomActivation` for the ablation), and applies its activations and releases; activated
  workers fetch the snapshot from storage.
- Billing: the [start, end] of every active period of every worker.

Owns the target (cached until its inputs change), the decisions, billing and the ablation policy.
Knows nothing of how data are generated or snapshots sent: it reads T_train from the learner
(`t_train`), T_bcast from dissemination, and flips workers' `active` flag.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from echo2.fleet.scheduler import Action, Decision, Role, Scheduler, WorkerView
from echo2.fleet.selection import WorkerOffer, exact
from echo2.planning import capacity
from echo2.sim.dissemination import Dissemination
from echo2.sim.rollout import Rollout
from echo2.sim.state import SimWorker, World


class ActivationPolicy(Protocol):
    """What the scheduler loop asks; `fleet.scheduler.Scheduler` and `RandomActivation` implement it."""

    @property
    def pending(self) -> bool:
        """A deviation is being sustained: ask again even if nothing changed."""
        ...

    def decide(self, workers: list[WorkerView], *, target: float, now: float) -> list[Decision]: ...


class RandomActivation:
    """The w/o-Cost ablation: replace lost workers and fill a sustained shortfall with workers
    drawn uniformly at random; never release."""

    pending = True  # its answer depends on the time below target, so it is asked at every interval

    def __init__(self, world: World) -> None:
        self.world = world
        self._below_since: float | None = None
        self._lost_seen: set[str] = set()

    def decide(self, workers: list[WorkerView], *, target: float, now: float) -> list[Decision]:
        capacity_now = sum(v.throughput for v in workers if v.role is Role.ACTIVE)
        newly_lost = [
            v.worker_id for v in workers if v.role is Role.LOST and v.worker_id not in self._lost_seen
        ]
        self._lost_seen.update(newly_lost)
        if capacity_now >= target:
            self._below_since = None
            return []
        if self._below_since is None:
            self._below_since = now
        if not newly_lost and now - self._below_since < self.world.sc.scheduler.sustain_s:
            return []
        standby = sorted(v.worker_id for v in workers if v.role is Role.STANDBY)
        self.world.rng.shuffle(standby)
        out = []
        for wid in standby:
            if capacity_now >= target:
                break
            capacity_now += self.world.workers[wid].mu
            out.append(Decision(action=Action.ACTIVATE, worker_id=wid, reason="random activation (w/o Cost)"))
        self._below_since = None if capacity_now >= target else now
        return out


class Fleet:
    def __init__(
        self, world: World, dissemination: Dissemination, rollout: Rollout, *, t_train: Callable[[], float]
    ) -> None:
        """`t_train()`: the learner's T_train as measured so far."""
        self.world = world
        self.dissemination = dissemination
        self.rollout = rollout
        self._t_train = t_train
        sched = world.sc.scheduler
        self.policy: ActivationPolicy = (
            Scheduler(sustain_s=sched.sustain_s, release_margin=sched.release_margin)
            if sched.policy == "cost"
            else RandomActivation(world)
        )
        self.decisions: list[dict] = []
        self.targets: list[tuple[float, float]] = []
        """(time, scheduler target in trajectories/s) at every scheduler run."""
        self.initial_target: float | None = None
        self.stalled = False
        """Every worker was lost: nobody left to produce or to activate."""
        self._target_cache: float | None = None

    # ------------------------------------------------------------------ pool and billing
    def start_initial_pool(self) -> None:
        """Bill and hand version 0 to the workers the run starts with."""
        if not self.world.sc.scheduler.enabled:
            chosen = list(self.world.workers)
        else:
            n = len(self.world.workers)
            for _ in range(4):  # T_bcast depends on the pool size, the pool on T_bcast
                target = self._target_for(self.world.sc.learner.t_train, self.dissemination.estimate(n))
                chosen = self._pick(target)
                if len(chosen) == n:
                    break
                n = len(chosen)
            self.initial_target = target
        for wid in chosen:
            w = self.world.workers[wid]
            self._start_billing(w)
            w.installed = 0
            w.versions.append((0.0, 0))

    def _pick(self, target: float) -> list[str]:
        if math.isinf(target):
            return list(self.world.workers)
        if self.world.sc.scheduler.policy == "cost":
            types = [
                WorkerOffer(name=s.name, count=s.count, throughput=s.throughput, price=s.price)
                for s in self.world.sc.workers
            ]
            counts = exact(types, target).active
            return [f"{name}-{i}" for name, k in counts.items() for i in range(k)]
        order = list(self.world.workers)
        self.world.rng.shuffle(order)
        chosen, mu = [], 0.0
        for wid in order:
            if mu >= target:
                break
            chosen.append(wid)
            mu += self.world.workers[wid].spec.throughput
        return chosen

    def _start_billing(self, w: SimWorker) -> None:
        w.active = True
        w.billed.append([self.world.env.now, math.inf])

    def stop_billing(self, w: SimWorker) -> None:
        w.active = False
        if w.billed and math.isinf(w.billed[-1][1]):
            w.billed[-1][1] = self.world.env.now

    def close_billing(self, end: float) -> None:
        """The run ended: periods still open end now."""
        for w in self.world.workers.values():
            for period in w.billed:
                period[1] = min(period[1], end)

    # ------------------------------------------------------------------ target
    def _target_for(self, t_train: float, t_bcast: float) -> float:
        sc = self.world.sc
        return capacity.target_throughput(
            kappa=self.world.kappa,
            staleness=sc.learner.staleness,
            model=sc.capacity_model,
            t_train=t_train,
            t_bcast=t_bcast,
            batch=sc.learner.batch,
            gamma=sc.scheduler.gamma,
        )

    def invalidate_target(self) -> None:
        """An input of the target changed: a step ended, a worker installed, dropped out or was
        activated."""
        self._target_cache = None

    def target(self) -> float:
        """gamma * mu_min from measured T_train and T_bcast (the offline estimates until then)."""
        if self._target_cache is None:
            t_bcast = self.dissemination.measured_t_bcast()
            if t_bcast is None:
                n = sum(w.active and w.alive for w in self.world.workers.values())
                t_bcast = self.dissemination.estimate(n)
            self._target_cache = self._target_for(self._t_train(), t_bcast)
        return self._target_cache

    # ------------------------------------------------------------------ scheduler loop
    def _report(self, w: SimWorker, now: float) -> float:
        """Windowed mean of the throughput a worker reported (its declared rate before any report)."""
        window = self.world.sc.scheduler.window_s
        if w.active and w.alive:  # heartbeats with the engine's current rate
            w.samples.append((now, w.mu))
            w.sample_sum += w.mu
        while w.samples and w.samples[0][0] < now - window:
            w.sample_sum -= w.samples.popleft()[1]
        return w.sample_sum / len(w.samples) if w.samples else w.mu

    def run(self):
        env, workers = self.world.env, self.world.workers
        last: tuple | None = None
        while True:
            yield env.timeout(self.world.sc.scheduler.interval_s)
            now = env.now
            target = self.target()
            if not self.targets or self.targets[-1][1] != target:
                self.targets.append((now, target))
            state = tuple(
                (
                    w.id,
                    Role.LOST if w.lost else Role.ACTIVE if w.known_active else Role.STANDBY,
                    self._report(w, now),
                )
                for w in workers.values()
            )
            if not any(role is not Role.LOST for _, role, _ in state):
                self.stalled = True
                return
            # The policy's answer only changes with its inputs, or while a deviation is sustained.
            if (state, target) == last and not self.policy.pending:
                continue
            last = (state, target)
            views = [
                WorkerView(worker_id=wid, throughput=mu, price=workers[wid].spec.price, role=role)
                for wid, role, mu in state
            ]
            decisions = self.policy.decide(views, target=target, now=now)
            for d in decisions:
                self._apply(d)
            if decisions:
                last = None

    def _apply(self, d: Decision) -> None:
        w = self.world.workers[d.worker_id]
        self.decisions.append(
            {"time": self.world.env.now, "action": d.action, "worker": w.id, "reason": d.reason}
        )
        self.invalidate_target()
        if d.action is Action.ACTIVATE:
            self._start_billing(w)
            self._forget_reports(w)
            self.dissemination.fetch(w)
            self.rollout.poke(w)
        else:
            self.stop_billing(w)
            self._forget_reports(w)
            self.rollout.poke(w)
            self.dissemination.leave(w, detected=True)

    @staticmethod
    def _forget_reports(w: SimWorker) -> None:
        w.samples.clear()
        w.sample_sum = 0.0
