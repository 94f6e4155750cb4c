"""The coordinator's state machine: worker registry, heartbeats, leases, ingestion, snapshots.

Pure bookkeeping behind one lock, with an injectable clock: no sockets, no asyncio, so the HTTP
layer (coordinator.py), the learner thread and the tests all drive the same code. Ingestion is
all-or-nothing: a batch with one bad record is rejected whole, with a reason, and changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.broadcast.chunks import public_key_hex
from echo2.control.broadcast import (
    BroadcastPolicy,
    BroadcastState,
    NotKept,
    Peer,
    SnapshotBlob,
    WrongSnapshot,
    make_blob,
)
from echo2.control.provider import Provider
from echo2.control.scheduler import Decision, Role, Scheduler, WorkerView
from echo2.data.buffer import ReplayBuffer
from echo2.records import Trajectory

logger = logging.getLogger(__name__)

OFFER = "offer:"  # scheduler ids of a provider's slots that have no registered worker


class WorkerStatus(StrEnum):
    ACTIVE = "active"
    LOST = "lost"
    RELEASED = "released"
    """Stopped by the scheduler through a provider (not a failure)."""


class Rejected(Exception):
    """A request refused with an HTTP status and a reason; nothing was changed."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.status, self.reason, self.detail = status, reason, detail


@dataclass(slots=True, kw_only=True)
class WorkerInfo:
    worker_id: str
    name: str
    hardware: str
    price_per_hour: float
    inbound: bool
    last_seen: float
    registered_at: float
    relay_url: str | None = None
    """Where its relay server serves snapshot chunks to a child (None: never a parent)."""
    version: int = -1
    throughput: float = 0.0
    status: WorkerStatus = WorkerStatus.ACTIVE
    standby: bool = False
    """Registered and healthy but given no leases (the scheduler's reserve)."""
    samples: deque[tuple[float, float]] = field(default_factory=deque)
    """(time, trajectories/s) from heartbeats, for the scheduler's sliding window."""


@dataclass(slots=True, kw_only=True)
class Lease:
    lease_id: str
    worker_id: str
    indices: tuple[int, ...]
    group_ids: frozenset[str]
    deadline: float
    done_groups: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    vocab_size: int
    max_prompt_tokens: int
    max_new_tokens: int
    group_size: int


