"""Receiving and relaying snapshots (paper 4.2): no torch, no rollout engine.

A worker holds verified chunks in a `ChunkStore`, serves them to its child with a `RelayServer`
while it is still receiving them (store-and-forward per chunk), and receives with a
`BroadcastClient`, which asks the coordinator for its parent, streams from it, verifies every
chunk against the signed manifest before storing it (so before its own relay can hand it on), and
on a dead, stalled or lying parent reports it and resumes from its first missing chunk with the new
parent the coordinator names. `echo2 worker` uses these three; `BroadcastPeer` is a whole
broadcast-only worker built from them (what `echo2 bench broadcast` runs, one per host or network
namespace), and `python -m echo2.broadcast.relay --coordinator URL --token T --name N [--inbound]`
runs one as a process.

API, all coroutines run in one event loop::

    store = ChunkStore(keep=2)
    relay = RelayServer(store, upload_bucket=TokenBucket(bytes_per_s) or None, token=TOKEN)
    url = await relay.start("127.0.0.1", 0)        # serves GET /v1/chunks/{version}; relay.port
    # register: POST {coordinator}/v1/register {"name", "inbound": true, "relay_port": relay.port}
    #   -> worker_id, public_key (hex), run["broadcast"]["progress_timeout_s"]
    client = BroadcastClient(coordinator_url, TOKEN, worker_id, store, public_key=public_key,
                             download_bucket=None, progress_timeout=10.0)
    v = await client.wait_published(after=-1)      # long poll: the newest published version
    data = await client.fetch(v)                    # the snapshot's bytes, every chunk verified
    await client.report_installed(v, data)          # once the snapshot is installed (T_bcast)
    await client.follow(stop, install)              # or: all of the above for every new version
    await client.close(); await relay.stop()

    peer = BroadcastPeer(coordinator_url, TOKEN, "name", inbound=True, download_mbps=100)
    await peer.run(stop)                            # until stop is set; peer.installed: {v: sha256}

What the coordinator serves for this (docs/protocol.md): `GET /v1/published?after=V`,
`GET /v1/manifest/{v}` (signed), `GET /v1/chunks/{v}?from=K` (the learner as a parent),
`POST /v1/broadcast/route`, `POST /v1/broadcast/failure` (both answer `{version, parent_id, url}`;
`url` null means the learner) and `POST /v1/broadcast/installed`. Every request carries the run's
bearer token, relays' too.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import ValidationError

from echo2.broadcast.bucket import TokenBucket
from echo2.broadcast.chunks import Manifest, VerificationError, verify_chunk, verify_manifest
from echo2.broadcast.stream import HEADER, KEEPALIVE, PIECE, BadRange, parse_range, serve_stream

logger = logging.getLogger(__name__)

API = "/v1"
STARVED_FACTOR = 3
"""A parent that sends only keep-alives for this many progress timeouts is reported as stalled
(it had that long to notice its own upstream stalled and to reattach)."""
FAULT_FLIP_BYTE_ENV = "ECHO2_FAULT_FLIP_BYTE"
"""TEST-ONLY fault injection: when set to 1, `echo2 worker` relays flip one byte of every chunk
they forward, so tests can check that receivers detect it and refetch."""


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
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def add_manifest(self, manifest: Manifest) -> None:
        """Hold chunks of this (verified) manifest's version; drop versions beyond the newest `keep`."""
        if manifest.version in self.manifests:
            return
        self.manifests[manifest.version] = manifest
        self.chunks[manifest.version] = {}
        for v in sorted(self.manifests)[: -self.keep]:
            del self.manifests[v], self.chunks[v]
        self._notify()

    def dropped(self, version: int) -> bool:
        """Whether this version is older than everything held (it will never be held again)."""
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

    def assemble(self, version: int) -> bytes:
        """The snapshot's bytes (VerificationError if a chunk is missing). Every chunk was verified
        against the signed manifest when it was stored (`put`), so it is not hashed again here."""
        missing = self.first_missing(version)
        if missing is not None:
            raise VerificationError(f"version {version}: chunk {missing} missing")
        held = self.chunks[version]
        return b"".join(held[i] for i in range(self.manifests[version].num_chunks))

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
    """Serves `GET /v1/chunks/{version}?from=K[&to=J]` from a ChunkStore: chunks already held at
    once, the others as soon as they arrive (keep-alives meanwhile), paced by `upload_bucket`.

    `upload_bucket` and `token` may be set after construction (the worker learns its cap when it
    registers, after its relay must already listen). `fault_flip_byte` is TEST-ONLY fault
    injection: every forwarded chunk has its first byte flipped."""

    def __init__(
        self,
        store: ChunkStore,
        upload_bucket: TokenBucket | None = None,
        *,
        token: str | None = None,
        keepalive_s: float = 1.0,
        write_timeout_s: float = 60.0,
        fault_flip_byte: bool = False,
    ) -> None:
        self.store = store
        self.upload_bucket = upload_bucket
        self.token = token
        self.keepalive_s = keepalive_s
        self.write_timeout_s = write_timeout_s
        self.fault_flip_byte = fault_flip_byte
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

    async def chunk(self, version: int, index: int, wait: float) -> bytes | None:
        """The next chunk a stream sends: from the store, within `wait` seconds (None: not yet)."""
        data = await self.store.wait_chunk(version, index, wait)
        if data is not None:
            self.bytes_sent += len(data)
            if self.fault_flip_byte:  # TEST-ONLY fault injection
                data = bytes([data[0] ^ 0xFF]) + data[1:]
        return data

    async def _chunks(self, request: web.Request) -> web.StreamResponse:
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(
                {"error": "unauthorized", "detail": "missing or wrong bearer token"}, status=401
            )
        try:
            version = int(request.match_info["version"])
            start, to = parse_range(request.query)
        except (ValueError, BadRange) as e:
            return web.json_response({"error": "malformed", "detail": str(e)}, status=400)
        if self.store.dropped(version):
            return web.json_response(
                {"error": "not_held", "detail": f"version {version} is no longer held here"}, status=404
            )

        def end() -> int | None:
            manifest = self.store.manifests.get(version)
            if manifest is None:
                return None  # not receiving this version yet: keep-alives until it starts
            return manifest.num_chunks if to is None else min(to, manifest.num_chunks)

        transport = request.transport
        if transport is not None:
            self._open.add(transport)
        try:
            return await serve_stream(
                request,
                start=start,
                end=end,
                get_chunk=lambda index, wait: self.chunk(version, index, wait),
                bucket=self.upload_bucket,
                keepalive_s=self.keepalive_s,
                write_timeout_s=self.write_timeout_s,
            )
        finally:
            self._open.discard(transport)


