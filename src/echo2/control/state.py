"""The coordinator's state: one lock over the registry, the leases, the broadcast bookkeeping and
the fleet, and the order in which they are driven.

A thin façade. The parts are pure and know nothing of each other: registry.py (workers,
heartbeats, expiry), leases.py (leases, ingestion, the buffer hand-off), broadcast.py (kept
snapshots, routes, installs, T_bcast) and fleet.py (scheduler decisions, provider calls). This
module composes them under one lock with an injectable clock, so the HTTP layer (coordinator.py),
the learner thread and the tests all drive the same code. It raises the domain errors of errors.py
and knows no HTTP. The signing key and the id factory are passed in (deterministic under test), and
the provider is called only outside the lock: a round decides under the lock, calls the provider,
then records the decisions under the lock again. Ingestion and verification (state_ingest.py) and
the broadcast calls (state_broadcast.py) are its two halves in files of their own, mixed in.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.broadcast.chunks import public_key_hex
from echo2.control import identity
from echo2.control.broadcast import (
    BroadcastPolicy,
    BroadcastState,
    SnapshotBlob,
    make_blob,
)
from echo2.control.errors import (
    Invalid,
    LeaseLimit,
    Reason,
    Unauthorized,
    UnknownWorker,
)
from echo2.control.fleet import Call, Fleet, Slots
from echo2.control.integrity import Integrity
from echo2.control.leases import Lease, Leases, Limits, lease_deadline, lease_groups
from echo2.control.provider import Provider
from echo2.control.registry import Registry, WorkerInfo, WorkerStatus
from echo2.control.scheduler import Action, Scheduler
from echo2.control.state_broadcast import BroadcastCalls
from echo2.control.state_ingest import IngestCalls
from echo2.control.validate import Referee
from echo2.data.buffer import ReplayBuffer
from echo2.records import Trajectory

logger = logging.getLogger(__name__)

__all__ = ["CoordinatorState", "Lease", "Limits", "WorkerInfo", "WorkerStatus", "new_id"]


def new_id() -> str:
    """The default id factory (worker and lease ids)."""
    return uuid.uuid4().hex[:12]


def _part(part: str, name: str, *, settable: bool = False) -> property:
    """A field of one of the parts, read (and, if `settable`, written) through the façade."""

    def get(self: CoordinatorState):
        return getattr(getattr(self, part), name)

    def put(self: CoordinatorState, value) -> None:
        setattr(getattr(self, part), name, value)

    return property(get, put if settable else None, doc=f"`self.{part}.{name}`")


class CoordinatorState(IngestCalls, BroadcastCalls):
    def __init__(
        self,
        *,
        buffer: ReplayBuffer,
        limits: Limits,
        group_id_of: Callable[[int], str],
        lease_timeout: float,
        heartbeat_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        scheduler: Scheduler | None = None,
        target: Callable[[], float | None] = lambda: None,
        window_s: float = 30.0,
        provider: Provider | None = None,
        broadcast: BroadcastPolicy | None = None,
        signing_key: Ed25519PrivateKey | None = None,
        ids: Callable[[], str] = new_id,
        referee: Referee | None = None,
        max_leases_per_worker: int = 4,
        max_groups_per_lease: int = 1024,
        groups_per_step: int | None = None,
        quarantine_after: int = 3,
        purge_after: float = 600.0,
        journal: Callable[[list[Trajectory], dict[str, int]], None] | None = None,
    ) -> None:
        self.clock = clock
        self.referee = referee
        """Checks each record against the task (the leased prompt, the reward); None: no check."""
        self.max_leases_per_worker = max_leases_per_worker
        self.max_groups_per_lease = max_groups_per_lease
        """Cap on a lease's groups (`coordinator.groups_per_lease`, default a step's batch); below
        it each lease is sized from its worker's throughput (leases.py: `lease_groups`)."""
        self.groups_per_step = groups_per_step or max_groups_per_lease
        """A step's batch in groups, split across the active workers by their throughput."""
        self.pool_throughput = 0.0
        """Trajectories/s of the active workers (not in standby), as of the last expiry round."""
        self.purge_after = purge_after
        """Seconds after which a lost worker's registration is forgotten."""
        self.integrity = Integrity(quarantine_after=quarantine_after)
        """Strikes, quarantine, and which worker made each group (control/integrity.py)."""
        self.ids = ids
        """Makes worker and lease ids."""
        self.provider = provider
        self.lock = threading.RLock()
        self.ready = threading.Condition(self.lock)  # notified when groups arrive or state changes
        self._round = threading.Lock()
        """One expiry round at a time (it releases `lock` around provider calls)."""
        self.registry = Registry(heartbeat_timeout=heartbeat_timeout, window_s=window_s)
        self.ingestion = Leases(
            buffer=buffer, limits=limits, group_id_of=group_id_of, lease_timeout=lease_timeout
        )
        self.fleet = Fleet(scheduler=scheduler, target=target, has_provider=provider is not None)
        self.bcast = BroadcastState(broadcast or BroadcastPolicy())
        """Kept snapshots, chain plans, peer scores, install times (control/broadcast.py)."""
        # A throwaway key when none is given (tools and tests that do not check signatures); runs
        # pass the learner's key (control/remote.py).
        self.signing_key = signing_key or Ed25519PrivateKey.generate()
        """Signs every snapshot manifest; its public half is handed to workers at registration."""
        self.public_key = public_key_hex(self.signing_key)
        self.listeners: list[Callable[[], None]] = []
        """Called (from the publishing thread, outside the lock) after each publication."""
        self.keep = 1
        """Snapshot versions kept (S + 1; set by the learner at each publication)."""
        self.published_version = -1
        self.closed = False
        self.epoch = secrets.token_hex(8)
        """This start of the coordinator: workers that see it change drop versions it never published."""
        self.journal = journal
        """Called under the lock with the records of every accepted batch and the prompt index of
        each of their groups, before the acknowledgement (control/journal.py: the log a resumed
        learner replays)."""

    # ------------------------------------------------------------------ the parts' fields, as before
    # Callers written before the split (the learner's RemoteRollout, tests, benchmarks) read these.
    workers = _part("registry", "workers")
    heartbeat_timeout = _part("registry", "heartbeat_timeout")
    buffer = _part("ingestion", "buffer")
    leases = _part("ingestion", "leases")
    reissue = _part("ingestion", "reissue")
    next_index = _part("ingestion", "next_index", settable=True)
    rejected = _part("ingestion", "rejected")
    accepted = _part("ingestion", "accepted")
    reissued = _part("ingestion", "reissued")
    decisions = _part("fleet", "decisions")
    scheduler = _part("fleet", "scheduler")
    target = _part("fleet", "target")

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
    ) -> WorkerInfo:
        provided = self.provider is not None and self.provider.owns(name)  # outside the lock
        with self.lock:
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
                now=self.clock(),
            )

    def issue_credential(self, worker_id: str) -> str:
        """A new credential for a registered worker (replacing any earlier one); returned once."""
        secret = identity.new_secret()
        with self.lock:
            self.registry.workers[worker_id].secret_digest = identity.digest(secret)
        return identity.credential(worker_id, secret)

    def authenticate(self, credential: str) -> str:
        """The worker id a credential proves (Unauthorized if it proves none; UnknownWorker if its
        worker is not registered here, e.g. after a restart, so the worker registers again)."""
        worker_id, secret = identity.split(credential)
        if not worker_id:
            raise Unauthorized("missing or wrong bearer token")
        with self.lock:
            info = self.registry.workers.get(worker_id)
            if info is None:
                raise UnknownWorker(f"worker {worker_id!r} is not registered; register again")
            if not identity.matches(secret, info.secret_digest):
                raise Unauthorized(f"wrong credential for worker {worker_id!r}")
        return worker_id

    def _worker(self, worker_id: str) -> WorkerInfo:
        return self.registry.get(worker_id, self.clock())

    def _check_version(self, version: int) -> None:
        if version > self.published_version:
            raise Invalid(Reason.FUTURE_VERSION, f"version {version} > published {self.published_version}")

    def heartbeat(self, worker_id: str, *, version: int, throughput: float) -> None:
        with self.lock:
            info = self._worker(worker_id)
            self._check_version(version)
            info.version = version
            now = self.clock()
            self.registry.sample(info, throughput, now)
            if version >= 0 and self.bcast.note_version(worker_id, version, now):  # O(1) otherwise
                self.bcast.update_t_bcast(self.registry.peers())

    def expire(self) -> None:
        """One round (called periodically): mark silent workers lost, put back expired leases and
        those of lost workers, then let the scheduler decide. Provider calls are made outside the
        lock: lost provided workers are stopped before the provider's slots are read, so a round
        never counts a stopped slot as capacity."""
        with self._round:
            with self.lock:
                now = self.clock()
                lost = self.registry.expire(now)
                for info in lost:
                    self.bcast.forget(info.worker_id)
                for worker_id in self.registry.purge(now, self.purge_after):
                    self.integrity.forget(worker_id)
                    self.ingestion.forget(worker_id)
                self.ingestion.expire(now, self.registry.is_lost)
                self.pool_throughput = self._pool_throughput(now)
                peers = self.registry.peers()
                self.bcast.update_t_bcast(peers)  # the live set changed: a quantile may be reached now
                self.bcast.evict(self.keep, peers)
                stops = self.fleet.stop_lost(lost)
                scheduling = self.fleet.scheduler is not None and self.fleet.target() is not None
            self._call(stops)
            if not scheduling:
                return
            slots = Slots.read(self.provider) if self.provider is not None else None
            with self.lock:
                steps = self.fleet.plan(self.registry, slots, now, delivered=self.ingestion.delivered)
                for step in steps:  # registered workers change at once; provider slots below
                    info = self.registry.workers.get(step.decision.worker_id)
                    if info is not None:
                        self._carry_out(step.decision.action, info)
                if steps:
                    self.pool_throughput = self._pool_throughput(now)
            done = []
            try:
                for step in steps:
                    self._call([step.call] if step.call else [])
                    done.append(step)
            finally:
                with self.lock:
                    for step in done:
                        self.fleet.record(step, now)

    def _carry_out(self, action: Action, info: WorkerInfo) -> None:
        if action is Action.RELEASE:
            self.ingestion.put_back_all(info.worker_id)
            if info.provided:
                self.registry.release(info)
        info.standby = action is Action.RELEASE and info.status is WorkerStatus.ACTIVE

    def throughput(self, info: WorkerInfo, now: float) -> float | None:
        """Trajectories/s the coordinator believes of `info` (`Registry.throughput`): delivered on
        its leases once measured, else its own figure; None: none yet. Called under the lock."""
        return self.registry.throughput(info, now, delivered=self.ingestion.delivered(info.worker_id))

    def _pool_throughput(self, now: float) -> float:
        return sum(
            self.throughput(w, now) or 0.0
            for w in self.registry.workers.values()
            if w.status is WorkerStatus.ACTIVE and not w.standby
        )

    def _call(self, calls: list[Call]) -> None:
        """Provider calls, never under the lock (a local provider starts a process)."""
        assert not calls or self.provider is not None
        for call in calls:
            call.apply(self.provider)

    # ------------------------------------------------------------------ leases
    def lease(self, worker_id: str, *, version: int, max_groups: int) -> Lease | None:
        """Prompts to generate, or None: nothing published yet, or the worker's installed version is
        already too old to be admitted (it should install the newest snapshot first). At most
        `max_groups` and `max_groups_per_lease` groups, sized from the worker's throughput so that
        the lease is done well inside its deadline (leases.py: `lease_groups`, `lease_deadline`)."""
        with self.lock:
            info = self._worker(worker_id)
            self._check_trusted(worker_id)
            if self.published_version < 0 or self.closed:
                return None
            self._check_version(version)
            if not self.ingestion.admits(version) or info.standby:
                return None
            held = sum(1 for lease in self.ingestion.leases.values() if lease.worker_id == worker_id)
            if held >= self.max_leases_per_worker:
                raise LeaseLimit(
                    f"worker already holds {held} open leases (at most {self.max_leases_per_worker})"
                )
            now = self.clock()
            mu = self.throughput(info, now)
            groups = lease_groups(
                throughput=mu,
                pool_throughput=self.pool_throughput,
                groups_per_step=self.groups_per_step,
                group_size=self.ingestion.limits.group_size,
                lease_timeout=self.ingestion.lease_timeout,
                cap=min(max_groups, self.max_groups_per_lease),
            )
            deadline_s = lease_deadline(
                groups=groups,
                throughput=mu,
                group_size=self.ingestion.limits.group_size,
                lease_timeout=self.ingestion.lease_timeout,
            )
            return self.ingestion.issue(
                self.ids(), worker_id, max_groups=groups, now=now, deadline_s=deadline_s, version=version
            )

    def return_lease(self, worker_id: str, lease_id: str) -> None:
        with self.lock:
            self._worker(worker_id)
            self.ingestion.give_back(worker_id, lease_id)

    # ------------------------------------------------------------------ learner side
    def publish(self, version: int, data: bytes, *, keep: int) -> SnapshotBlob:
        """Cut, hash and sign the snapshot (outside the lock), plan its broadcast from the current
        scores, and keep it with the newest `keep` (S + 1) versions."""
        blob = make_blob(version, data, self.bcast.policy.chunk_size, self.signing_key)
        with self.lock:
            self.keep = keep
            self.published_version = version
            self.bcast.publish(blob, self.registry.peers(), self.clock(), keep=keep)
            self.ready.notify_all()
        for listener in list(self.listeners):
            listener()
        logger.info("version published: %d (%.1f MB)", version, len(data) / 1e6)
        return blob

    def take_groups(self, num_groups: int, *, timeout: float) -> tuple[list[list[Trajectory]], list[int]]:
        """Block until `num_groups` admissible groups are buffered (or timeout), then take them."""
        with self.lock:
            self.ready.wait_for(
                lambda: self.buffer.num_ready_groups() >= num_groups or self.closed, timeout=timeout
            )
            if self.buffer.num_ready_groups() < num_groups:
                return [], []
            groups, staleness = self.buffer.take(num_groups)
            self.ingestion.taken(groups)
            return groups, staleness

    def set_learner_version(self, version: int) -> None:
        with self.lock:
            self.ingestion.requeue_evicted(self.buffer.set_learner_version(version))

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.ready.notify_all()
        for listener in list(self.listeners):
            listener()

    # ------------------------------------------------------------------ reporting
    def status(self) -> dict:
        """GET /status, less what the learner adds."""
        with self.lock:
            rows = self.registry.rows()
            for row in rows:
                if row["worker_id"] in self.integrity.quarantined:
                    row["state"] = "quarantined"
                row["delivered"] = self.ingestion.delivered(row["worker_id"])
            return {
                "learner_version": self.buffer.learner_version,
                "published_version": self.published_version,
                "workers": rows,
                **self.integrity.status(),
                "buffer_by_version": {str(k): v for k, v in self.buffer.contents_by_version().items()},
                **self.ingestion.status(),
                "scheduler_target": self.fleet.target() if self.fleet.scheduler else None,
                "scheduler_decisions": list(self.fleet.decisions)[-20:],  # all of them with a learner
                "broadcast": self.bcast.status(
                    {w.worker_id: w.name for w in self.workers.values()}, self.clock()
                ),
            }
