"""The receiving side of snapshot broadcast: `BroadcastClient` asks the coordinator for its parent,
streams chunks from it, verifies each against the signed manifest before storing it, and on a dead,
stalled or lying parent reports it and resumes from its first missing chunk with the new parent.
The API is described in broadcast/relay.py's docstring. It lives in rollout/, not broadcast/, because
it talks to the coordinator: broadcast/ sits below control/ and imports none of it. It does not
read the registration: the worker's `Membership` (rollout/membership.py) builds it from the reply.

Every call to the coordinator goes through the worker's `CoordinatorClient` (control/client.py:
typed refusals, one retry policy); chunk streams use that client's session with their own progress
timeout, since a stream is not a coordinator call. A relay is untrusted: it is sent no credential,
its redirects are not followed, and one whose chunks arrive slower than `min_rate_bps` (measured
over a progress timeout of reading) is reported stalled, like one that sends nothing. A route may
carry the coordinator's own floor (`Route.min_rate_bps`, a fraction of the peers' rate): a relay
below it is reported "slow" and the coordinator demotes it.
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
from echo2.broadcast.chunks import Manifest, SnapshotBytes, VerificationError, manifest_of
from echo2.broadcast.meter import ParentFailed, RelayMeter
from echo2.broadcast.relay import API, STARVED_FACTOR, ChunkStore, mbit
from echo2.broadcast.stream import GONE, HEADER, KEEPALIVE, PIECE
from echo2.control.client import CoordinatorClient
from echo2.control.errors import NoSnapshot, Refused
from echo2.control.protocol import FailureRequest, InstalledRequest, Route, RouteRequest

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
    def of(cls, broadcast: dict[str, Any], *, download_mbps: float | None = None) -> Receiving:
        """From the run's `broadcast` section; a `download_mbps` given overrides the run's cap."""
        return cls(
            progress_timeout=broadcast.get("progress_timeout_s", 10.0),
            min_rate_bps=(broadcast.get("min_relay_mbps") or 0.0) * 1e6 / 8,
            download_mbps=download_mbps
            if download_mbps is not None
            else broadcast.get("worker_download_mbps"),
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
    ) -> None:
        self.coordinator, self.store, self.receiving = coordinator, store, receiving
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

    async def manifest(self, version: int) -> Manifest:
        """The version's manifest, its signature checked against the learner's key, in the store."""
        if version in self.store.manifests:
            return self.store.manifests[version]
        try:
            data = await self.coordinator.manifest(version)
        except NoSnapshot:
            raise BroadcastError(f"version {version} is not kept by the learner") from None
        try:
            manifest = manifest_of(data, version, self.public_key)
        except VerificationError as e:  # nothing stored
            self.refused[version] = str(e)
            raise
        self.store.add_manifest(manifest)
        return manifest

    async def _route(self, version: int, failed: tuple[str | None, ParentFailed] | None = None) -> Route:
        try:
            if failed is None:
                return await self.coordinator.route(RouteRequest(worker_id=self.worker_id, version=version))
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
        manifest = await self.manifest(version)
        self.transfers.setdefault(version, [])
        route = await self._route(version)
        failures = 0
        while (start := self._first_missing(version)) is not None:
            try:
                await self._stream(version, manifest, route, start)
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

        # Not joined (the install reads it tensor by tensor); hashed once, off the event loop
        # (relays go on); the hash goes in the install report.
        data = self.store.snapshot(version)
        self.digests[version] = await asyncio.to_thread(data.sha256)
        for old in [v for v in self.digests if v < version - 8]:
            del self.digests[old]
        return data

    def _first_missing(self, version: int) -> int | None:
        if version not in self.store.manifests:
            raise BroadcastError(f"version {version} was superseded while it was being received")
        return self.store.first_missing(version)

    async def _stream(self, version: int, manifest: Manifest, route: Route, start: int) -> None:
        """One streaming GET on the parent, from chunk `start` to the end; every chunk verified and
        stored as it arrives. Raises ParentFailed on anything but a complete, valid stream."""
        relay = route.url is not None
        base = route.url or self.coordinator.url
        # sock_read bounds every wait, headers included: a frozen parent cannot hold us (it sends
        # keep-alives well within progress_timeout while it has nothing to send)
        timeout = aiohttp.ClientTimeout(
            total=None, connect=10, sock_connect=10, sock_read=self.progress_timeout
        )
        started, received = time.monotonic(), 0
        meter = (
            RelayMeter(
                stall_bps=self.receiving.min_rate_bps,
                slow_bps=route.min_rate_bps or 0.0,
                window_s=self.progress_timeout,
            )
            if relay and (self.receiving.min_rate_bps or route.min_rate_bps)
            else None
        )
        # Only the learner gets our credential; a relay is told who we are (for its own account of
        # the transfer) and nothing else.
        params = {"from": start, "child": self.worker_id} if relay else {"from": start}
        headers = {} if relay else self.coordinator.auth_headers(worker_id=self.worker_id)
        try:
            async with self.coordinator.session.get(
                f"{base}{API}/chunks/{version}",
                params=params,
                headers=headers,
                timeout=timeout,
                allow_redirects=False,
            ) as resp:
                if resp.status != 200:
                    body = (await resp.text())[:200]
                    # a relay that no longer holds the version is not at fault: "gone", not "refused"
                    reason = "gone" if resp.status == 404 and "not_held" in body else "refused"
                    raise ParentFailed(reason, f"HTTP {resp.status}: {body}")
                last_chunk = time.monotonic()
                while (header := await self._read(resp.content, HEADER.size, at_frame=True)) is not None:
                    index, length = HEADER.unpack(header)
                    if index == KEEPALIVE:
                        if time.monotonic() - last_chunk > STARVED_FACTOR * self.progress_timeout:
                            raise ParentFailed("stalled", "only keep-alives, no chunk")
                        continue
                    if index == GONE:
                        raise ParentFailed("gone", "the parent no longer holds this version")
                    if not 0 <= index < manifest.num_chunks or length != _chunk_len(manifest, index):
                        raise ParentFailed("bad_chunk", f"frame for chunk {index} of {length} bytes")
                    data = await self._read(resp.content, length, meter=meter)
                    if not self.store.put(version, index, data):
                        self._first_missing(version)  # dropped from the store: not the parent's fault
                        raise ParentFailed("bad_chunk", f"chunk {index} does not match its hash")
                    received += length
                    last_chunk = time.monotonic()
        except TimeoutError:  # before OSError, of which it is a subclass
            raise ParentFailed("stalled", f"nothing for {self.progress_timeout}s") from None
        except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as e:
            raise ParentFailed("unreachable", repr(e)) from None
        if not self.store.complete(version):
            raise ParentFailed("incomplete", "the stream ended before the last chunk")
        self.transfers[version].append(
            {
                "parent_id": route.parent_id,
                "bytes": received,
                "seconds": max(time.monotonic() - started, 1e-6),
            }
        )

    async def _read(
        self,
        content: aiohttp.StreamReader,
        n: int,
        *,
        at_frame: bool = False,
        meter: RelayMeter | None = None,
    ) -> bytes | None:
        """`n` bytes, each piece within the progress timeout and paced by the download cap. At a
        frame boundary a clean end of stream returns None. With a `meter`, every piece's wait is
        measured against the relay's floors (the time this worker's own download cap takes is not
        counted)."""
        if at_frame and n <= PIECE:
            try:
                async with asyncio.timeout(self.progress_timeout):
                    return await content.readexactly(n)
            except asyncio.IncompleteReadError as e:
                if not e.partial:
                    return None
                raise
        parts = []
        for at in range(0, n, PIECE):
            size = min(PIECE, n - at)
            if self.download_bucket is not None:
                await self.download_bucket.consume(size)
            t0 = time.monotonic()
            async with asyncio.timeout(self.progress_timeout):
                parts.append(await content.readexactly(size))
            if meter is not None:
                meter.add(size, time.monotonic() - t0)
        return b"".join(parts)

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
        self.installed_version = -1
        self.transfers.clear()
        self.digests.clear()
        self._newest = -1
        self._rewind.set()


def _chunk_len(manifest: Manifest, index: int) -> int:
    start, end = manifest.chunk_range(index)
    return end - start
