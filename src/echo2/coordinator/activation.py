"""The fleet: the scheduler's decisions about which workers run, and the provider calls they need.

Pure: the caller passes the registry, the provider's slots as read before (`Slots`) and `now`; the
fleet returns steps, each a scheduler decision with the provider call that carries it out (`Call`,
or None for a registered worker that only moves in or out of the reserve). It never calls the
provider itself: the coordinator's state (state.py) applies the calls outside its lock, because starting a
process (the `local` provider) or renting a machine takes a while, and records each decision once
its call is done. Changes to registered workers (released, moved to standby, their leases put back)
are the caller's to make with the step. Knows no sockets and no lock.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from echo2.coordinator.registry import Registry, WorkerStatus
from echo2.fleet.provider import Provider
from echo2.fleet.scheduler import Action, Decision, Kind, Role, Scheduler, WorkerView
from echo2.fleet.selection import WorkerOffer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Slots:
    """The provider's slots, read outside the lock just before a scheduling round."""

    offers: list[WorkerOffer]
    """Startable now."""
    running: list[WorkerOffer]
    """Started (perhaps not registered yet)."""

    @classmethod
    def read(cls, provider: Provider) -> Slots:
        return cls(offers=provider.offers(), running=provider.running())


@dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    """One provider call: start the slot `name`, or stop it (`failed`: never offer it again)."""

    name: str
    start: bool
    failed: bool = False

    def apply(self, provider: Provider) -> None:
        if self.start:
            provider.start_slot(self.name)
        else:
            provider.stop_slot(self.name, failed=self.failed)


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    """A scheduler decision, the worker's name, and the provider call that carries it out."""

    decision: Decision
    name: str
    call: Call | None


class Fleet:
    def __init__(
        self,
        *,
        scheduler: Scheduler | None,
        target: Callable[[], float | None],
        has_provider: bool,
    ) -> None:
        self.scheduler = scheduler
        self.target = target
        """Throughput the pool should deliver (gamma * mu_min), or None while unknown."""
        self.has_provider = has_provider
        """A provider starts standby workers as processes and stops released ones (without one,
        standby workers are registered processes that get no leases)."""
        self.decisions: deque[dict] = deque(maxlen=200)
        """The scheduler's decisions, newest last, each with its time and reason (in /status)."""

    def standby_on_arrival(self, *, provided: bool) -> bool:
        """With a scheduler and a known target, newcomers wait in reserve until activated; a provider
        only starts the workers the scheduler (or the run's start) asked for."""
        return self.scheduler is not None and self.target() is not None and not provided

    def stop_lost(self, lost: list) -> list[Call]:
        """Provided workers that went silent are stopped as failed."""
        return [Call(name=w.name, start=False, failed=True) for w in lost if w.provided]

    def plan(
        self,
        registry: Registry,
        slots: Slots | None,
        now: float,
        *,
        delivered: Callable[[str], float | None] = lambda worker_id: None,
    ) -> list[Step]:
        """This round's decisions (none while the target is unknown). `delivered`: the rate a
        worker delivered on its leases, None while not measured (`Registry.throughput`)."""
        target = self.target()
        if self.scheduler is None or target is None:
            return []
        roles = {WorkerStatus.LOST: Role.LOST, WorkerStatus.ACTIVE: Role.ACTIVE}
        workers = registry.workers
        views = [
            WorkerView(
                worker_id=w.worker_id,
                throughput=registry.throughput(w, now, delivered=delivered(w.worker_id)) or 0.0,
                price=w.price_per_hour,
                role=Role.STANDBY if w.standby else roles[w.status],
            )
            for w in workers.values()
            if w.status is not WorkerStatus.RELEASED
        ]
        if slots is not None:
            live = {w.name for w in workers.values() if w.status is WorkerStatus.ACTIVE}
            # Started but not registered yet: count them, so the scheduler does not start more.
            views += [
                WorkerView(
                    worker_id=o.name, throughput=o.throughput, price=o.price, role=Role.ACTIVE, kind=Kind.SLOT
                )
                for o in slots.running
                if o.name not in live
            ]
            views += [
                WorkerView(
                    worker_id=o.name,
                    throughput=o.throughput,
                    price=o.price,
                    role=Role.STANDBY,
                    kind=Kind.SLOT,
                )
                for o in slots.offers
            ]
        return [self._step(d, registry) for d in self.scheduler.decide(views, target=target, now=now)]

    def _step(self, d: Decision, registry: Registry) -> Step:
        if d.kind is Kind.SLOT:
            # activate: start the slot; release: it was started but has not registered yet
            return Step(
                decision=d, name=d.worker_id, call=Call(name=d.worker_id, start=d.action is Action.ACTIVATE)
            )
        info = registry.workers[d.worker_id]
        release = d.action is Action.RELEASE
        call = Call(name=info.name, start=False) if release and info.provided else None
        return Step(decision=d, name=info.name, call=call)

    def record(self, step: Step, now: float) -> None:
        d = step.decision
        self.decisions.append(
            {
                "time": now,
                "action": d.action,
                "worker": step.name,
                "worker_id": d.worker_id,
                "reason": d.reason,
            }
        )
        logger.info("scheduler: %s %s (%s): %s", d.action, step.name, d.worker_id, d.reason)
