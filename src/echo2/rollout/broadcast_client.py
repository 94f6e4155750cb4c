"""The receiving side of snapshot broadcast: `BroadcastClient` asks the coordinator for its parent,
streams chunks from it, verifies each against the signed manifest before storing it, and on a dead,
stalled or lying parent reports it and resumes from its first missing chunk with the new parent.
The API is described in broadcast/relay.py's docstring. It lives in rollout/, not broadcast/, because
it talks to the coordinator: broadcast/ sits below coordinator/ and imports none of it. It does not
read the registration: the worker's `Membership` (rollout/membership.py) builds it from the reply.

Every call to the coordinator goes through the worker's `CoordinatorClient` (wire/client.py:
typed refusals, one retry policy); chunk streams use that client's session with their own progress
timeout, since a stream is not a coordinator call. A relay is untrusted: it is sent no credential,
its redirects are not followed, and one whose chunks arrive slower than `min_rate_bps` (measured
over a progress timeout of reading) is reported stalled, like one that sends nothing. A route may
carry the coordinator's own floor (`Route.min_rate_bps`, a fraction of the peers' rate): a relay
below it is reported "slow" and the coordinator demotes it.

**Deltas** (issue 24). The route says the form: "delta" when the coordinator has one from the
version this worker holds (`RouteRequest.base`). The delta's chunks are verified against its own
signed manifest and kept in a second store (`deltas`), so the relay forwards them down the chain
like any chunks; once complete, the delta is applied on the held base (broadcast/delta.py: the
base's SHA-256, then the result's against the manifest's `sha256`, the full snapshot's). On
BaseMismatch or any verification error the worker asks for the full snapshot (`full`), which the
coordinator then sends it from the learner. Memory: the worker holds the installed version's bytes
as its base (one copy of the snapshot in the wire dtype, in host memory; the chunk store already
held the last two received versions before deltas, so this is no more); while a delta is applied,
the base, the rebuilt snapshot and the delta are held together (two copies plus the delta).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from echo2.aio import sleep_unless, unless
from echo2.broadcast import delta as codec
from echo2.broadcast.chunks import Manifest, SnapshotBytes, VerificationError, manifest_of
from echo2.broadcast.meter import ParentFailed
from echo2.broadcast.relay import ChunkStore, mbit
from echo2.config import BroadcastConfig
from echo2.rollout.chunk_download import ChunkDownload, DroppedVersion
from echo2.wire.client import CoordinatorClient
from echo2.wire.errors import NoSnapshot, Refused
from echo2.wire.protocol import FailureRequest, InstalledRequest, Route, RouteRequest

logger = logging.getLogger(__name__)


class BroadcastError(Exception):
    """A version could not be received (no longer kept by the learner, or too many failures)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Receiving:
    """How a worker receives snapshots: the run's `broadcast` section as the registration reply
    carries it, with this worker's own download cap (`Receiving.of`)."""

    progress_timeout: float = 10.0
    """Seconds one read from the parent may wait (keep-alives come well within it)."""
    min_rate_bps: float = 0.0
    """A relay delivering a chunk slower than this (bytes/s) is reported stalled; 0: no floor."""
    download_mbps: float | None = None
    """Cap on what this worker receives, Mbit/s; None: uncapped."""
    max_failures: int = 20
    """Parents one version may go through before `fetch` gives up."""

    @classmethod
    def of(cls, broadcast: BroadcastConfig, *, download_mbps: float | None = None) -> Receiving:
        """From the run's `broadcast` section; a `download_mbps` given overrides the run's cap."""
        return cls(
            progress_timeout=broadcast.progress_timeout_s,
            min_rate_bps=(broadcast.min_relay_mbps or 0.0) * 1e6 / 8,
            download_mbps=download_mbps if download_mbps is not None else broadcast.worker_download_mbps,
        )


