"""The `skypilot` provider: the scheduler rents and stops cloud workers through SkyPilot.

Each `[[scheduler.skypilot.workers]]` type offers `count` slots (NAME-0, NAME-1, ...); starting a
slot launches one SkyPilot cluster (PREFIX-NAME-i) whose task installs echo2 and runs `echo2
worker` against the coordinator's public URL; stopping it tears the cluster down. Every launch
carries autodown after `autostop_minutes` idle, so a learner that dies without `stop()` leaves no
machine billing for long.

Never blocks the coordinator: `start_slot`/`stop_slot` only record the wish; a background thread
(`tick`, every `poll_s`) submits SkyPilot requests (each returns a request id at once) and polls
them and the clusters' statuses. A failed launch (no capacity, quota), a preempted or vanished
cluster, or a worker the coordinator lost marks its type unavailable for `unavailable_s`: its
slots leave `offers()` and `running()`, and the scheduler activates the next cheapest type.

The worker's bearer token travels as a SkyPilot task *secret* (`ECHO2_TOKEN`, redacted from
SkyPilot's logs and YAML), never on a command line; so does a fresh secret per launch
(`ECHO2_SLOT_SECRET`), which the worker proves its slot with when it registers (`proves`). `stop()` (the learner's exit, normal, SIGTERM
or exception: api.py calls it in `finally`) tears down every cluster this provider launched.

The task is a pure YAML-style dict (task.py). SkyPilot is reached only through
`SkyClient` (client.py): `BridgeClient` drives SkyPilot's SDK in its own interpreter
(`scheduler.skypilot.python`, bridge.py); tests use a fake that records calls. Never
imports sky. Knows no scheduler policy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from echo2.config import SkyPilotConfig, SkyPilotWorkerConfig
from echo2.fleet.providers.skypilot.client import BridgeClient, Outcome, SkyClient, check_python
from echo2.fleet.providers.skypilot.cost import CostMeter
from echo2.fleet.providers.skypilot.task import TOKEN_ENV, task_config
from echo2.fleet.selection import WorkerOffer
from echo2.wire import identity

__all__ = ["TOKEN_ENV", "CostMeter", "Outcome", "SkyClient", "SkyPilotFleet", "make_fleet", "task_config"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- the provider
class Phase(StrEnum):
    IDLE = "idle"
    """No cluster: offered when the type is available."""
    QUEUED = "queued"
    """Asked to start; the launch is submitted at the next tick."""
    LAUNCHING = "launching"
    UP = "up"
    DOWNING = "downing"


@dataclass(slots=True, kw_only=True)
class _Slot:
    offer: WorkerOffer
    worker: SkyPilotWorkerConfig
    cluster: str
    phase: Phase = Phase.IDLE
    request: str | None = None
    stop_wanted: bool = False
    launched: bool = False
    """A launch was submitted and no teardown has finished since: `stop()` must tear it down."""
    secret: str | None = None
    """The secret of its last launch (ECHO2_SLOT_SECRET): its worker's proof at registration."""


