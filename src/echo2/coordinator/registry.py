"""The coordinator's worker registry: who is registered, when each was last heard, what it runs.

Pure bookkeeping with the caller's clock and the caller's ids: no lock (the coordinator's
state, state.py, holds one), no I/O, no id or key generation. Owns the workers' records, their heartbeat
samples for the scheduler's sliding window and their expiry (silent past `heartbeat_timeout`:
lost), and which throughput figure the scheduler and the lease sizing believe (`throughput`). Does
not know leases, snapshots or providers: a lost worker's leases, a lost provided worker's process
and what a worker delivered on its leases (leases.py: `Delivery`) are the state's parts' to handle.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from echo2.broadcast.tracker import Peer
from echo2.wire.errors import Released, UnknownWorker
from echo2.wire.validate import printable

logger = logging.getLogger(__name__)


class WorkerStatus(StrEnum):
    ACTIVE = "active"
    LOST = "lost"
    RELEASED = "released"
    """Stopped by the scheduler through a provider (not a failure)."""


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
    """The worker's own figure: declared at registration (`echo2 worker --throughput`, an emulated
    rate), then the last positive heartbeat report (its calibration, then its last lease's rate)."""
    status: WorkerStatus = WorkerStatus.ACTIVE
    standby: bool = False
    """Registered and healthy but given no leases (the scheduler's reserve)."""
    provided: bool = False
    """Started by the provider under its offer's name: released through it, stopped when lost."""
    secret_digest: bytes = b""
    """SHA-256 of the credential issued at registration (wire/identity.py); empty: none yet."""
    samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    """(time, trajectories/s) from heartbeats, for the scheduler's sliding window."""


SAMPLES = 1024
"""Heartbeat samples kept per worker (the window drops older ones; this bounds memory without it)."""


class Registry:
    def __init__(self, *, heartbeat_timeout: float, window_s: float = 30.0) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.window_s = window_s
        self.workers: dict[str, WorkerInfo] = {}
        self._peers: dict[str, Peer] | None = None
        """`peers()`, kept until the live set changes (a heartbeat must not rebuild it)."""

    def add(
        self,
        worker_id: str,
        *,
        name: str,
        hardware: str,
        price_per_hour: float,
        inbound: bool,
        throughput: float,
        relay_url: str | None,
        standby: bool,
        provided: bool,
        now: float,
    ) -> WorkerInfo:
        assert worker_id not in self.workers, f"worker id {worker_id!r} issued twice"
        info = WorkerInfo(
            worker_id=worker_id,
            name=name,
            hardware=hardware,
            price_per_hour=price_per_hour,
            inbound=inbound,
            last_seen=now,
            registered_at=now,
            relay_url=relay_url,
            throughput=throughput,
            standby=standby,
            provided=provided,
        )
        self.workers[worker_id] = info
        self._peers = None
        logger.info("worker joined: %s (%s, %s)", printable(name), worker_id, printable(hardware))
        return info

    def get(self, worker_id: str, now: float) -> WorkerInfo:
        """The active worker `worker_id`, marked as heard from at `now`."""
        info = self.workers.get(worker_id)
        if info is not None and info.status is WorkerStatus.RELEASED:
            raise Released(f"worker {worker_id!r} was released by the scheduler; stop")
        if info is None or info.status is not WorkerStatus.ACTIVE:
            raise UnknownWorker(f"worker {worker_id!r} is not registered; register again")
        info.last_seen = now
        return info

    def is_lost(self, worker_id: str) -> bool:
        info = self.workers.get(worker_id)
        return info is None or info.status is WorkerStatus.LOST

    @staticmethod
    def sample(info: WorkerInfo, throughput: float, now: float) -> None:
        """A heartbeat's throughput (ignored when not positive: nothing measured yet)."""
        if throughput > 0:
            info.throughput = throughput
            info.samples.append((now, throughput))

    def expire(self, now: float) -> list[WorkerInfo]:
        """Mark workers silent for over `heartbeat_timeout` lost; returns them."""
        lost = []
        for info in self.workers.values():
            if info.status is WorkerStatus.ACTIVE and now - info.last_seen > self.heartbeat_timeout:
                info.status = WorkerStatus.LOST
                lost.append(info)
                logger.info(
                    "worker lost: %s (%s), silent %.1fs",
                    printable(info.name),
                    info.worker_id,
                    now - info.last_seen,
                )
        if lost:
            self._peers = None
        return lost

    def release(self, info: WorkerInfo) -> None:
        """The scheduler stopped this worker through its provider."""
        info.status = WorkerStatus.RELEASED
        self._peers = None

    def purge(self, now: float, after: float) -> list[str]:
        """Forget workers lost (or released) and silent for over `after` seconds; returns their ids.
        A purged worker that comes back is told to register again, as a lost one is."""
        gone = [
            w.worker_id
            for w in self.workers.values()
            if w.status is not WorkerStatus.ACTIVE and now - w.last_seen > after
        ]
        for worker_id in gone:
            del self.workers[worker_id]
        return gone

    def windowed_throughput(self, info: WorkerInfo, now: float) -> float:
        """Mean of the heartbeats of the last `window_s` (older samples are dropped), else the last
        report, or the rate declared at registration."""
        while info.samples and info.samples[0][0] < now - self.window_s:
            info.samples.popleft()
        if not info.samples:
            return info.throughput
        return sum(mu for _, mu in info.samples) / len(info.samples)

    def throughput(self, info: WorkerInfo, now: float, *, delivered: float | None) -> float | None:
        """The figure the scheduler ranks and sizes leases by: what the coordinator measured the
        worker deliver (`delivered`), once it has, so that a worker cannot talk its figure up; until
        then the worker's own (`windowed_throughput`). None: no figure yet."""
        if delivered is not None:
            return delivered
        mu = self.windowed_throughput(info, now)
        return mu if mu > 0 else None

    def peers(self) -> dict[str, Peer]:
        """The live workers, as the broadcast bookkeeping knows them (shared: do not modify)."""
        if self._peers is None:
            self._peers = {
                w.worker_id: Peer(worker_id=w.worker_id, relay_url=w.relay_url, registered_at=w.registered_at)
                for w in self.workers.values()
                if w.status is WorkerStatus.ACTIVE
            }
        return self._peers

    def rows(self) -> list[dict]:
        """The workers as GET /status lists them."""
        return [
            {
                "worker_id": w.worker_id,
                "name": w.name,
                "state": "standby" if w.standby and w.status.value == "active" else w.status.value,
                "version": w.version,
                "throughput": w.throughput,
                "price_per_hour": w.price_per_hour,
                "inbound": w.inbound,
                "hardware": w.hardware,
            }
            for w in self.workers.values()
        ]
