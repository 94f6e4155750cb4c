"""The simulated deployment: one SimPy process group per process group of the system, composed.

- `sim.learner`: waits for a batch (the bubble), trains, advances, publishes every kappa steps;
- `sim.rollout`: workers generating rounds under their installed version, delivering to the buffer;
- `sim.dissemination`: chunked broadcast over the planned chains or star, storage downloads;
- `sim.fleet`: the initial pool, the scheduler loop and its policy, billing;
- `sim.faults`: drops and slowdowns, and their detection.

Reused, not copied: the replay buffer and its staleness admission (`data.buffer.ReplayBuffer`),
peer scores and the chain plan (`broadcast.plan`), the target gamma * mu_min
(`planning.capacity.target_throughput`), the cheapest initial pool (`fleet.selection.exact`, as
`echo2 plan` picks it) and the online activation policy (`fleet.scheduler.Scheduler`). What is
modelled here is only time. This module wires the groups together, starts their processes in a
fixed order (the order of random draws is part of the model, so a seed fixes the run) and exposes
what a finished run recorded to `sim.report`; it knows no policy itself.
"""

from __future__ import annotations

import math
import random

import simpy

from echo2.data.buffer import ReplayBuffer
from echo2.sim.dissemination import Dissemination
from echo2.sim.faults import FaultInjector
from echo2.sim.fleet import Fleet
from echo2.sim.learner import Learner
from echo2.sim.rollout import Rollout
from echo2.sim.scenario import Scenario
from echo2.sim.state import SimWorker, World


class Simulation:
    def __init__(self, scenario: Scenario, *, faults: bool = True) -> None:
        self.sc = sc = scenario
        self.world = world = World(
            sc=sc,
            env=simpy.Environment(),
            rng=random.Random(sc.seed),
            workers={
                f"{spec.name}-{i}": SimWorker(id=f"{spec.name}-{i}", spec=spec)
                for spec in sc.workers
                for i in range(spec.count)
            },
            buffer=ReplayBuffer(staleness=sc.learner.staleness, group_size=1),
        )
        self.env, self.workers, self.buffer, self.kappa = world.env, world.workers, world.buffer, world.kappa
        # Back edges (data wake the learner; installs and steps change the target) are late-bound.
        self.rollout = Rollout(world, on_delivered=lambda: self.learner.data_arrived())
        self.dissemination = Dissemination(
            world, self.rollout, on_install=lambda: self.fleet.invalidate_target()
        )
        self.fleet = Fleet(world, self.dissemination, self.rollout, t_train=lambda: self.learner.t_train())
        self.fleet.start_initial_pool()
        pool_mu = sum(w.spec.throughput for w in self.workers.values()) or math.inf
        self.give_up_s = 20 * (
            self.kappa * sc.learner.t_train
            + self.broadcast_estimate(len(self.workers))
            + self.kappa * sc.learner.batch / pool_mu
        )
        """The learner gives up (the run is reported stalled) after waiting this long for a batch."""
        self.learner = Learner(
            world,
            give_up_s=self.give_up_s,
            publish=self.dissemination.publish,
            on_step=self.fleet.invalidate_target,
        )
        self.injector = FaultInjector(world, self.dissemination, self.rollout, self.fleet)
        self.rollout.start()
        self._learner_proc = self.env.process(self.learner.run())
        if sc.scheduler.enabled:
            self.env.process(self.fleet.run())
        if faults:
            self.injector.start()
        self._ran_dry = False
        self.end_time = 0.0
        # What a finished run recorded, as `sim.report` reads it.
        self.steps = self.learner.steps
        self.published_at = self.dissemination.published_at
        self.publications = self.dissemination.publications
        self.deliveries = self.rollout.deliveries
        self.decisions = self.fleet.decisions
        self.targets = self.fleet.targets
        self.faults = self.injector.records

    def run(self) -> Simulation:
        try:
            self.env.run(until=self._learner_proc)
            # Let the last broadcast finish, so its T_bcast is measured (the learner is done).
            done = self.env.now
            while self.dissemination.broadcasting() and self.env.now - done < self.give_up_s:
                self.env.step()
        except (RuntimeError, simpy.core.EmptySchedule):  # no events left: nothing can happen
            self._ran_dry = not self._learner_proc.triggered
        self.end_time = self.env.now
        self.fleet.close_billing(self.end_time)
        return self

    @property
    def stalled(self) -> bool:
        """The learner could not finish: it gave up waiting, every worker was lost, or no event
        was left to run."""
        return self.learner.stalled or self.fleet.stalled or self._ran_dry

    @property
    def lost_groups(self) -> int:
        return self.rollout.lost_groups

    def broadcast_estimate(self, n: int) -> float:
        """T_bcast predicted by the planner's formulas for n receivers (offline calibration)."""
        return self.dissemination.estimate(n)


def simulate(scenario: Scenario, *, faults: bool = True) -> Simulation:
    """Run one scenario to its last learner step (or until nothing can produce any more)."""
    return Simulation(scenario, faults=faults).run()
