"""Receiving and relaying snapshots (paper 4.2): no torch, no rollout engine. This module holds the
store and the relay server; the worker's side (`BroadcastClient`, `BroadcastPeer`) is in
rollout/broadcast_client.py and rollout/broadcast_peer.py.

A worker holds verified chunks in a `ChunkStore`, serves them to its child with a `RelayServer`
while it is still receiving them (store-and-forward per chunk), and receives with a
`BroadcastClient`, which asks the coordinator for its parent, streams from it, verifies every
chunk against the signed manifest before storing it (so before its own relay can hand it on), and
on a dead, stalled or lying parent reports it and resumes from its first missing chunk with the new
parent the coordinator names. `echo2 worker` uses these three; `BroadcastPeer` is a whole
broadcast-only worker built from them (through rollout/membership.py: what `python bench/broadcast.py`
runs, one per host or network namespace), and `python -m echo2.rollout.broadcast_peer --coordinator URL --token T --name N [--inbound]`
runs one as a process.

API, all coroutines run in one event loop::

    store = ChunkStore(keep=2)
    relay = RelayServer(store, upload_bucket=TokenBucket(bytes_per_s) or None)
    url = await relay.start("127.0.0.1", 0)        # serves GET /v1/chunks/{version}; relay.port
    # register: POST {coordinator}/v1/register {"name", "inbound": true, "relay_port": relay.port}
    #   -> worker_id, public_key (hex), run["broadcast"]["progress_timeout_s"]
    coordinator = await CoordinatorClient.create(coordinator_url, TOKEN)   # wire/client.py
    client = BroadcastClient(coordinator, store, Receiving(progress_timeout=10.0),
                             worker_id=worker_id, public_key=public_key)
    v = await client.wait_published(after=-1)      # long poll: the newest published version
    data = await client.fetch(v)                    # SnapshotBytes: its chunks, every one verified
    await client.report_installed(v, data)          # once the snapshot is installed (T_bcast)
    await client.follow(stop, install)              # or: all of the above for every new version
    await coordinator.close(); await relay.stop()

    peer = BroadcastPeer(PeerConfig(url=coordinator_url, token=TOKEN, name="name", inbound=True))
    await peer.run(stop)                            # until stop is set; peer.installed: {v: sha256}

Deltas (issue 24): a route may say `form: "delta"`; the delta's manifest and chunks are fetched
with `?form=delta` (`GET /v1/manifest/{v}?form=delta`, `GET /v1/chunks/{v}?form=delta`) and held in
a second ChunkStore (`RelayServer(store, deltas=...)`), which the relay serves the same way: it
forwards the chunks it verified, whatever their form; a version the worker takes in the other
form is `skip`ped, so a child waiting for it there is told "gone" at once.

What the coordinator serves for this (docs/protocol.md): `GET /v1/published?after=V`,
`GET /v1/manifest/{v}` (signed), `GET /v1/chunks/{v}?from=K` (the learner as a parent),
`POST /v1/broadcast/route`, `POST /v1/broadcast/failure` (both answer `{version, parent_id, url}`;
`url` null means the learner), `POST /v1/broadcast/installed` and `POST /v1/broadcast/sent` (a
relay's own account of each stream it served, so a transfer counts only when both sides agree).
Coordinator calls carry the worker's credential; relays are sent no credential at all (chunk hashes
and the signed manifest authenticate what they serve), and their redirects are not followed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable

from aiohttp import web

from echo2.broadcast.bucket import TokenBucket
from echo2.broadcast.chunks import Manifest, SnapshotBytes, VerificationError, verify_chunk
from echo2.broadcast.stream import BadRange, parse_range, serve_stream

logger = logging.getLogger(__name__)

API = "/v1"
STARVED_FACTOR = 3
"""A parent that sends only keep-alives for this many progress timeouts is reported as stalled
(it had that long to notice its own upstream stalled and to reattach)."""


CHILD_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def mbit(rate_mbps: float | None) -> TokenBucket | None:
    """A token bucket for a cap in Mbit/s (None: uncapped, no bucket)."""
    return None if rate_mbps is None else TokenBucket(rate_mbps * 1e6 / 8)


# ---------------------------------------------------------------------------- store
class ChunkStore:
    """Verified chunks of the newest `keep` versions, in memory.

    Only a manifest whose signature the caller checked, and only chunks matching it, get in: `put`
    re-checks every chunk's length and SHA-256 and refuses a bad one. Readers (relay streams) wait
    for chunks still to come. One event loop."""

    def __init__(self, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.keep = keep
        self.manifests: dict[int, Manifest] = {}
        self.chunks: dict[int, dict[int, bytes]] = {}
        self.skipped: set[int] = set()
        """Versions this store will not hold (the worker receives them in the other form)."""
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def add_manifest(self, manifest: Manifest) -> None:
        """Hold chunks of this (verified) manifest's version; drop versions beyond the newest `keep`."""
        if manifest.version in self.manifests:
            return
        self.skipped.discard(manifest.version)
        self.manifests[manifest.version] = manifest
        self.chunks[manifest.version] = {}
        for v in sorted(self.manifests)[: -self.keep]:
            del self.manifests[v], self.chunks[v]
        self._notify()

    def clear(self) -> None:
        """Forget every version (the learner restarted: numbers may now name other snapshots)."""
        self.manifests.clear()
        self.chunks.clear()
        self.skipped.clear()
        self._notify()

    def skip(self, version: int) -> None:
        """This version will not be held here (the worker takes it in the other form; chunks of it
        held half-way are dropped, complete ones kept): a relay stream waiting for it ends at once
        with "gone", so the child is re-routed without blame."""
        if version in self.manifests and not self.complete(version):  # abandoned half-way
            del self.manifests[version], self.chunks[version]
        if version not in self.manifests:
            self.skipped.add(version)
            for v in sorted(self.skipped)[: -4 * self.keep]:
                self.skipped.discard(v)
            self._notify()

    def forget_older(self, version: int) -> None:
        """Drop every version older than `version` (held in the other form now, so these copies
        are no base any more)."""
        for v in [v for v in self.manifests if v < version]:
            del self.manifests[v], self.chunks[v]
        self._notify()

    def dropped(self, version: int) -> bool:
        """Whether this version will never be held here (older than everything held, or skipped)."""
        if version in self.skipped:
            return True
        return bool(self.manifests) and version not in self.manifests and version < min(self.manifests)

    def put(self, version: int, index: int, data: bytes) -> bool:
        """Store chunk `index` if it matches the manifest; False (nothing stored) if it does not."""
        manifest = self.manifests.get(version)
        if manifest is None or not verify_chunk(manifest, index, data):
            return False
        if index not in self.chunks[version]:
            self.chunks[version][index] = bytes(data)
            self._notify()
        return True

    def get(self, version: int, index: int) -> bytes | None:
        return self.chunks.get(version, {}).get(index)

    def first_missing(self, version: int) -> int | None:
        """Index of the first chunk not held yet; None when complete."""
        manifest, held = self.manifests[version], self.chunks[version]
        return next((i for i in range(manifest.num_chunks) if i not in held), None)

    def complete(self, version: int) -> bool:
        return version in self.manifests and self.first_missing(version) is None

    def snapshot(self, version: int) -> SnapshotBytes:
        """The complete snapshot as its chunks, not joined (VerificationError if a chunk is
        missing). Every chunk was verified against the signed manifest when it was stored (`put`),
        so it is not hashed again here; the chunks stay readable if the store drops the version."""
        missing = self.first_missing(version)
        if missing is not None:
            raise VerificationError(f"version {version}: chunk {missing} missing")
        manifest, held = self.manifests[version], self.chunks[version]
        return SnapshotBytes([held[i] for i in range(manifest.num_chunks)], manifest.chunk_size)

    def assemble(self, version: int) -> bytes:
        """The snapshot's bytes joined (VerificationError if a chunk is missing)."""
        return bytes(self.snapshot(version))

    async def wait_chunk(self, version: int, index: int, timeout: float) -> bytes | None:
        """Chunk `index` of `version` once held; None if it did not arrive within `timeout`;
        LookupError if it never will (the version was dropped or has fewer chunks)."""
        deadline = time.monotonic() + timeout
        while True:
            data = self.get(version, index)
            if data is not None:
                return data
            if self.dropped(version):
                raise LookupError(f"version {version} is no longer held")
            manifest = self.manifests.get(version)
            if manifest is not None and index >= manifest.num_chunks:
                raise LookupError(f"version {version} has {manifest.num_chunks} chunks")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                return None