# ---------------------------------------------------------------------------- client
class BroadcastError(Exception):
    """A version could not be received (no longer kept by the learner, or too many failures)."""


class CoordinatorError(Exception):
    """The coordinator refused a broadcast call (HTTP status and its JSON reason)."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status, self.body = status, body


class _ParentFailed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class BroadcastClient:
    """Receives snapshots for one registered worker: route, stream, verify, store, report.

    `worker_id` and `public_key` are plain attributes (a worker that registers again updates
    them). `download_bucket` caps what this worker receives. `max_failures` bounds the parents
    one version may go through before `fetch` gives up."""

    def __init__(
        self,
        coordinator_url: str,
        token: str,
        worker_id: str,
        store: ChunkStore,
        *,
        public_key: str,
        download_bucket: TokenBucket | None = None,
        progress_timeout: float = 10.0,
        max_failures: int = 20,
        call_timeout: float = 30.0,
    ) -> None:
        self.url = coordinator_url.rstrip("/")
        self.token = token
        self.worker_id = worker_id
        self.store = store
        self.public_key = public_key
        self.download_bucket = download_bucket
        self.progress_timeout = progress_timeout
        self.max_failures = max_failures
        self.call_timeout = call_timeout
        self.transfers: dict[int, list[dict[str, Any]]] = {}
        self.digests: dict[int, str] = {}
        """SHA-256 of each received snapshot, computed once (install report, callers' checks)."""
        """Per version, the stream segments that ended cleanly: parent_id, bytes, seconds."""
        self.failures: list[tuple[int, str | None, str]] = []
        """(version, parent_id, reason) of every parent this client reported."""
        self.installed_version = -1
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.token}"})
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _call(self, method: str, path: str, body: dict | None = None, **kw) -> Any:
        timeout = aiohttp.ClientTimeout(total=kw.pop("timeout", self.call_timeout), connect=10)
        async with self.session.request(method, self.url + path, json=body, timeout=timeout, **kw) as resp:
            data = await resp.json(content_type=None)
            if resp.status >= 400:
                raise CoordinatorError(resp.status, data)
            return data

    # ------------------------------------------------------------------ coordinator calls
    async def wait_published(self, after: int = -1, wait: float = 20.0) -> int:
        """The newest published version, as soon as it is newer than `after` (or after `wait` s)."""
        reply = await self._call(
            "GET", f"{API}/published", params={"after": after, "wait": wait}, timeout=wait + self.call_timeout
        )
        return int(reply["version"])

    async def manifest(self, version: int) -> Manifest:
        """The version's manifest, its signature checked against the learner's key, in the store."""
        if version in self.store.manifests:
            return self.store.manifests[version]
        try:
            data = await self._call("GET", f"{API}/manifest/{version}")
        except CoordinatorError as e:
            if e.status == 404:
                raise BroadcastError(f"version {version} is not kept by the learner") from None
            raise
        try:
            manifest = Manifest.model_validate(data)
        except ValidationError as e:
            raise VerificationError(f"malformed manifest for version {version}: {e}") from None
        verify_manifest(manifest, self.public_key)  # VerificationError: nothing stored
        if manifest.version != version:
            raise VerificationError(f"asked for version {version}, got a manifest for {manifest.version}")
        self.store.add_manifest(manifest)
        return manifest

    async def _route(self, version: int, failed: tuple[str | None, _ParentFailed] | None = None) -> dict:
        body: dict[str, Any] = {"worker_id": self.worker_id, "version": version}
        path = f"{API}/broadcast/route"
        if failed is not None:
            parent_id, err = failed
            body |= {"parent_id": parent_id, "reason": err.reason, "detail": err.detail[:1000]}
            path = f"{API}/broadcast/failure"
        try:
            return await self._call("POST", path, body)
        except CoordinatorError as e:
            if isinstance(e.body, dict) and e.body.get("error") == "no_snapshot":
                raise BroadcastError(f"version {version} is no longer kept by the learner") from None
            raise

    async def report_installed(self, version: int, data: bytes) -> None:
        """Tell the coordinator this worker runs `version` now (its T_bcast) and how the chunks came."""
        digest = self.digests.get(version) or await asyncio.to_thread(
            lambda: hashlib.sha256(data).hexdigest()
        )
        body = {
            "worker_id": self.worker_id,
            "version": version,
            "sha256": digest,
            "transfers": self.transfers.pop(version, [])[-256:],
        }
        await self._call("POST", f"{API}/broadcast/installed", body)

    # ------------------------------------------------------------------ receiving
    async def fetch(self, version: int) -> bytes:
        """Receive `version` (resuming from chunks already held) and return its verified bytes.

        Raises VerificationError if the manifest's signature is bad (nothing is stored),
        BroadcastError if the learner no longer keeps the version or `max_failures` parents failed,
        and aiohttp/CoordinatorError if the coordinator cannot be reached."""
        manifest = await self.manifest(version)
        self.transfers.setdefault(version, [])
        route = await self._route(version)
        failures = 0
        while (start := self._first_missing(version)) is not None:
            try:
                await self._stream(version, manifest, route, start)
            except _ParentFailed as failed:
                failures += 1
                self.failures.append((version, route["parent_id"], failed.reason))
                parent = route["parent_id"] or "learner"
                logger.info("version %d: parent %s failed (%s)", version, parent, failed)
                if failures > self.max_failures:
                    raise BroadcastError(f"version {version}: {failures} parents failed") from failed
                if route["parent_id"] is None:  # the learner itself: do not hammer it
                    await asyncio.sleep(min(0.2 * 2**failures, 5.0))
                route = await self._route(version, (route["parent_id"], failed))

        # Joined and hashed once, off the event loop (relays go on); the hash goes in the install report.
        def join() -> tuple[bytes, str]:
            data = self.store.assemble(version)
            return data, hashlib.sha256(data).hexdigest()

        data, self.digests[version] = await asyncio.to_thread(join)
        for old in [v for v in self.digests if v < version - 8]:
            del self.digests[old]
        return data

    def _first_missing(self, version: int) -> int | None:
        if version not in self.store.manifests:
            raise BroadcastError(f"version {version} was superseded while it was being received")
        return self.store.first_missing(version)

    async def _stream(self, version: int, manifest: Manifest, route: dict, start: int) -> None:
        """One streaming GET on the parent, from chunk `start` to the end; every chunk verified and
        stored as it arrives. Raises _ParentFailed on anything but a complete, valid stream."""
        base = route["url"] or self.url
        # sock_read bounds every wait, headers included: a frozen parent cannot hold us (it sends
        # keep-alives well within progress_timeout while it has nothing to send)
        timeout = aiohttp.ClientTimeout(
            total=None, connect=10, sock_connect=10, sock_read=self.progress_timeout
        )
        started, received = time.monotonic(), 0
        try:
            async with self.session.get(
                f"{base}{API}/chunks/{version}", params={"from": start}, timeout=timeout
            ) as resp:
                if resp.status != 200:
                    raise _ParentFailed("refused", f"HTTP {resp.status}: {(await resp.text())[:200]}")
                last_chunk = time.monotonic()
                while (header := await self._read(resp.content, HEADER.size, at_frame=True)) is not None:
                    index, length = HEADER.unpack(header)
                    if index == KEEPALIVE:
                        if time.monotonic() - last_chunk > STARVED_FACTOR * self.progress_timeout:
                            raise _ParentFailed("stalled", "only keep-alives, no chunk")
                        continue
                    if not 0 <= index < manifest.num_chunks or length != _chunk_len(manifest, index):
                        raise _ParentFailed("bad_chunk", f"frame for chunk {index} of {length} bytes")
                    data = await self._read(resp.content, length)
                    if not self.store.put(version, index, data):
                        self._first_missing(version)  # dropped from the store: not the parent's fault
                        raise _ParentFailed("bad_chunk", f"chunk {index} does not match its hash")
                    received += length
                    last_chunk = time.monotonic()
        except TimeoutError:  # before OSError, of which it is a subclass
            raise _ParentFailed("stalled", f"nothing for {self.progress_timeout}s") from None
        except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as e:
            raise _ParentFailed("unreachable", repr(e)) from None
        if not self.store.complete(version):
            raise _ParentFailed("incomplete", "the stream ended before the last chunk")
        self.transfers[version].append(
            {
                "parent_id": route["parent_id"],
                "bytes": received,
                "seconds": max(time.monotonic() - started, 1e-6),
            }
        )

    async def _read(self, content: aiohttp.StreamReader, n: int, *, at_frame: bool = False) -> bytes | None:
        """`n` bytes, each piece within the progress timeout and paced by the download cap. At a
        frame boundary a clean end of stream returns None."""
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
            async with asyncio.timeout(self.progress_timeout):
                parts.append(await content.readexactly(size))
        return b"".join(parts)

    # ------------------------------------------------------------------ following
    async def follow(
        self,
        stop: asyncio.Event,
        install: Callable[[int, bytes], Awaitable[None]],
        *,
        retry_s: float = 1.0,
    ) -> None:
        """Until `stop`: wait for each newer published version, receive it (one task per version,
        so a slow one does not hold up its successor), `install` it unless something newer is
        installed already, and report the install. Errors are logged and retried."""
        tasks: dict[int, asyncio.Task] = {}
        lock = asyncio.Lock()
        newest = -1

        async def report(version: int, data: bytes) -> None:
            """The install report alone, retried (the snapshot is installed already)."""
            while not stop.is_set():
                try:
                    return await self.report_installed(version, data)
                except CoordinatorError as e:
                    if e.status < 500:  # refused (unknown worker, wrong bytes): retrying cannot help
                        logger.warning("version %d: install report refused: %s", version, e)
                        return
                    logger.info("version %d: install report failed (%r); retrying", version, e)
                    await _sleep_unless(stop, retry_s)
                except (aiohttp.ClientError, OSError, TimeoutError) as e:
                    logger.info("version %d: install report failed (%r); retrying", version, e)
                    await _sleep_unless(stop, retry_s)

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
                except (aiohttp.ClientError, OSError, TimeoutError, CoordinatorError) as e:
                    logger.info("version %d: %r; retrying", version, e)
                    await _sleep_unless(stop, retry_s)
                except Exception:  # e.g. the engine could not load it: keep the old version
                    logger.exception("version %d could not be installed", version)
                    return

        try:
            while not stop.is_set():
                try:
                    latest = await _unless(stop, self.wait_published(after=newest))
                except (aiohttp.ClientError, OSError, TimeoutError, CoordinatorError) as e:
                    logger.debug("waiting for a version: %r", e)
                    await _sleep_unless(stop, retry_s)
                    continue
                if latest is not None and latest > newest:
                    newest = latest
                    tasks[latest] = asyncio.create_task(receive(latest))
                for v in [v for v, t in tasks.items() if t.done()]:
                    del tasks[v]
        finally:
            for t in tasks.values():
                t.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)


