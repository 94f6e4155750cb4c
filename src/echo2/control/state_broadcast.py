"""Snapshot broadcast for `CoordinatorState` (control/state.py): routes, the receivers' failure,
install and transfer reports, and the kept snapshots, each under the state's lock, decided by
`BroadcastState` (control/broadcast.py) from the registry's live peers.

A mixin: `CoordinatorState` owns the lock, the registry and the broadcast bookkeeping. `route` and
`report_installed` are meant to be overridden by a subclass that wraps them (the broadcast benchmark
records their timing).
"""

from __future__ import annotations

import logging

from echo2.control.broadcast import NotKept, SnapshotBlob, WrongSnapshot
from echo2.control.errors import Invalid, NoSnapshot, Reason
from echo2.control.validate import printable

logger = logging.getLogger("echo2.control.state")


class BroadcastCalls:
    """`CoordinatorState`'s broadcast half (it sets `lock`, `bcast`, `registry`, `clock`, `keep`
    and `published_version`)."""

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

    def route(self, worker_id: str, version: int) -> tuple[str | None, str | None]:
        """Whom `worker_id` receives `version` from: (parent id, relay URL), or (None, None) for
        the learner."""
        with self.lock:
            self._worker(worker_id)
            try:
                return self.bcast.route(worker_id, version, self.registry.peers(), self.clock())
            except NotKept:
                raise NoSnapshot(f"version {version} is not kept") from None

    def relay_floor(self, worker_id: str, version: int, parent_id: str | None) -> float | None:
        """The rate floor (bytes/s) of `worker_id`'s route to `parent_id` for `version` (None: none)."""
        with self.lock:
            return self.bcast.relay_floor(worker_id, version, parent_id)

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
                printable(detail),
            )
            try:
                return self.bcast.failure(
                    worker_id, version, parent_id, reason, self.registry.peers(), self.clock()
                )
            except NotKept:
                raise NoSnapshot(f"version {version} is not kept") from None

    def report_installed(
        self, worker_id: str, version: int, sha256: str, transfers: list[tuple[str | None, int, float]]
    ) -> None:
        """The worker runs `version` from now on (exact install time for T_bcast)."""
        with self.lock:
            info = self._worker(worker_id)
            self._check_version(version)
            try:
                self.bcast.installed(
                    worker_id, version, sha256, transfers, self.registry.peers(), self.clock()
                )
            except WrongSnapshot as e:
                raise Invalid(Reason.WRONG_SNAPSHOT, str(e)) from None
            info.version = max(info.version, version)
            self.bcast.evict(self.keep, self.registry.peers())

    def report_sent(
        self, parent_id: str | None, version: int, child_id: str, nbytes: int, seconds: float
    ) -> None:
        """A parent's account of a stream it served (None: the learner's own, from the HTTP layer)."""
        with self.lock:
            if parent_id is not None:
                self._worker(parent_id)
            self.bcast.sent(parent_id, version, child_id, nbytes, seconds, self.clock())

    def record_bytes_served(self, n: int) -> None:
        with self.lock:
            self.bcast.bytes_served += n

    def blob(self, version: int | None = None) -> SnapshotBlob:
        """A kept snapshot (None: the newest published one)."""
        with self.lock:
            blob = self.bcast.snapshots.get(self.published_version if version is None else version)
        if blob is None:
            raise NoSnapshot("nothing published yet" if version is None else f"version {version} is not kept")
        return blob