# ---------------------------------------------------------------------------- relay server
class RelayServer:
    """Serves `GET /v1/chunks/{version}?from=K[&to=J][&child=ID][&form=delta]` from a ChunkStore
    (the full snapshots', or with `form=delta` the deltas'): chunks already
    held at once, the others as soon as they arrive (keep-alives meanwhile), paced by
    `upload_bucket`. No credential is asked: what it serves is verified by the receiver.

    `upload_bucket` and `on_sent` may be set after construction (the worker learns its cap when it
    registers, after its relay must already listen). `on_sent(version, child, bytes, seconds)` is
    called after each stream that named its `child` (the relay's account to the coordinator)."""

    def __init__(
        self,
        store: ChunkStore,
        upload_bucket: TokenBucket | None = None,
        *,
        deltas: ChunkStore | None = None,
        keepalive_s: float = 1.0,
        write_timeout_s: float = 60.0,
    ) -> None:
        self.store = store
        self.deltas = deltas
        """Verified chunks of delta snapshots (served for `?form=delta`); None: it serves none."""
        self.upload_bucket = upload_bucket
        self.on_sent: Callable[[int, str, int, float], None] | None = None
        self.keepalive_s = keepalive_s
        self.write_timeout_s = write_timeout_s
        self.port: int | None = None
        self.url = ""
        self.bytes_sent = 0
        self._runner: web.AppRunner | None = None
        self._open: set[asyncio.Transport] = set()

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.get(f"{API}/chunks/{{version}}", self._chunks)])
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on host:port (0: any free port); returns the URL (http://host:port)."""
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        logger.info("relay listening on %s", self.url)
        return self.url

    async def stop(self) -> None:
        """Stop at once: open streams are cut (their receivers report it and reattach elsewhere)."""
        for transport in list(self._open):
            transport.abort()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def chunk(
        self, version: int, index: int, wait: float, store: ChunkStore | None = None
    ) -> bytes | None:
        """The next chunk a stream sends: from the store (the full snapshots' unless given),
        within `wait` seconds (None: not yet)."""
        data = await (store or self.store).wait_chunk(version, index, wait)
        if data is not None:
            self.bytes_sent += len(data)
        return data

    async def _chunks(self, request: web.Request) -> web.StreamResponse:
        try:
            version = int(request.match_info["version"])
            start, to = parse_range(request.query)
            child = request.query.get("child")
            if child is not None and not CHILD_ID.fullmatch(child):
                raise ValueError("child must be a worker id")
            form = request.query.get("form", "full")
            if form not in ("full", "delta"):
                raise ValueError("form must be full or delta")
        except (ValueError, BadRange) as e:
            return web.json_response({"error": "malformed", "detail": str(e)}, status=400)
        # a relay forwards the chunks it verified, whatever their form, from that form's store
        store = self.store if form == "full" else self.deltas
        if store is None or store.dropped(version):
            return web.json_response(
                {"error": "not_held", "detail": f"version {version} is no longer held here"}, status=404
            )

        def end() -> int | None:
            manifest = store.manifests.get(version)
            if manifest is None:
                return None  # not receiving this version yet: keep-alives until it starts
            return manifest.num_chunks if to is None else min(to, manifest.num_chunks)

        sent, started = 0, time.monotonic()

        async def get_chunk(index: int, wait: float) -> bytes | None:
            nonlocal sent
            # (fault-injecting subclasses override `chunk(version, index, wait)`)
            data = await (
                self.chunk(version, index, wait)
                if store is self.store
                else self.chunk(version, index, wait, store)
            )
            sent += len(data) if data is not None else 0
            return data

        transport = request.transport
        if transport is not None:
            self._open.add(transport)
        try:
            return await serve_stream(
                request,
                start=start,
                end=end,
                get_chunk=get_chunk,
                bucket=self.upload_bucket,
                keepalive_s=self.keepalive_s,
                write_timeout_s=self.write_timeout_s,
            )
        finally:
            self._open.discard(transport)
            if child is not None and sent and self.on_sent is not None:
                self.on_sent(version, child, sent, max(time.monotonic() - started, 1e-6))