def _chunk_len(manifest: Manifest, index: int) -> int:
    start, end = manifest.chunk_range(index)
    return end - start


async def _unless(stop: asyncio.Event, coro: Awaitable[Any]) -> Any:
    """The coroutine's result, or None if `stop` is set first (the coroutine is then cancelled)."""
    task = asyncio.ensure_future(coro)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        for t in (task, stopped):
            t.cancel()
        await asyncio.gather(task, stopped, return_exceptions=True)


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass


# ---------------------------------------------------------------------------- broadcast-only worker
class BroadcastPeer:
    """A worker that only receives and relays snapshots (no model): registers (as a relay when
    `inbound`), heartbeats its installed version, follows every published version and reports each
    install. Caps in Mbit/s; None takes the run's `broadcast.worker_*_mbps`."""

    def __init__(
        self,
        coordinator_url: str,
        token: str,
        name: str,
        *,
        inbound: bool = True,
        relay_host: str = "127.0.0.1",
        relay_port: int = 0,
        advertise_host: str | None = None,
        upload_mbps: float | None = None,
        download_mbps: float | None = None,
        fault_flip_byte: bool = False,
    ) -> None:
        self.url = coordinator_url.rstrip("/")
        self.token = token
        self.name = name
        self.inbound = inbound
        self.relay_host, self.relay_port, self.advertise_host = relay_host, relay_port, advertise_host
        self.upload_mbps, self.download_mbps = upload_mbps, download_mbps
        self.store = ChunkStore()
        self.relay = RelayServer(self.store, token=token, fault_flip_byte=fault_flip_byte)
        self.client: BroadcastClient | None = None
        self.worker_id: str | None = None
        self.installed: dict[int, str] = {}
        """Version -> SHA-256 of the snapshot bytes installed (verified before)."""

    async def _register(self) -> dict:
        body: dict[str, Any] = {"name": self.name, "hardware": "broadcast-only", "inbound": self.inbound}
        if self.inbound:
            body["relay_port"] = self.relay.port
            if self.advertise_host:
                body["relay_host"] = self.advertise_host
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.token}"}) as s:
            async with s.post(f"{self.url}{API}/register", json=body, timeout=aiohttp.ClientTimeout(30)) as r:
                reply = await r.json(content_type=None)
                if r.status != 200:
                    raise CoordinatorError(r.status, reply)
        self.worker_id = reply["worker_id"]
        return reply

    async def run(self, stop: asyncio.Event) -> None:
        if self.inbound:
            await self.relay.start(self.relay_host, self.relay_port)
        try:
            reply = await self._register()
            bc = reply["run"].get("broadcast", {})
            up = self.upload_mbps if self.upload_mbps is not None else bc.get("worker_upload_mbps")
            down = self.download_mbps if self.download_mbps is not None else bc.get("worker_download_mbps")
            self.relay.upload_bucket = mbit(up)
            self.relay.keepalive_s = bc.get("progress_timeout_s", 10.0) / 4
            self.client = BroadcastClient(
                self.url,
                self.token,
                self.worker_id,
                self.store,
                public_key=reply["public_key"],
                download_bucket=mbit(down),
                progress_timeout=bc.get("progress_timeout_s", 10.0),
            )
            beat = asyncio.create_task(self._heartbeat(stop, reply["heartbeat_interval"]))
            try:
                await self.client.follow(stop, self._install)
            finally:
                beat.cancel()
                await asyncio.gather(beat, return_exceptions=True)
                await self.client.close()
        finally:
            await self.relay.stop()

    async def _install(self, version: int, data: bytes) -> None:
        self.installed[version] = self.client.digests[version]  # hashed once, in fetch

    async def _heartbeat(self, stop: asyncio.Event, interval: float) -> None:
        while not stop.is_set():
            body = {"worker_id": self.worker_id, "version": self.client.installed_version}
            try:
                await self.client._call("POST", f"{API}/heartbeat", body)
            except CoordinatorError as e:
                if e.status == 404:  # marked lost: register again (same relay, same store)
                    try:
                        reply = await self._register()
                        self.client.worker_id, self.client.public_key = self.worker_id, reply["public_key"]
                    except (aiohttp.ClientError, OSError, TimeoutError, CoordinatorError) as e2:
                        logger.info("registering again failed: %r", e2)
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                logger.debug("heartbeat failed: %r", e)
            await _sleep_unless(stop, interval)