class BroadcastClient:
    """Receives snapshots for one registered worker: route, stream, verify, store, report.

    `worker_id` and `public_key` are plain attributes (a worker that registers again updates
    them)."""

    def __init__(
        self,
        coordinator: CoordinatorClient,
        store: ChunkStore,
        receiving: Receiving,
        *,
        worker_id: str,
        public_key: str,
        deltas: ChunkStore | None = None,
    ) -> None:
        self.coordinator, self.store, self.receiving = coordinator, store, receiving
        self.deltas = deltas if deltas is not None else ChunkStore()
        """Verified chunks of deltas (what this worker's relay serves for `?form=delta`)."""
        self.base: tuple[int, SnapshotBytes] | None = None
        """The installed version and its bytes: what a delta is applied on."""
        self.delta_fallbacks: list[tuple[int, str]] = []
        """(version, why) of every delta that did not install, so the full snapshot was fetched."""
        self.forms: dict[int, str] = {}
        """The form each received version came in ("full" or "delta")."""
        self.worker_id, self.public_key = worker_id, public_key
        self.progress_timeout = receiving.progress_timeout
        self.download_bucket = mbit(receiving.download_mbps)
        self._newest = -1
        self._rewind = asyncio.Event()
        self.transfers: dict[int, list[dict[str, Any]]] = {}
        """Per version, the stream segments that ended cleanly: parent_id, bytes, seconds."""
        self.digests: dict[int, str] = {}
        """SHA-256 of each received snapshot, computed once (install report, callers' checks)."""
        self.failures: list[tuple[int, str | None, str]] = []
        """(version, parent_id, reason) of every parent this client reported."""
        self.refused: dict[int, str] = {}
        """Versions whose manifest was refused (bad signature, malformed), and why."""
        self.installed_version = -1

    # ------------------------------------------------------------------ coordinator calls
    async def wait_published(self, after: int = -1, wait: float = 20.0) -> int:
        """The newest published version, as soon as it is newer than `after` (or after `wait` s)."""
        return await self.coordinator.published(after=after, wait=wait)

    async def manifest(self, version: int, form: str = "full") -> Manifest:
        """The version's manifest (of its delta: `form="delta"`), its signature checked against
        the learner's key, in that form's store."""
        store = self.store if form == "full" else self.deltas
        if version in store.manifests:
            return store.manifests[version]
        try:
            data = await self.coordinator.manifest(version, form)
        except NoSnapshot:
            raise BroadcastError(f"version {version} is not kept by the learner ({form})") from None
        try:
            manifest = manifest_of(data, version, self.public_key, form)
        except VerificationError as e:  # nothing stored
            self.refused[version] = str(e)
            raise
        store.add_manifest(manifest)
        return manifest

    def hold(self, version: int, data: SnapshotBytes) -> None:
        """`version` is installed from `data`: it is the base of the next delta (the older base
        and full copies it replaces are let go)."""
        if self.base is None or version > self.base[0]:
            self.base = (version, data)
            self.store.forget_older(version)

    async def _route(
        self, version: int, failed: tuple[str | None, ParentFailed] | None = None, *, full: bool = False
    ) -> Route:
        try:
            if failed is None:
                base = self.base[0] if self.base is not None else None
                req = RouteRequest(worker_id=self.worker_id, version=version, base=base, full=full)
                return await self.coordinator.route(req)
            parent_id, err = failed
            req = FailureRequest(
                worker_id=self.worker_id,
                version=version,
                parent_id=parent_id,
                reason=err.reason,
                detail=err.detail[:1000],
            )
            return await self.coordinator.report_failure(req)
        except NoSnapshot:
            raise BroadcastError(f"version {version} is no longer kept by the learner") from None

    async def report_installed(self, version: int, data: SnapshotBytes | bytes) -> None:
        """Tell the coordinator this worker runs `version` now (its T_bcast) and how the chunks came."""
        digest = self.digests.get(version) or await asyncio.to_thread(
            data.sha256 if isinstance(data, SnapshotBytes) else lambda: hashlib.sha256(data).hexdigest()
        )
        req = InstalledRequest(
            worker_id=self.worker_id,
            version=version,
            sha256=digest,
            transfers=self.transfers.pop(version, [])[-256:],
        )
        await self.coordinator.report_installed(req)

    # ------------------------------------------------------------------ receiving
    async def fetch(self, version: int) -> SnapshotBytes:
        """Receive `version` (resuming from chunks already held) and return it once every chunk is
        verified, as its chunks (`bytes(data)` joins them).

        Raises VerificationError if the manifest's signature is bad (nothing is stored),
        BroadcastError if the learner no longer keeps the version or `max_failures` parents failed,
        and Refused/Unreachable if the coordinator refuses or cannot be reached."""
        self.transfers.setdefault(version, [])
        route = await self._route(version)
        if route.form == "delta":
            try:
                return await self._fetch_delta(version, route)
            except (VerificationError, BroadcastError) as e:  # BaseMismatch included
                logger.warning("version %d: delta not installed (%s); fetching the full snapshot", version, e)
                self.delta_fallbacks.append((version, str(e)))
                route = await self._route(version, full=True)
        self.deltas.skip(version)  # our relay's children are told at once we will not hold it
        manifest = await self.manifest(version)
        await self._receive(version, manifest, route, self.store)
        self.forms[version] = "full"
        # Not joined (the install reads it tensor by tensor); hashed once, off the event loop
        # (relays go on); the hash goes in the install report.
        data = self.store.snapshot(version)
        self._digest(version, await asyncio.to_thread(data.sha256))
        return data

    async def _fetch_delta(self, version: int, route: Route) -> SnapshotBytes:
        """Receive the delta of `version` and rebuild the snapshot on the held base: bit for bit
        the full snapshot, its SHA-256 the signed manifest's. VerificationError (BaseMismatch: not
        our base) if it cannot be."""
        manifest = await self.manifest(version, "delta")
        base = self.base
        if base is None or base[0] != manifest.base_version:
            raise codec.BaseMismatch(
                f"the delta applies to version {manifest.base_version}, this worker holds "
                f"{base[0] if base is not None else 'none'}"
            )
        await self._receive(version, manifest, route, self.deltas)
        delta = self.deltas.assemble(version)  # small: joined
        rebuilt = await asyncio.to_thread(_rebuild, base[1], delta, manifest)
        self.store.skip(version)
        self.forms[version] = "delta"
        self._digest(version, manifest.sha256)  # `_rebuild` checked the bytes against it
        return SnapshotBytes([rebuilt], max(len(rebuilt), 1), sha256=manifest.sha256)  # not copied

    def _digest(self, version: int, sha256: str) -> None:
        self.digests[version] = sha256
        for old in [v for v in self.digests if v < version - 8]:
            del self.digests[old]

    async def _receive(self, version: int, manifest: Manifest, route: Route, store: ChunkStore) -> None:
        """Every chunk of `manifest` into `store`, from `route`'s parent and those the coordinator
        names after each failure."""
        failures = 0
        while (start := self._first_missing(version, store)) is not None:
            try:
                await self._stream(version, manifest, route, start, store)
            except ParentFailed as failed:
                failures += 1
                self.failures.append((version, route.parent_id, failed.reason))
                parent = route.parent_id or "learner"
                logger.info("version %d: parent %s failed (%s)", version, parent, failed)
                if failures > self.receiving.max_failures:
                    raise BroadcastError(f"version {version}: {failures} parents failed") from failed
                if route.parent_id is None:  # the learner itself: do not hammer it
                    await asyncio.sleep(self.coordinator.retry.delay(failures))
                route = await self._route(version, (route.parent_id, failed))

    def _first_missing(self, version: int, store: ChunkStore | None = None) -> int | None:
        store = store or self.store
        if version not in store.manifests:
            raise BroadcastError(f"version {version} was superseded while it was being received")
        return store.first_missing(version)

    async def _stream(
        self, version: int, manifest: Manifest, route: Route, start: int, store: ChunkStore | None = None
    ) -> None:
        """One streaming GET on the parent, from chunk `start` to the end (chunk_download.py);
        raises ParentFailed on anything but a complete, valid stream."""
        store = store or self.store
        relay = route.url is not None
        started = time.monotonic()
        try:
            received = await ChunkDownload(
                self.coordinator.session,
                progress_timeout=self.progress_timeout,
                download_bucket=self.download_bucket,
                min_rate_bps=self.receiving.min_rate_bps,
            ).get(
                route.url or self.coordinator.url,
                version,
                manifest,
                store,
                start=start,
                relay_floor_bps=route.min_rate_bps if relay else None,
                # only the learner gets our credential; a relay is told who we are and nothing else
                child=self.worker_id if relay else None,
                headers={} if relay else self.coordinator.auth_headers(worker_id=self.worker_id),
            )
        except DroppedVersion:  # superseded while received: not the parent's fault
            self._first_missing(version, store)
            raise
        self.transfers[version].append(
            {"parent_id": route.parent_id, "bytes": received, "seconds": max(time.monotonic() - started, 1e-6)}
        )

    # ------------------------------------------------------------------ following
    async def follow(
        self,
        stop: asyncio.Event,
        install: Callable[[int, SnapshotBytes], Awaitable[None]],
        *,
        retry_s: float = 1.0,
    ) -> None:
        """Until `stop`: wait for each newer published version, receive it (one task per version,
        so a slow one does not hold up its successor), `install` it unless something newer is
        installed already, and report the install. Errors are logged and retried."""
        tasks: dict[int, asyncio.Task] = {}
        lock = asyncio.Lock()
        self._newest = -1

        async def report(version: int, data: SnapshotBytes) -> None:
            """The install report alone (the snapshot is installed already; the client retries
            transient failures, and a refusal cannot be helped by sending it again)."""
            try:
                await self.report_installed(version, data)
            except (Refused, OSError) as e:  # OSError: Unreachable included
                logger.warning("version %d: install report not delivered: %r", version, e)

        async def receive(version: int) -> None:
            while not stop.is_set():
                try:
                    data = await self.fetch(version)
                    async with lock:
                        if version > self.installed_version:
                            await install(version, data)
                            self.installed_version = version
                            self.hold(version, data)
                        else:  # a newer one was installed first
                            self.transfers.pop(version, None)
                            return
                    return await report(version, data)
                except (BroadcastError, VerificationError) as e:
                    logger.warning("version %d not installed: %s", version, e)
                    return
                except (aiohttp.ClientError, OSError, Refused) as e:  # e.g. while registering again
                    logger.info("version %d: %r; retrying", version, e)
                    await sleep_unless(stop, retry_s)
                except Exception:  # e.g. the engine could not load it: keep the old version
                    logger.exception("version %d could not be installed", version)
                    return

        try:
            while not stop.is_set():
                if self._rewind.is_set():  # a new epoch: what was being received is void
                    self._rewind.clear()
                    for t in tasks.values():
                        t.cancel()
                    await asyncio.gather(*tasks.values(), return_exceptions=True)
                    tasks.clear()
                try:
                    latest = await unless(stop, self.wait_published(after=self._newest), also=self._rewind)
                except (aiohttp.ClientError, OSError, Refused) as e:
                    logger.debug("waiting for a version: %r", e)
                    await sleep_unless(stop, retry_s)
                    continue
                if latest is not None and latest > self._newest and not self._rewind.is_set():
                    self._newest = latest
                    tasks[latest] = asyncio.create_task(receive(latest))
                for v in [v for v, t in tasks.items() if t.done()]:
                    del tasks[v]
        finally:
            for t in tasks.values():
                t.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)

    def rewind(self) -> None:
        """The learner restarted (a new epoch): forget every version held or being received, so
        the next published one is received and installed even if its number is not newer."""
        self.store.clear()
        self.deltas.clear()
        self.base = None
        self.installed_version = -1
        self.transfers.clear()
        self.digests.clear()
        self._newest = -1
        self._rewind.set()


def _rebuild(base: SnapshotBytes, delta: bytes, manifest: Manifest) -> bytearray:
    """The snapshot `delta` rebuilds on `base`, if its header says what the signed manifest says
    (VerificationError if not; `codec.apply` then checks the base's hash and the result's)."""
    header, _ = codec.read_header(delta)
    said = (header.version, header.base_version, header.base_sha256, header.sha256)
    if said != (manifest.version, manifest.base_version, manifest.base_sha256, manifest.sha256):
        raise VerificationError(
            f"delta of version {manifest.version}: its header disagrees with its manifest"
        )
    return codec.apply(base, delta)
