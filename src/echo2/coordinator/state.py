"""The coordinator's state: a registry, an intake, a publisher and a fleet under one lock, and the
order in which an expiry round drives them.

Composed of parts that own their state and know nothing of each other's insides: the registry
(registry.py, pure: workers, heartbeats, expiry), the intake (intake.py: leases, ingestion,
verification, quarantine), the publisher (publisher.py: kept snapshots and broadcast calls) and
the fleet (fleet.py, pure: scheduler decisions, provider calls). All take the one lock of
`Shared` (shared.py), with an injectable clock, so the HTTP layer (coordinator.py), the learner
thread and the tests drive the same code. This module owns what spans the parts: registration and
credentials, heartbeats, the expiry round, the end of the run and the status. It raises the domain
errors of errors.py and knows no HTTP. The signing key and the id factory are passed in
(deterministic under test), and the provider is called only outside the lock: a round decides
under the lock, calls the provider, then records the decisions under the lock again.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.broadcast.tracker import BroadcastPolicy
from echo2.config import CoordinatorConfig
from echo2.coordinator.activation import Call, Fleet, Slots
from echo2.coordinator.intake import Intake, Journal
from echo2.coordinator.leases import Work
from echo2.coordinator.publisher import Publisher
from echo2.coordinator.registry import Registry, WorkerInfo, WorkerStatus
from echo2.coordinator.sessions import SeqWindow
from echo2.coordinator.shared import Shared
from echo2.fleet.provider import Provider
from echo2.fleet.scheduler import Action, Scheduler
from echo2.wire import identity
from echo2.wire.errors import Forbidden, Quarantined, SlotUnproven, Unauthorized, UnknownWorker
from echo2.wire.validate import Referee

logger = logging.getLogger(__name__)

__all__ = ["CoordinatorState", "new_id"]


def new_id() -> str:
    """The default id factory (worker and lease ids)."""
    return uuid.uuid4().hex[:12]


class CoordinatorState:
    def __init__(
        self,
        section: CoordinatorConfig,
        *,
        work: Work,
        clock: Callable[[], float] = time.monotonic,
        scheduler: Scheduler | None = None,
        target: Callable[[], float | None] = lambda: None,
        window_s: float = 30.0,
        provider: Provider | None = None,
        broadcast: BroadcastPolicy | None = None,
        signing_key: Ed25519PrivateKey | None = None,
        ids: Callable[[], str] = new_id,
        referee: Referee | None = None,
        journal: Journal | None = None,
        publisher: type[Publisher] = Publisher,
    ) -> None:
        """`section` is `[coordinator]` (timeouts, lease and quarantine limits); `work` what is handed
        out (leases.py); `scheduler`, `target` and `window_s` the fleet's (`[scheduler]`);
        `broadcast` and `signing_key` the publisher's; `referee` and `journal` the intake's."""
        self.shared = Shared(clock)
        """The lock, the clock, the published version and the end of the run, for every part."""
        self.registry = Registry(heartbeat_timeout=section.heartbeat_timeout, window_s=window_s)
        self.intake = Intake(
            self.shared, self.registry, section, work=work, ids=ids, referee=referee, journal=journal
        )
        self.publisher = publisher(self.shared, self.registry, policy=broadcast, signing_key=signing_key)
        """Its class is the caller's (the broadcast benchmark's records the receivers' calls)."""
        self.fleet = Fleet(scheduler=scheduler, target=target, has_provider=provider is not None)
        self.provider = provider
        self.ids = ids
        """Makes worker ids."""
        self.purge_after = section.purge_after
        """Seconds after which a lost worker's registration is forgotten."""
        self._round = threading.Lock()
        """One expiry round at a time (it releases the lock around provider calls)."""
        self.epoch = secrets.token_hex(8)
        self._sessions: dict[str, SeqWindow] = {}
        """Worker id -> the request numbers its credential's client used (coordinator/sessions.py)."""
        self._sessions_lock = threading.Lock()
        self.revoked: set[str] = set()
        """Workers whose credential two clients used at once: refused from then on (403)."""
        self._revoked_pending: list[str] = []
        """Revoked since the last expiry round, which puts their leases back."""
        self.credential_conflicts: deque[dict] = deque(maxlen=100)
        """The latest revocations, for /status and /metrics."""
        self.credential_conflicts_total = 0
        """This start of the coordinator: workers that see it change drop versions it never published."""
        self._beats: deque[tuple[str, int, float, float]] = deque()
        """Heartbeats noted while a push held the lock (`heartbeat_later`), applied by the next
        heartbeat or expiry round that takes it: (worker id, version, throughput, when)."""

    # ------------------------------------------------------------------ workers
    def register(
        self,
        *,
        name: str,
        hardware: str,
        price_per_hour: float,
        inbound: bool,
        throughput: float = 0.0,
        relay_url: str | None = None,
        slot_proof: str | None = None,
    ) -> WorkerInfo:
        """Add a worker. One registering under the name of a provider's slot must prove it is that
        slot's worker (`slot_proof`, the secret the provider put in its environment): without the
        proof it is refused (`SlotUnproven`) and nothing changes, so a worker holding only the run
        token cannot take a launched slot's name, go silent and have the real one torn down."""
        provided = self.provider is not None and self.provider.owns(name)  # outside the lock
        if provided and not self.provider.proves(name, slot_proof):
            raise SlotUnproven(
                f"{name!r} is a slot the provider started; its worker's secret is missing or wrong"
            )
        with self.shared.lock:
            return self.registry.add(
                self.ids(),
                name=name,
                hardware=hardware,
                price_per_hour=price_per_hour,
                inbound=inbound,
                throughput=throughput,
                relay_url=relay_url,
                standby=self.fleet.standby_on_arrival(provided=provided),
                provided=provided,
                now=self.shared.clock(),
            )

    def issue_credential(self, worker_id: str) -> str:
        """A new credential for a registered worker (replacing any earlier one); returned once."""
        secret = identity.new_secret()
        with self.shared.lock:
            self.registry.workers[worker_id].secret_digest = identity.digest(secret)
        return identity.credential(worker_id, secret)

    def authenticate(self, credential: str) -> str:
        """The worker id a credential proves (Unauthorized if it proves none; UnknownWorker if its
        worker is not registered here, e.g. after a restart, so the worker registers again).

        Takes no lock: one read of the registry's dict and of its record's digest, each atomic, so
        that a push (authenticated, then ingested) takes the lock once."""
        worker_id, secret = identity.split(credential)
        if not worker_id:
            raise Unauthorized("missing or wrong bearer token")
        info = self.registry.workers.get(worker_id)
        if info is None:
            if self.intake.banned(identity.digest(secret)):  # forgotten, but its quarantine is not
                raise Quarantined(f"worker {worker_id!r} was quarantined; registering again is no remedy")
            raise UnknownWorker(f"worker {worker_id!r} is not registered; register again")
        if not identity.matches(secret, info.secret_digest):
            raise Unauthorized(f"wrong credential for worker {worker_id!r}")
        if worker_id in self.revoked:
            raise Forbidden(
                f"worker {worker_id!r}'s credential was revoked (two clients used it at once); register again"
            )
        return worker_id

    def check_session(self, worker_id: str, seq: int | None) -> None:
        """Admit an authenticated call numbered `seq` (None: unnumbered) as its credential's one
        client's; otherwise revoke the credential for every holder (Forbidden now and on every later
        call: the honest worker registers again) and record the conflict. Its own small lock, never
        the state's: it runs on the event loop."""
        with self._sessions_lock:
            why = self._sessions.setdefault(worker_id, SeqWindow()).admit(seq)
            if why is None:
                return
            info = self.registry.workers.get(worker_id)
            self.revoked.add(worker_id)
            self._revoked_pending.append(worker_id)
            self.credential_conflicts_total += 1
            self.credential_conflicts.append(
                {
                    "worker_id": worker_id,
                    "name": info.name if info else "",
                    "at": self.shared.clock(),
                    "why": why,
                }
            )
        logger.warning("worker %s: credential revoked, two clients used it at once (%s)", worker_id, why)
        raise Forbidden(
            f"worker {worker_id!r}'s credential was revoked: two clients used it at once ({why}); register again"
        )

    def check_not_banned(self, credential: str) -> None:
        """Refuse (`Quarantined`) a worker credential presented to register again whose worker was
        quarantined: quarantine is bound to the credential, not the worker id."""
        _, secret = identity.split(credential)
        if secret and credential.isascii() and self.intake.banned(identity.digest(secret)):
            raise Quarantined("this credential's worker is quarantined; registering again is no remedy")

    def heartbeat(self, worker_id: str, *, version: int, throughput: float) -> None:
        with self.shared.lock:
            self._apply_beats()
            info = self.registry.get(worker_id, self.shared.clock())
            self.shared.check_version(version)
            info.version = version
            now = self.shared.clock()
            self.registry.sample(info, throughput, now)
            self.publisher.note_version(worker_id, version, now)

    def heartbeat_later(self, worker_id: str, *, version: int, throughput: float) -> bool:
        """A heartbeat answered without the lock, which a push being stored holds (60-120 ms for
        4,096 records): what a beat can refuse is checked now, from one read of the worker's entry
        and of the published version (each atomic), and the beat is applied, with its time, by the
        next holder of the lock that applies beats (a heartbeat or the expiry round, which applies
        them before it looks for silent workers). False: this worker is not an active one, so the
        caller takes the blocking `heartbeat`, which raises as the registry does."""
        info = self.registry.workers.get(worker_id)
        if info is None or info.status is not WorkerStatus.ACTIVE:
            return False
        self.shared.check_version(version)
        self._beats.append((worker_id, version, throughput, self.shared.clock()))
        return True

    def _apply_beats(self) -> None:
        """The beats `heartbeat_later` noted, in order (under the lock). A worker that stopped being
        active since is skipped: its beat was answered, but it counts for nothing now."""
        while self._beats:
            worker_id, version, throughput, at = self._beats.popleft()
            info = self.registry.workers.get(worker_id)
            if info is None or info.status is not WorkerStatus.ACTIVE:
                continue
            info.last_seen = max(info.last_seen, at)
            info.version = version
            self.registry.sample(info, throughput, at)
            self.publisher.note_version(worker_id, version, at)

    # ------------------------------------------------------------------ the expiry round
    def expire(self) -> None:
        """One round (called periodically): mark silent workers lost, put back expired leases and
        those of lost workers, then let the scheduler decide. Provider calls are made outside the
        lock: lost provided workers are stopped before the provider's slots are read, so a round
        never counts a stopped slot as capacity."""
        with self._round:
            with self.shared.lock:
                self._apply_beats()  # answered while a push held the lock: not silent
                now = self.shared.clock()
                lost = self.registry.expire(now)
                for worker_id in self.registry.purge(now, self.purge_after):
                    self.intake.forget(worker_id)
                    with self._sessions_lock:
                        self._sessions.pop(worker_id, None)
                with self._sessions_lock:
                    revoked, self._revoked_pending = self._revoked_pending, []
                for worker_id in revoked:  # a revoked credential's leases go to other workers now
                    self.intake.ingestion.put_back_all(worker_id)
                self.intake.ingestion.expire(now, self.registry.is_lost)
                self.intake.measure_pool(now)
                self.publisher.lost([info.worker_id for info in lost])
                stops = self.fleet.stop_lost(lost)
                scheduling = self.fleet.scheduler is not None and self.fleet.target() is not None
            self._call(stops)
            if not scheduling:
                return
            slots = Slots.read(self.provider) if self.provider is not None else None
            with self.shared.lock:
                steps = self.fleet.plan(self.registry, slots, now, delivered=self.intake.ingestion.delivered)
                for step in steps:  # registered workers change at once; provider slots below
                    info = self.registry.workers.get(step.decision.worker_id)
                    if info is not None:
                        self._carry_out(step.decision.action, info)
                if steps:
                    self.intake.measure_pool(now)
            done = []
            try:
                for step in steps:
                    self._call([step.call] if step.call else [])
                    done.append(step)
            finally:
                with self.shared.lock:
                    for step in done:
                        self.fleet.record(step, now)

    def _carry_out(self, action: Action, info: WorkerInfo) -> None:
        if action is Action.RELEASE:
            self.intake.ingestion.put_back_all(info.worker_id)
            if info.provided:
                self.registry.release(info)
        info.standby = action is Action.RELEASE and info.status is WorkerStatus.ACTIVE

    def _call(self, calls: list[Call]) -> None:
        """Provider calls, never under the lock (a local provider starts a process)."""
        assert not calls or self.provider is not None
        for call in calls:
            call.apply(self.provider)

    # ------------------------------------------------------------------ the run
    def close(self) -> None:
        with self.shared.lock:
            self.shared.closed = True
            self.shared.ready.notify_all()
        self.publisher.wake()

    def status(self) -> dict:
        """GET /status, less what the learner adds."""
        with self.shared.lock:
            self._apply_beats()
            rows = self.registry.rows()
            intake = self.intake.status(rows)
            return {
                "published_version": self.shared.published_version,
                "workers": rows,
                **intake,
                "scheduler_target": self.fleet.target() if self.fleet.scheduler else None,
                "scheduler_decisions": list(self.fleet.decisions)[-20:],  # all of them with a learner
                "broadcast": self.publisher.status(),
                "credential_conflicts": list(self.credential_conflicts)[-20:],
                "credential_conflicts_total": self.credential_conflicts_total,
            }
