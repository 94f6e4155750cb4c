"""The coordinator's publisher: signs and keeps each snapshot the learner publishes, and answers the
receivers' broadcast calls (routes, failures, installs, transfers), under the state's one lock
(shared.py).

Owns the signing key, the kept snapshots and their broadcast bookkeeping (`BroadcastState`,
broadcast/tracker.py, pure: chain plans, peer scores, install times, T_bcast), the number of
versions kept, and the listeners woken after each publication. The live peers come from the
registry. A snapshot is cut, hashed and signed outside the lock. Knows no HTTP and no leases.

**Deltas** (`BroadcastPolicy.delta`, issue 24). Beside each snapshot it publishes, when smaller, a
delta from the previous published version (broadcast/delta.py), chunked and signed like a full
snapshot; its manifest says form "delta", the base's version and SHA-256, and the full snapshot's
SHA-256 (the install check). The base's bytes are the previous kept snapshot's (kept anyway, S + 1
versions), so keeping deltas costs the learner only their own bytes; a delta goes with its version.
Each worker is told its form on its route: the delta if the version it holds (`RouteRequest.base`)
is the delta's base, else (new, behind by more than one publication, or a delta that failed to
apply or verify: `full`) the full snapshot. The chains carry the delta: a worker receiving the full
snapshot of a version that has a delta is taken out of that version's chains (its children
reattach upstream) and fed by the learner, so no relay is asked for a form it does not hold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.broadcast import delta as codec
from echo2.broadcast.blob import NotKept, SnapshotBlob, make_blob
from echo2.broadcast.chunks import make_manifest, public_key_hex, sha256_hex
from echo2.broadcast.tracker import BroadcastPolicy, BroadcastState, WrongSnapshot
from echo2.coordinator.registry import Registry
from echo2.coordinator.shared import Shared
from echo2.wire.errors import Invalid, NoSnapshot, Reason
from echo2.wire.validate import printable

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
        """Kept snapshots, chain plans, peer scores, install times (broadcast/tracker.py)."""
        # A throwaway key when none is given (tools and tests that do not check signatures); runs
        # pass the learner's key (learning/sources/remote.py).
        self.signing_key = signing_key or Ed25519PrivateKey.generate()
        """Signs every snapshot manifest; its public half is handed to workers at registration."""
        self.public_key = public_key_hex(self.signing_key)
        self.keep = 1
        """Snapshot versions kept (S + 1; set by the learner at each publication)."""
        self.listeners: list[Callable[[], None]] = []
        """Called (from the publishing thread, outside the lock) after each publication and at close."""
        self.deltas: dict[int, SnapshotBlob] = {}
        """Per kept version, its delta from the previous published version (when one was smaller)."""
        self.forms: dict[int, dict[str, str]] = {}
        """Per version with a delta, the form each worker routed for it receives."""
        self.delta_stats = {"published": 0, "skipped": 0, "bytes": 0, "full_bytes": 0}
        """Deltas published, skipped (no base, not smaller, unreadable), their bytes and the full
        snapshots' bytes of the same versions."""

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
            base = self.bcast.snapshots.get(max(self.bcast.snapshots, default=-1))
        delta = self._delta(base, blob) if self.bcast.policy.delta and base is not None else None
        with self.shared.lock:
            self.keep = keep
            self.shared.published_version = version
            if delta is not None:
                self.deltas[version] = delta
                self.forms[version] = {}
            self.bcast.publish(blob, self.registry.peers(), self.shared.clock(), keep=keep)
            self._prune()
            self.shared.ready.notify_all()
        self.wake()
        logger.info(
            "version published: %d (%.1f MB%s)",
            version,
            len(data) / 1e6,
            f"; delta from {base.version}: {len(delta.data) / 1e6:.2f} MB" if delta is not None else "",
        )
        return blob

    def _delta(self, base: SnapshotBlob, blob: SnapshotBlob) -> SnapshotBlob | None:
        """The delta from `base` to `blob`, signed (outside the lock); None where it is no smaller
        or a snapshot is not safetensors (then workers receive the full one, as without deltas)."""
        if base.version >= blob.version:
            return None
        try:
            data = codec.encode(base.data, blob.data, base_version=base.version, version=blob.version)
        except ValueError as e:  # not safetensors bytes (tools and tests publishing raw bytes)
            logger.warning("version %d: no delta (%s)", blob.version, e)
            self.delta_stats["skipped"] += 1
            return None
        if len(data) >= len(blob.data):
            self.delta_stats["skipped"] += 1
            return None
        manifest, chunks = make_manifest(
            blob.version,
            memoryview(data),
            self.bcast.policy.chunk_size,
            self.signing_key,
            form="delta",
            base_version=base.version,
            base_sha256=base.sha256,
            sha256=blob.sha256,
        )
        self.delta_stats["published"] += 1
        self.delta_stats["bytes"] += len(data)
        self.delta_stats["full_bytes"] += len(blob.data)
        return SnapshotBlob(
            version=blob.version, data=data, sha256=sha256_hex(data), manifest=manifest, chunks=chunks
        )

    def _prune(self) -> None:
        """Deltas go with their versions (under the lock)."""
        for v in [v for v in self.deltas if v not in self.bcast.snapshots]:
            del self.deltas[v]
            self.forms.pop(v, None)

    def wake(self) -> None:
        """Call the listeners (outside the lock)."""
        for listener in list(self.listeners):
            listener()

    def blob(self, version: int | None = None, form: str = "full") -> SnapshotBlob:
        """A kept snapshot, or its delta (None: the newest published one)."""
        with self.shared.lock:
            v = self.shared.published_version if version is None else version
            blob = (self.bcast.snapshots if form == "full" else self.deltas).get(v)
        if blob is None:
            if version is None:
                raise NoSnapshot("nothing published yet")
            raise NoSnapshot(f"version {version} is not kept" + (" as a delta" if form != "full" else ""))
        return blob

    # ------------------------------------------------------------------ the receivers' calls
    def route(
        self, worker_id: str, version: int, *, base: int | None = None, full: bool = False
    ) -> tuple[str | None, str | None, str]:
        """Whom `worker_id` receives `version` from and in which form: (parent id, relay URL,
        "full" | "delta"); (None, None, form) is the learner. The delta if the worker holds its
        base (`base`) and did not ask for the `full` snapshot, nor was given it for this version."""
        with self.shared.lock:
            now = self.shared.clock()
            self.registry.get(worker_id, now)
            peers = self.registry.peers()
            try:
                delta, forms = self.deltas.get(version), self.forms.get(version, {})
                if delta is None:
                    return (*self.bcast.route(worker_id, version, peers, now), "full")
                if not full and forms.get(worker_id) != "full" and base == delta.manifest.base_version:
                    forms[worker_id] = "delta"
                    return (*self.bcast.route(worker_id, version, peers, now), "delta")
                forms[worker_id] = "full"
                return (*self._from_learner(worker_id, version, now), "full")
            except NotKept:
                raise NoSnapshot(f"version {version} is not kept") from None

    def _from_learner(self, worker_id: str, version: int, now: float) -> tuple[None, None]:
        """The full snapshot of a version whose chains carry its delta: out of the chains (its
        children reattach upstream; it gets none), fed by the learner (under the lock)."""
        bcast = self.bcast
        if version not in bcast.plans:
            raise NotKept(version)
        bcast.plans[version] = bcast.plans[version].excise(worker_id)
        bcast.leaf_only[version].add(worker_id)
        if not bcast.installs.runs(worker_id, version):
            bcast.receiving[version].add(worker_id)
        bcast.ledger.route(version, None, worker_id, now)
        return None, None

    def relay_floor(self, worker_id: str, version: int, parent_id: str | None) -> float | None:
        """The rate floor (bytes/s) of `worker_id`'s route to `parent_id` for `version` (None: none)."""
        with self.shared.lock:
            return self.bcast.relay_floor(worker_id, version, parent_id)

    def report_failure(
        self, worker_id: str, version: int, parent_id: str | None, reason: str, detail: str = ""
    ) -> tuple[str | None, str | None, str]:
        """The receiver's parent failed; returns its new route, in the same form."""
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
                form = self.forms.get(version, {}).get(worker_id, "full")
                if form == "full" and version in self.deltas:  # fed by the learner, out of the chains
                    self.bcast.failures[reason] += 1
                    return (*self._from_learner(worker_id, version, now), form)
                return (
                    *self.bcast.failure(worker_id, version, parent_id, reason, self.registry.peers(), now),
                    form,
                )
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
            self._prune()

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
        self._prune()

    def status(self) -> dict:
        names = {w.worker_id: w.name for w in self.registry.workers.values()}
        full = self.delta_stats["full_bytes"]
        return {
            **self.bcast.status(names, self.shared.clock()),
            "delta": {
                **self.delta_stats,
                "ratio": self.delta_stats["bytes"] / full if full else None,
                "kept": sorted(self.deltas),
            },
        }