class CoordinatorState:
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
    ) -> None:
        self.scheduler = scheduler
        self.provider = provider
        """Starts standby workers as processes and stops released ones (None: standby workers are
        registered processes that get no leases)."""
        self.target = target
        """Throughput the pool should deliver (gamma * mu_min), or None while unknown."""
        self.window_s = window_s
        self.decisions: deque[dict] = deque(maxlen=200)
        """The scheduler's decisions, newest last, each with its time and reason (in /status)."""
        self.buffer = buffer
        self.limits = limits
        self.group_id_of = group_id_of
        self.lease_timeout = lease_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.clock = clock
        self.lock = threading.RLock()
        self.ready = threading.Condition(self.lock)  # notified when groups arrive or state changes
        self.workers: dict[str, WorkerInfo] = {}
        self.leases: dict[str, Lease] = {}
        self.signing_key = signing_key or Ed25519PrivateKey.generate()
        """Signs every snapshot manifest; its public half is handed to workers at registration."""
        self.public_key = public_key_hex(self.signing_key)
        self.bcast = BroadcastState(broadcast or BroadcastPolicy())
        """Kept snapshots, chain plans, peer scores, install times (control/broadcast.py)."""
        self.listeners: list[Callable[[], None]] = []
        """Called (from the publishing thread, outside the lock) after each publication."""
        self.keep = 1
        """Snapshot versions kept (S + 1; set by the learner at each publication)."""
        self.published_version = -1
        self.next_index = 0
        self.reissue: deque[int] = deque()
        self.rejected: Counter[str] = Counter()
        """Records refused at ingestion, by reason."""
        self.accepted = 0
        self.reissued = 0
        """Prompts put back in the queue (expired, returned or stale leases, lost workers)."""
        self.closed = False

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
        with self.lock:
            now = self.clock()
            info = WorkerInfo(
                worker_id=uuid.uuid4().hex[:12],
                name=name,
                hardware=hardware,
                price_per_hour=price_per_hour,
                inbound=inbound,
                last_seen=now,
                registered_at=now,
                relay_url=relay_url,
                throughput=throughput,
                # With a scheduler and a known target, newcomers wait in reserve until activated;
                # a provider only starts the workers the scheduler (or the run's start) asked for.
                standby=self.scheduler is not None
                and self.target() is not None
                and not (self.provider is not None and self.provider.owns(name)),
            )
            self.workers[info.worker_id] = info
            logger.info("worker joined: %s (%s, %s)", name, info.worker_id, hardware)
            return info

    def _worker(self, worker_id: str) -> WorkerInfo:
        info = self.workers.get(worker_id)
        if info is not None and info.status is WorkerStatus.RELEASED:
            raise Rejected(410, "released", f"worker {worker_id!r} was released by the scheduler; stop")
        if info is None or info.status is not WorkerStatus.ACTIVE:
            raise Rejected(404, "unknown_worker", f"worker {worker_id!r} is not registered; register again")
        info.last_seen = self.clock()
        return info

    def heartbeat(self, worker_id: str, *, version: int, throughput: float) -> None:
        with self.lock:
            info = self._worker(worker_id)
            if version > self.published_version:
                raise Rejected(
                    422, "future_version", f"version {version} > published {self.published_version}"
                )
            info.version = version
            if throughput > 0:
                info.throughput = throughput
                info.samples.append((self.clock(), throughput))
            if version >= 0:
                self.bcast.note_version(worker_id, version, self.clock())
                self.bcast.update_t_bcast(self._peers())

    def expire(self) -> None:
        """Mark silent workers lost and reissue expired leases (called periodically)."""
        with self.lock:
            now = self.clock()
            for info in self.workers.values():
                if info.status is WorkerStatus.ACTIVE and now - info.last_seen > self.heartbeat_timeout:
                    info.status = WorkerStatus.LOST
                    self.bcast.forget(info.worker_id)
                    logger.info(
                        "worker lost: %s (%s), silent %.1fs", info.name, info.worker_id, now - info.last_seen
                    )
                    if self.provider is not None and self.provider.owns(info.name):
                        self.provider.stop_slot(info.name, failed=True)
            for lease in list(self.leases.values()):
                owner = self.workers.get(lease.worker_id)
                lost = owner is None or owner.status is WorkerStatus.LOST
                if now > lease.deadline or lost:
                    self._reissue(lease)
            peers = self._peers()
            self.bcast.update_t_bcast(peers)  # the live set changed: a quantile may be reached now
            self.bcast.evict(self.keep, peers)
            if self.scheduler is not None:
                self._schedule(now)

    def _windowed_throughput(self, info: WorkerInfo, now: float) -> float:
        while info.samples and info.samples[0][0] < now - self.window_s:
            info.samples.popleft()
        if not info.samples:
            return info.throughput  # last report, or the rate declared at registration
        return sum(mu for _, mu in info.samples) / len(info.samples)

    def _schedule(self, now: float) -> None:
        target = self.target()
        if target is None:
            return
        roles = {WorkerStatus.LOST: Role.LOST, WorkerStatus.ACTIVE: Role.ACTIVE}
        views = [
            WorkerView(
                worker_id=w.worker_id,
                throughput=self._windowed_throughput(w, now),
                price=w.price_per_hour,
                role=Role.STANDBY if w.standby else roles[w.status],
            )
            for w in self.workers.values()
            if w.status is not WorkerStatus.RELEASED
        ]
        if self.provider is not None:
            live = {w.name for w in self.workers.values() if w.status is WorkerStatus.ACTIVE}
            # Started but not registered yet: count them, so the scheduler does not start more.
            views += [
                WorkerView(worker_id=OFFER + o.name, throughput=o.throughput, price=o.price, role=Role.ACTIVE)
                for o in self.provider.running()
                if o.name not in live
            ]
            views += [
                WorkerView(
                    worker_id=OFFER + o.name, throughput=o.throughput, price=o.price, role=Role.STANDBY
                )
                for o in self.provider.offers()
            ]
        for d in self.scheduler.decide(views, target=target, now=now):
            name = self._apply(d)
            self.decisions.append(
                {
                    "time": now,
                    "action": d.action,
                    "worker": name,
                    "worker_id": d.worker_id,
                    "reason": d.reason,
                }
            )
            logger.info("scheduler: %s %s (%s): %s", d.action, name, d.worker_id, d.reason)

    def _apply(self, d: Decision) -> str:
        """Carry out one decision; returns the worker's name."""
        if d.worker_id.startswith(OFFER):
            name = d.worker_id.removeprefix(OFFER)
            if d.action == "activate":
                self.provider.start_slot(name)
            else:  # started, not registered yet
                self.provider.stop_slot(name)
            return name
        info = self.workers[d.worker_id]
        if d.action == "release":
            for lease in [le for le in self.leases.values() if le.worker_id == d.worker_id]:
                self._reissue(lease)
            if self.provider is not None and self.provider.owns(info.name):
                self.provider.stop_slot(info.name)
                info.status = WorkerStatus.RELEASED
        info.standby = d.action == "release" and info.status is WorkerStatus.ACTIVE
        return info.name

    def _reissue(self, lease: Lease) -> None:
        del self.leases[lease.lease_id]
        todo = [i for i in lease.indices if self.group_id_of(i) not in lease.done_groups]
        self.reissue.extend(todo)
        self.reissued += len(todo)
        logger.info("lease %s of %s reissued (%d groups)", lease.lease_id, lease.worker_id, len(todo))

    # ------------------------------------------------------------------ leases
    def lease(self, worker_id: str, *, version: int, max_groups: int) -> Lease | None:
        """Prompts to generate, or None: nothing published yet, or the worker's installed version is
        already too old to be admitted (it should install the newest snapshot first)."""
        with self.lock:
            info = self._worker(worker_id)
            too_old = version < max(0, self.buffer.min_version())  # -1: nothing installed yet
            if self.published_version < 0 or self.closed or too_old or info.standby:
                return None
            indices = []
            while len(indices) < max_groups and self.reissue:
                indices.append(self.reissue.popleft())
            while len(indices) < max_groups:
                indices.append(self.next_index)
                self.next_index += 1
            lease = Lease(
                lease_id=uuid.uuid4().hex[:12],
                worker_id=worker_id,
                indices=tuple(indices),
                group_ids=frozenset(self.group_id_of(i) for i in indices),
                deadline=self.clock() + self.lease_timeout,
            )
            self.leases[lease.lease_id] = lease
            return lease

    def return_lease(self, worker_id: str, lease_id: str) -> None:
        with self.lock:
            self._worker(worker_id)
            lease = self.leases.get(lease_id)
            if lease is not None and lease.worker_id == worker_id:
                self._reissue(lease)

    # ------------------------------------------------------------------ ingestion
    def ingest(self, worker_id: str, lease_id: str, records: list[Trajectory]) -> dict[str, int]:
        """Store a batch whole or not at all. A retried batch is acknowledged, stored once."""
        with self.lock:
            self._worker(worker_id)
            fresh = [r for r in records if not self.buffer.seen(r.record_id)]
            if not fresh:
                return {"accepted": 0, "duplicates": len(records)}
            try:
                self._check_batch(worker_id, lease_id, fresh)
            except Rejected as e:
                self.rejected[e.reason] += len(fresh)
                lease = self.leases.get(lease_id)
                if e.reason == "stale" and lease is not None and lease.worker_id == worker_id:
                    self._reissue(lease)  # regenerate these prompts under a newer version
                raise
            lease = self.leases[lease_id]
            stored = self.buffer.add(fresh)
            assert stored == len(fresh), "validated records are all admitted"
            by_group = Counter(r.group_id for r in fresh)
            for gid in by_group:
                if self.buffer.group_count(gid) == self.limits.group_size:
                    lease.done_groups.add(gid)
            if lease.done_groups == lease.group_ids:
                del self.leases[lease_id]
            self.accepted += stored
            self.ready.notify_all()
            return {"accepted": stored, "duplicates": len(records) - len(fresh)}

    def _check_batch(self, worker_id: str, lease_id: str, records: list[Trajectory]) -> None:
        lease = self.leases.get(lease_id)
        if lease is None or lease.worker_id != worker_id:
            raise Rejected(409, "lease_expired", f"lease {lease_id!r} is not held by this worker")
        lim = self.limits
        floor = self.buffer.min_version()
        per_group = Counter(r.group_id for r in records)
        for r in records:
            where = f"record {r.record_id}"
            if r.group_id not in lease.group_ids:
                raise Rejected(422, "wrong_group", f"{where}: group {r.group_id} is not in lease {lease_id}")
            if r.version > self.published_version:
                raise Rejected(
                    422,
                    "future_version",
                    f"{where}: version {r.version} > published {self.published_version}",
                )
            if r.version < floor:
                raise Rejected(409, "stale", f"{where}: version {r.version} < learner version - S = {floor}")
            if len(r.prompt_ids) > lim.max_prompt_tokens or len(r.response_ids) > lim.max_new_tokens:
                raise Rejected(
                    422,
                    "too_long",
                    f"{where}: {len(r.prompt_ids)} prompt / {len(r.response_ids)} response tokens",
                )
            if not r.response_ids:
                raise Rejected(422, "malformed", f"{where}: empty response")
            if any(not 0 <= t < lim.vocab_size for t in r.prompt_ids + r.response_ids):
                raise Rejected(422, "out_of_vocab", f"{where}: token id outside [0, {lim.vocab_size})")
        for gid, n in per_group.items():
            if self.buffer.group_count(gid) + n > lim.group_size:
                raise Rejected(422, "group_overflow", f"group {gid}: more than {lim.group_size} records")

    # ------------------------------------------------------------------ snapshot broadcast
    @property
    def snapshots(self) -> dict[int, SnapshotBlob]:
        return self.bcast.snapshots

    @property
    def t_bcast(self) -> dict[int, float]:
        """Seconds from publication until 90% of the live workers ran each version."""
        return self.bcast.t_bcast[0.9]

    @property
    def t_bcast_all(self) -> dict[int, float]:
        """Seconds from publication until every live worker ran each version."""
        return self.bcast.t_bcast[1.0]

    def _peers(self) -> dict[str, Peer]:
        return {
            w.worker_id: Peer(worker_id=w.worker_id, relay_url=w.relay_url, registered_at=w.registered_at)
            for w in self.workers.values()
            if w.status is WorkerStatus.ACTIVE
        }

    def route(self, worker_id: str, version: int) -> tuple[str | None, str | None]:
        """Whom `worker_id` receives `version` from: (parent id, relay URL), or (None, None) for
        the learner."""
        with self.lock:
            self._worker(worker_id)
            try:
                return self.bcast.route(worker_id, version, self._peers())
            except NotKept:
                raise Rejected(404, "no_snapshot", f"version {version} is not kept") from None

    def report_failure(
        self, worker_id: str, version: int, parent_id: str | None, reason: str, detail: str = ""
    ) -> tuple[str | None, str | None]:
        """The receiver's parent failed; returns its new route."""
        with self.lock:
            self._worker(worker_id)
            logger.info(
                "broadcast of %d: %s reports parent %s: %s %s",
                version,
                worker_id,
                parent_id or "learner",
                reason,
                detail[:200],
            )
            try:
                return self.bcast.failure(worker_id, version, parent_id, reason, self._peers(), self.clock())
            except NotKept:
                raise Rejected(404, "no_snapshot", f"version {version} is not kept") from None

    def report_installed(
        self, worker_id: str, version: int, sha256: str, transfers: list[tuple[str | None, int, float]]
    ) -> None:
        """The worker runs `version` from now on (exact install time for T_bcast)."""
        with self.lock:
            info = self._worker(worker_id)
            if version > self.published_version:
                raise Rejected(
                    422, "future_version", f"version {version} > published {self.published_version}"
                )
            try:
                self.bcast.installed(worker_id, version, sha256, transfers, self._peers(), self.clock())
            except WrongSnapshot as e:
                raise Rejected(422, "wrong_snapshot", str(e)) from None
            info.version = max(info.version, version)
            self.bcast.evict(self.keep, self._peers())

    def record_bytes_served(self, n: int) -> None:
        with self.lock:
            self.bcast.bytes_served += n

    # ------------------------------------------------------------------ learner side
    def publish(self, version: int, data: bytes, *, keep: int) -> SnapshotBlob:
        """Cut, hash and sign the snapshot (outside the lock), plan its broadcast from the current
        scores, and keep it with the newest `keep` (S + 1) versions."""
        blob = make_blob(version, data, self.bcast.policy.chunk_size, self.signing_key)
        with self.lock:
            self.keep = keep
            self.published_version = version
            self.bcast.publish(blob, self._peers(), self.clock(), keep=keep)
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
            return self.buffer.take(num_groups)

    def set_learner_version(self, version: int) -> None:
        with self.lock:
            self.buffer.set_learner_version(version)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.ready.notify_all()
        for listener in list(self.listeners):
            listener()