class SkyPilotFleet:
    """The `Provider` (fleet/provider.py) that rents workers through SkyPilot."""

    def __init__(
        self,
        config: SkyPilotConfig,
        *,
        initial: int = 1,
        client: SkyClient | None = None,
        clock: Callable[[], float] = time.monotonic,
        build: Callable[..., dict] = task_config,
    ) -> None:
        self.config = config
        self.client = client
        """None until `start`, which starts the bridge (`BridgeClient`; tests pass a fake)."""
        self.clock = clock
        self.build = build
        self.slots: dict[str, _Slot] = {}
        for w in config.workers:
            for i in range(w.count):
                name = f"{w.name}-{i}"
                offer = WorkerOffer(name=name, throughput=w.throughput, price=w.price)
                self.slots[name] = _Slot(offer=offer, worker=w, cluster=f"{config.cluster_prefix}-{name}")
        self.initial = min(initial, len(self.slots))
        self.unavailable_until: dict[str, float] = {}
        """Worker type -> clock time until which it is not offered (failed launch, preemption, loss)."""
        self.failures: dict[str, int] = {}
        """Worker type -> launches failed, clusters preempted or workers lost (logged and counted)."""
        self.cost = CostMeter()
        self.learner_threads: int | None = None
        """The learner keeps its own threads (api.py reads this of every fleet)."""
        self.token: str | None = None
        self.learner_key: str | None = None
        self._status_request: str | None = None
        self._status_at = -float("inf")
        self._lock = threading.Lock()  # the scheduler calls in from the coordinator's thread
        self._closed = False
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifetime
    def start(self, source, *, poll_in_background: bool = True) -> None:
        """Called once the coordinator listens: queue the `initial` cheapest slots, start polling
        (tests pass `poll_in_background=False` and call `tick` themselves)."""
        self.token, self.learner_key = source.token, getattr(source, "fingerprint", None)
        if self.client is None:
            if not self.config.python:
                check_python(None)  # the ConfigError naming scheduler.skypilot.python
            self.client = BridgeClient(self.config.python)
        order = sorted(self.slots.values(), key=lambda s: (s.offer.rho, s.offer.name))
        for slot in order[: self.initial]:
            self.start_slot(slot.offer.name)
        if poll_in_background:
            self._thread = threading.Thread(target=self._pump, name="skypilot-provider", daemon=True)
            self._thread.start()
        logger.info(
            "skypilot provider: %d slots, %d queued for %s",
            len(self.slots),
            self.initial,
            self.config.coordinator_url,
        )

    def _pump(self) -> None:
        while not self._closed:
            try:
                self.tick()
            except Exception:  # the API server down, a bad reply: log, count, poll again
                logger.exception("skypilot provider: poll failed")
                self.failures["_poll"] = self.failures.get("_poll", 0) + 1
            self._wake.wait(self.config.poll_s)
            self._wake.clear()

    def __enter__(self) -> SkyPilotFleet:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, grace: float = 60.0) -> None:
        """Idempotent: tear down every cluster launched (cancelling launches in flight), wait up
        to `grace` seconds for the teardowns, and name any left (autodown still ends them)."""
        with self._lock:
            first = not self._closed
            self._closed = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=grace)
        if self.client is None:
            return
        with self._lock:
            downs: dict[str, str] = {}
            for slot in self.slots.values():
                if slot.phase is Phase.LAUNCHING and slot.request is not None:
                    self._try(lambda r=slot.request: self.client.cancel(r), "cancel", slot)
                if slot.launched and slot.phase is not Phase.DOWNING:
                    rid = self._try(lambda c=slot.cluster: self.client.down(c), "down", slot)
                    if rid is not None:
                        slot.phase, slot.request = Phase.DOWNING, rid
                if slot.phase is Phase.DOWNING and slot.request is not None:
                    downs[slot.offer.name] = slot.request
                if slot.phase is Phase.QUEUED:
                    slot.phase = Phase.IDLE
        deadline = time.monotonic() + grace  # wall time, whatever clock bills
        while downs and time.monotonic() < deadline:
            for name, rid in list(downs.items()):
                outcome = self._try(lambda r=rid: self.client.poll(r), "poll teardown of", self.slots[name])
                if outcome is not None:
                    del downs[name]
                    with self._lock:
                        self._down_done(self.slots[name], outcome)
            if downs:
                time.sleep(min(1.0, self.config.poll_s))
        with self._lock:
            self.cost.observe(self.clock(), self._billing())
            left = " ".join(s.cluster for s in self.slots.values() if s.launched)
        if left and first:
            logger.error(
                "skypilot provider: teardown unconfirmed; run `sky down %s` (autodown follows)", left
            )
        close = getattr(self.client, "close", None)
        if close is not None:  # the bridge, if any (started again should a later call need it)
            close()

    def _try(self, call: Callable[[], Any], what: str, slot: _Slot) -> Any:
        try:
            return call()
        except Exception:  # one cluster's teardown must not stop the others'
            logger.exception("skypilot provider: %s %s failed", what, slot.cluster)
            return None

    # ------------------------------------------------------------------ Provider
    def offers(self) -> list[WorkerOffer]:
        """Idle slots of the types available now."""
        now = self.clock()
        with self._lock:
            if self._closed:
                return []
            return [
                s.offer
                for s in self.slots.values()
                if s.phase is Phase.IDLE and self.unavailable_until.get(s.worker.name, -1.0) <= now
            ]

    def running(self) -> list[WorkerOffer]:
        """Slots asked to start and not asked to stop: queued, launching or up."""
        with self._lock:
            return [
                s.offer
                for s in self.slots.values()
                if s.phase in (Phase.QUEUED, Phase.LAUNCHING, Phase.UP) and not s.stop_wanted
            ]

    def owns(self, name: str) -> bool:
        return name in self.slots

    def proves(self, name: str, proof: str | None) -> bool:
        with self._lock:
            slot = self.slots.get(name)
            return slot is not None and identity.proves(proof, slot.secret)

    def start_slot(self, name: str) -> None:
        """Queue a launch (submitted by the background thread: this call never waits on SkyPilot)."""
        with self._lock:
            slot = self.slots[name]
            if self._closed:
                return
            if slot.phase is not Phase.IDLE:
                raise ValueError(f"slot {name!r} is {slot.phase}")
            slot.phase, slot.stop_wanted = Phase.QUEUED, False
        self._wake.set()

    def stop_slot(self, name: str, *, failed: bool = False) -> None:
        """Queue a teardown. `failed` (the coordinator lost the worker): its type is not offered
        for `unavailable_s`; the slot itself is offered again after that (a new machine)."""
        with self._lock:
            slot = self.slots[name]
            if failed:
                self._mark_unavailable(slot, "worker lost")
            if slot.phase is Phase.QUEUED:
                slot.phase = Phase.IDLE
            elif slot.phase in (Phase.LAUNCHING, Phase.UP):
                slot.stop_wanted = True
        self._wake.set()

    # ------------------------------------------------------------------ the poll
    def tick(self) -> None:
        """One round: submit queued launches and wanted teardowns, poll requests in flight and,
        every `poll_s`, the clusters' statuses; charge the bill. Called by the background thread
        (tests call it directly, with a fake client and clock)."""
        assert self.client is not None and self.token is not None, "start() first"
        client = self.client
        with self._lock:
            if self._closed:
                return
            slots = list(self.slots.values())
        for slot in slots:
            with self._lock:  # claim it: a stop_slot from now on finds it launching
                claimed = slot.phase is Phase.QUEUED
                if claimed:
                    slot.phase, slot.request, slot.launched = Phase.LAUNCHING, None, True
                    slot.secret = identity.new_secret()  # a fresh one per launch
            if claimed:
                task = self.build(
                    slot.worker, self.config, slot=slot.offer.name, learner_key=self.learner_key
                )
                try:
                    rid = client.launch(
                        task,
                        token=self.token,
                        slot_secret=slot.secret,
                        cluster_name=slot.cluster,
                        idle_minutes=self.config.autostop_minutes,
                    )
                except Exception as e:  # the API server refused or is down: as a failed launch
                    with self._lock:
                        self._mark_unavailable(slot, f"launch not submitted: {type(e).__name__}: {e}")
                        slot.phase = Phase.IDLE  # `launched` stays: stop() still tries a teardown
                    continue
                with self._lock:
                    slot.request = rid
                logger.info("skypilot provider: launching %s on %s", slot.cluster, slot.worker.accelerator)
            elif slot.phase is Phase.LAUNCHING:
                outcome = client.poll(slot.request)
                if outcome is None:
                    continue
                with self._lock:
                    if outcome.ok:
                        slot.phase, slot.request = Phase.UP, None
                        logger.info("skypilot provider: %s is up", slot.cluster)
                    else:
                        self._mark_unavailable(slot, f"launch failed: {outcome.error}")
                        slot.stop_wanted = True  # a half-provisioned cluster is torn down below
                        slot.phase, slot.request = Phase.UP, None
            elif slot.phase is Phase.DOWNING:
                outcome = client.poll(slot.request)
                if outcome is not None:
                    with self._lock:
                        self._down_done(slot, outcome)
            if slot.phase is Phase.UP and slot.stop_wanted:
                rid = client.down(slot.cluster)
                with self._lock:
                    slot.phase, slot.request = Phase.DOWNING, rid
                logger.info("skypilot provider: tearing down %s", slot.cluster)
        self._poll_status(client)
        with self._lock:
            self.cost.observe(self.clock(), self._billing())

    def _poll_status(self, client: SkyClient) -> None:
        """Clusters believed up that SkyPilot no longer shows up (preempted, autodowned)."""
        now = self.clock()
        if self._status_request is None:
            up = [s.cluster for s in self.slots.values() if s.phase is Phase.UP and not s.stop_wanted]
            if up and now - self._status_at >= self.config.poll_s:
                self._status_request, self._status_at = client.status(up), now
            return
        outcome = client.poll(self._status_request)
        if outcome is None:
            return
        self._status_request = None
        if not outcome.ok:
            logger.warning("skypilot provider: status query failed: %s", outcome.error)
            return
        found: dict[str, str] = outcome.value or {}
        with self._lock:
            for slot in self.slots.values():
                if slot.phase is not Phase.UP or slot.stop_wanted:
                    continue
                state = found.get(slot.cluster)
                if state is None or "UP" not in state and "INIT" not in state:
                    self._mark_unavailable(slot, f"cluster {state or 'gone'} (preempted?)")
                    slot.stop_wanted = True  # tear down what is left of it

    def _down_done(self, slot: _Slot, outcome: Outcome) -> None:
        if outcome.ok or "not exist" in outcome.error or "ClusterDoesNotExist" in outcome.error:
            slot.launched = False
        else:
            logger.warning("skypilot provider: teardown of %s failed: %s", slot.cluster, outcome.error)
        slot.phase, slot.request, slot.stop_wanted = Phase.IDLE, None, False

    def _mark_unavailable(self, slot: _Slot, why: str) -> None:
        kind = slot.worker.name
        self.unavailable_until[kind] = self.clock() + self.config.unavailable_s
        self.failures[kind] = self.failures.get(kind, 0) + 1
        logger.warning(
            "skypilot provider: %s: %s; type %s unavailable for %.0fs",
            slot.cluster,
            why,
            kind,
            self.config.unavailable_s,
        )

    def _billing(self) -> float:
        """USD/h of the clusters that may be billing: from the launch's submission to the end of
        its teardown (an upper bound: provisioning is billed on most clouds)."""
        return sum(
            s.offer.price
            for s in self.slots.values()
            if s.phase in (Phase.LAUNCHING, Phase.UP, Phase.DOWNING)
        )

    def metrics(self) -> dict[str, float]:
        """For the run's metrics and summary.json: the bill so far and the rate now."""
        with self._lock:
            self.cost.observe(self.clock(), self._billing())
            return {"fleet/cost_usd": self.cost.usd, "fleet/price_per_hour": self.cost.price_per_hour}


def make_fleet(config, *, initial: int) -> SkyPilotFleet:
    """The provider api.py builds for `scheduler.provider = "skypilot"` from the run's `Config`:
    checks that `scheduler.skypilot.python` imports sky (a ConfigError naming the key if not);
    the learner keeps `run.threads`. Starts no bridge before `start`."""
    sp = config.scheduler.skypilot
    version = check_python(sp.python)
    logger.info("skypilot provider: SkyPilot %s under %s", version.get("sky"), sp.python)
    fleet = SkyPilotFleet(sp, initial=initial)
    fleet.learner_threads = config.run.threads
    return fleet
