"""The coordinator's publisher: signs and keeps each snapshot the learner publishes, and answers the
receivers' broadcast calls (routes, failures, installs, transfers), under the state's one lock
(shared.py).

Owns the signing key, the kept snapshots and their broadcast bookkeeping (`BroadcastState`,
control/broadcast.py, pure: chain plans, peer scores, install times, T_bcast), the number of
versions kept, and the listeners woken after each publication. The live peers come from the
registry. A snapshot is cut, hashed and signed outside the lock. Knows no HTTP and no leases.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.broadcast.chunks import public_key_hex
from echo2.control.broadcast import (
    BroadcastPolicy,
    BroadcastState,
    NotKept,
    SnapshotBlob,
    WrongSnapshot,
    make_blob,
)
from echo2.control.errors import Invalid, NoSnapshot, Reason
from echo2.control.registry import Registry
from echo2.control.shared import Shared
from echo2.control.validate import printable

logger = logging.getLogger(__name__)


class Publisher:
    def __init__(
        self,
        shared: Shared,
        registry: Registry,
        *,
        policy: BroadcastPolicy | None = None,
        signing_key: Ed25519PrivateKey | None = None,
    ) -> None:
        self.shared = shared
        self.registry = registry
        self.bcast = BroadcastState(policy or BroadcastPolicy())
        """Kept snapshots, chain plans, peer scores, install times (control/broadcast.py)."""
        # A throwaway key when none is given (tools and tests that do not check signatures); runs
        # pass the learner's key (control/remote.py).
        self.signing_key = signing_key or Ed25519PrivateKey.generate()
        """Signs every snapshot manifest; its public half is handed to workers at registration."""
        self.public_key = public_key_hex(self.signing_key)
        self.keep = 1
        """Snapshot versions kept (S + 1; set by the learner at each publication)."""
        self.listeners: list[Callable[[], None]] = []
        """Called (from the publishing thread, outside the lock) after each publication and at close."""

    @property
    def t_bcast(self) -> dict[int, float]:
        """Seconds from publication until 90% of the live workers ran each version."""
        return self.bcast.installs.t_bcast[0.9]

    @property
    def t_bcast_all(self) -> dict[int, float]:
        """Seconds from publication until every live worker ran each version."""
        return self.bcast.installs.t_bcast[1.0]

    # ------------------------------------------------------------------ learner side
    def publish(self, version: int, data: bytes, *, keep: int) -> SnapshotBlob:
        """Cut, hash and sign the snapshot (outside the lock), plan its broadcast from the current
        scores, and keep it with the newest `keep` (S + 1) versions."""
        blob = make_blob(version, data, self.bcast.policy.chunk_size, self.signing_key)
        with self.shared.lock:
            self.keep = keep
            self.shared.published_version = version
            self.bcast.publish(blob, self.registry.peers(), self.shared.clock(), keep=keep)
            self.shared.ready.notify_all()
        self.wake()
        logger.info("version published: %d (%.1f MB)", version, len(data) / 1e6)
        return blob

    def wake(self) -> None:
        """Call the listeners (outside the lock)."""
        for listener in list(self.listeners):
            listener()

    def blob(self, version: int | None = None) -> SnapshotBlob:
        """A kept snapshot (None: the newest published one)."""
        with self.shared.lock:
            blob = self.bcast.snapshots.get(self.shared.published_version if version is None else version)
        if blob is None:
            raise NoSnapshot("nothing published yet" if version is None else f"version {version} is not kept")
        return blob

    # ------------------------------------------------------------------ the receivers' calls
    def route(self, worker_id: str, version: int) -> tuple[str | None, str | None]:
        """Whom `worker_id` receives `version` from: (parent id, relay URL), or (None, None) for
        the learner."""
        with self.shared.lock:
            now = self.shared.clock()
            self.registry.get(worker_id, now)
            try:
                return self.bcast.route(worker_id, version, self.registry.peers(), now)
            except NotKept:
                raise NoSnapshot(f"version {version} is not kept") from None

    def relay_floor(self, worker_id: str, version: int, parent_id: str | None) -> float | None:
        """The rate floor (bytes/s) of `worker_id`'s route to `parent_id` for `version` (None: none)."""
        with self.shared.lock:
            return self.bcast.relay_floor(worker_id, version, parent_id)

    def report_failure(
        self, worker_id: str, version: int, parent_id: str | None, reason: str, detail: str = ""
    ) -> tuple[str | None, str | None]:
        """The receiver's parent failed; returns its new route."""
        with self.shared.lock:
            now = self.shared.clock()
            self.registry.get(worker_id, now)
            logger.info(
                "broadcast of %d: %s reports parent %s: %s %s",
                version,
                worker_id,
                parent_id or "learner",
                reason,
                printable(detail),
            )
            try:
                return self.bcast.failure(worker_id, version, parent_id, reason, self.registry.peers(), now)
            except NotKept:
                raise NoSnapshot(f"version {version} is not kept") from None

    def report_installed(
        self, worker_id: str, version: int, sha256: str, transfers: list[tuple[str | None, int, float]]
    ) -> None:
        """The worker runs `version` from now on (exact install time for T_bcast)."""
        with self.shared.lock:
            now = self.shared.clock()
            info = self.registry.get(worker_id, now)
            self.shared.check_version(version)
            try:
                self.bcast.installed(worker_id, version, sha256, transfers, self.registry.peers(), now)
            except WrongSnapshot as e:
                raise Invalid(Reason.WRONG_SNAPSHOT, str(e)) from None
            info.version = max(info.version, version)
            self.bcast.evict(self.keep, self.registry.peers())

    def report_sent(
        self, parent_id: str | None, version: int, child_id: str, nbytes: int, seconds: float
    ) -> None:
        """A parent's account of a stream it served (None: the learner's own, from the HTTP layer)."""
        with self.shared.lock:
            now = self.shared.clock()
            if parent_id is not None:
                self.registry.get(parent_id, now)
            self.bcast.sent(parent_id, version, child_id, nbytes, seconds, now)

    def record_bytes_served(self, n: int) -> None:
        with self.shared.lock:
            self.bcast.bytes_served += n

    # ------------------------------------------------------------------ under the state's lock
    def note_version(self, worker_id: str, version: int, now: float) -> None:
        """A heartbeat says the worker runs `version` (an upper bound of its install time)."""
        if version >= 0 and self.bcast.note_version(worker_id, version, now):  # O(1) otherwise
            self.bcast.installs.update(self.registry.peers())

    def lost(self, workers: list[str]) -> None:
        """An expiry round: `workers` were lost; the live set changed, so a quantile of T_bcast may
        be reached now and a snapshot only they were receiving may go."""
        for worker_id in workers:
            self.bcast.forget(worker_id)
        peers = self.registry.peers()
        self.bcast.installs.update(peers)
        self.bcast.evict(self.keep, peers)

    def status(self) -> dict:
        names = {w.worker_id: w.name for w in self.registry.workers.values()}
        return self.bcast.status(names, self.shared.clock())
