"""The simulated rollout workers: one SimPy process each, generating rounds of `lease_groups` groups
at mu_i (times slowdown and jitter) under the version installed when the round starts, and
delivering them to the replay buffer. With `keep_generating = false` a worker stops generating
from publication until it installs.

Owns the generation loop, deliveries to the buffer, what was lost in flight, and the wake-up of a
worker whose state changed (`poke`). Knows nothing of how a snapshot reaches a worker (dissemination
calls `install`), who activates or releases it (the fleet flips `active` and pokes), or what the
learner does with the data (`on_delivered`).
"""

from __future__ import annotations

from collections.abc import Callable

import simpy

from echo2.records import Trajectory
from echo2.sim.state import SimWorker, World, lognormal_factor


class Rollout:
    def __init__(self, world: World, *, on_delivered: Callable[[], None]) -> None:
        self.world = world
        self.deliveries: list[tuple[float, int, int]] = []
        """(time, groups delivered, groups admitted) of every finished round."""
        self.lost_groups = 0
        """Groups in flight on a worker that dropped out or was released."""
        self._on_delivered = on_delivered
        self._group_seq = 0

    def start(self) -> None:
        for w in self.world.workers.values():
            self.world.env.process(self._worker(w))

    # ------------------------------------------------------------------ a worker's state
    def _changed(self, w: SimWorker) -> simpy.Event:
        if w.changed is None or w.changed.triggered:
            w.changed = self.world.env.event()
        return w.changed

    def poke(self, w: SimWorker) -> None:
        """Make a worker re-read its state (rate, pause, stop) now."""
        if w.changed is not None and not w.changed.triggered:
            w.changed.succeed()

    def note_generating(self, w: SimWorker, on: bool) -> None:
        rate = w.mu if on else 0.0
        if not w.generating or w.generating[-1][1] != rate:
            w.generating.append((self.world.env.now, rate))

    def pause(self, w: SimWorker) -> None:
        """Conservative mode: stop generating until the next install."""
        w.paused = True
        self.poke(w)

    def install(self, w: SimWorker, version: int) -> None:
        w.installed = version
        w.versions.append((self.world.env.now, version))
        if w.paused:
            w.paused = False
            self.poke(w)
        elif not w.busy:
            self.poke(w)

    # ------------------------------------------------------------------ generation
    def _worker(self, w: SimWorker):
        env, spec, buffer = self.world.env, w.spec, self.world.buffer
        lease_groups = self.world.sc.rollout.lease_groups
        size = lease_groups * self.world.sc.learner.group_size  # trajectories per round
        while w.alive:
            # As the coordinator does, no lease for a worker whose version is already too old to be
            # admitted: it waits for the next snapshot.
            if not w.can_generate or w.installed < buffer.min_version():
                self.note_generating(w, False)
                yield self._changed(w)
                continue
            version = w.installed
            remaining = float(size)
            jitter = lognormal_factor(self.world.rng, spec.jitter)
            w.busy = True
            while remaining > 0 and w.alive and w.active:
                if w.paused:  # conservative mode: stop until the new snapshot is installed;
                    self.note_generating(w, False)  # the rest of the round then runs under it
                    yield self._changed(w)
                    version = w.installed
                    continue
                self.note_generating(w, True)
                rate = w.mu * jitter
                t = env.now
                done = env.timeout(remaining / rate)
                yield done | self._changed(w)
                remaining = 0.0 if done.processed else max(0.0, remaining - (env.now - t) * rate)
            w.busy = False
            if remaining > 0:  # stopped mid-round (dropped out or released): the round is lost
                self.lost_groups += lease_groups
                continue
            self._deliver(w, version)

    def _deliver(self, w: SimWorker, version: int) -> None:
        records = []
        for _ in range(self.world.sc.rollout.lease_groups):
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
        admitted = self.world.buffer.add(records)
        self.deliveries.append((self.world.env.now, len(records), admitted))
        self._on_delivered()