def main(argv: list[str] | None = None) -> int:
    """`python -m echo2.broadcast.relay`: one broadcast-only worker until SIGTERM/Ctrl-C."""
    p = argparse.ArgumentParser(prog="python -m echo2.broadcast.relay", description=BroadcastPeer.__doc__)
    p.add_argument("--coordinator", required=True, metavar="URL")
    p.add_argument("--token", default=os.environ.get("ECHO2_TOKEN"))
    p.add_argument("--name", required=True)
    p.add_argument("--inbound", action="store_true", help="serve chunks to a child (relay role)")
    p.add_argument("--relay-host", default="0.0.0.0")
    p.add_argument("--relay-port", type=int, default=0)
    p.add_argument("--relay-advertise", default=None, metavar="HOST")
    p.add_argument("--upload-mbps", type=float, default=None)
    p.add_argument("--download-mbps", type=float, default=None)
    p.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)
    if not args.token:
        p.error("--token: missing (or set ECHO2_TOKEN)")
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO)
    peer = BroadcastPeer(
        args.coordinator,
        args.token,
        args.name,
        inbound=args.inbound,
        relay_host=args.relay_host,
        relay_port=args.relay_port,
        advertise_host=args.relay_advertise,
        upload_mbps=args.upload_mbps,
        download_mbps=args.download_mbps,
        fault_flip_byte=os.environ.get(FAULT_FLIP_BYTE_ENV) == "1",
    )

    async def run() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await peer.run(stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
