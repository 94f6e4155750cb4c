"""The simulated learner: one SimPy process that waits until R admissible trajectories are buffered
(the wait is the bubble), trains for T_train (times a jitter factor), advances its version and
publishes every kappa steps.

Owns the learner's version, its step records, the train times it measured and the event that
wakes it when data arrive. Knows nothing of workers, chains or the scheduler: rollout calls
`data_arrived`, a publication goes to the `publish` callback, and `on_step` says a new T_train was
measured (the fleet's target depends on it).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import simpy

from echo2.sim.state import StepRecord, World, lognormal_factor


class Learner:
    def __init__(
        self,
        world: World,
        *,
        give_up_s: float,
        publish: Callable[[int], None],
        on_step: Callable[[], None],
    ) -> None:
        """`give_up_s`: how long it waits for one batch before the run is reported stalled."""
        self.world = world
        self.give_up_s = give_up_s
        self.groups_per_step = world.sc.learner.batch // world.sc.learner.group_size
        self.version = 0
        self.versions: list[tuple[float, int]] = [(0.0, 0)]
        """(time, learner version) at every step."""
        self.steps: list[StepRecord] = []
        self.train_times: list[float] = []
        self.stalled = False
        """It gave up waiting for a batch (e.g. every worker lost, or records always stale)."""
        self._publish = publish
        self._on_step = on_step
        self._data: simpy.Event = world.env.event()

    def data_arrived(self) -> None:
        """Rollout delivered records: wake the learner if it waits."""
        if not self._data.triggered:
            self._data.succeed()

    def t_train(self) -> float:
        """Median measured T_train (the scenario's figure until a step ran)."""
        return statistics.median(self.train_times) if self.train_times else self.world.sc.learner.t_train

    def run(self):
        env, sc, buffer = self.world.env, self.world.sc, self.world.buffer
        for step in range(sc.steps):
            requested = env.now
            while not sc.learner.colocated and buffer.num_ready_groups() < self.groups_per_step:
                if env.now - requested > self.give_up_s:
                    self.stalled = True
                    return
                if self._data.triggered:
                    self._data = env.event()
                yield self._data | env.timeout(self.give_up_s)
            wait = env.now - requested
            _, staleness = buffer.take(self.groups_per_step)
            train = sc.learner.t_train * lognormal_factor(self.world.rng, sc.learner.jitter)
            self.train_times.append(train)
            self._on_step()
            yield env.timeout(train)
            self.steps.append(
                StepRecord(step=step, requested=requested, wait=wait, train=train, staleness=staleness)
            )
            self.version += 1
            buffer.set_learner_version(self.version)
            self.versions.append((env.now, self.version))
            if self.version % self.world.kappa == 0:
                self._publish(self.version)
