"""The learner's end of snapshot broadcast, as coordinator routes: the newest snapshot whole, signed
chunk manifests and chunk streams paced by the learner's uplink bucket (the learner is the parent
of every chain's seed), of the full snapshot or, with `?form=delta`, of its delta, and the
receivers' reports (routes, which say the form; failures, installs, transfers).

`SnapshotRoutes` owns the uplink bucket and the per-stream cap; `Coordinator` (coordinator.py) adds
its `routes()` to the app and authenticates the callers (http.py). Every decision is the
publisher's (publisher.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from aiohttp import web

from echo2.broadcast.bucket import TokenBucket
from echo2.broadcast.stream import PIECE, BadRange, parse_range, serve_stream
from echo2.coordinator.http import WORKER, read_body
from echo2.coordinator.publisher import Publisher
from echo2.wire.errors import Invalid, Reason, Unreadable
from echo2.wire.protocol import (
    API,
    FailureRequest,
    InstalledRequest,
    Route,
    RouteRequest,
    SentRequest,
    SnapshotInfo,
)

WRITE_TIMEOUT = 60.0
"""Seconds one write of a snapshot stream may take."""
STREAMS = {"chunks", "snapshot_data"}
"""Routes that stream snapshot bytes: no overall timeout (each write has one instead)."""


class SnapshotRoutes:
    def __init__(self, publisher: Publisher, *, uplink_bps: float | None, stream_bps: float | None) -> None:
        self.publisher = publisher
        self.uplink_bps = uplink_bps
        """Cap on the snapshot bytes/s the learner sends, all streams together (None: uncapped)."""
        self.stream_bps = stream_bps
        """Cap on each of the learner's chunk streams, bytes/s (the paper's learner sends to each
        seed at Bw; None: only the shared cap)."""
        self.uplink: TokenBucket | None = None  # made in the server's own event loop (`start`)
        self.on_wrong_snapshot: Callable[[str, int], None] | None = None
        """Told of each install report refused as `wrong_snapshot` (worker id, version): the
        intake strikes the worker and refuses its records of that version."""

    def start(self) -> None:
        """Called in the server's event loop before it serves."""
        self.uplink = TokenBucket(self.uplink_bps) if self.uplink_bps else None

    def routes(self) -> list[web.RouteDef]:
        """Its routes (their names are the guard's: worker calls, streams)."""
        return [
            web.get(f"{API}/snapshot", self.manifest),
            web.get(f"{API}/snapshot/{{version}}", self.snapshot, name="snapshot_data"),
            web.get(f"{API}/manifest/{{version}}", self.chunk_manifest),
            web.get(f"{API}/chunks/{{version}}", self.chunks, name="chunks"),
            web.post(f"{API}/broadcast/route", self.route, name="route"),
            web.post(f"{API}/broadcast/failure", self.failure, name="failure"),
            web.post(f"{API}/broadcast/installed", self.installed, name="installed"),
            web.post(f"{API}/broadcast/sent", self.sent, name="sent"),
        ]

    async def manifest(self, request: web.Request) -> web.Response:
        blob = self.publisher.blob()
        return web.json_response(
            SnapshotInfo(version=blob.version, size=len(blob.data), sha256=blob.sha256).model_dump()
        )

    def _blob(self, request: web.Request, *, forms: tuple[str, ...] = ("full",)):
        """The kept snapshot the request names (`?form=delta`: its delta, where `forms` allow it)."""
        try:
            version = int(request.match_info["version"])
        except ValueError:
            raise Unreadable("version must be an integer") from None
        form = request.query.get("form", "full")
        if form not in forms:
            raise Unreadable(f"form must be one of {', '.join(forms)}")
        return self.publisher.blob(version, form=form)

    async def snapshot(self, request: web.Request) -> web.StreamResponse:
        """The whole snapshot in one body (tools, debugging; workers use the chunk streams)."""
        blob = self._blob(request)
        resp = web.StreamResponse(
            headers={"Content-Type": "application/octet-stream", "X-Sha256": blob.sha256}
        )
        resp.content_length = len(blob.data)
        await resp.prepare(request)
        view = memoryview(blob.data)
        for at in range(0, len(view), PIECE):
            piece = view[at : at + PIECE]
            if self.uplink is not None:
                await self.uplink.consume(len(piece))
            async with asyncio.timeout(WRITE_TIMEOUT):
                await resp.write(piece)
        self.publisher.record_bytes_served(len(view))
        await resp.write_eof()
        return resp

    async def chunk_manifest(self, request: web.Request) -> web.Response:
        return web.json_response(self._blob(request, forms=("full", "delta")).manifest.model_dump())

    async def chunks(self, request: web.Request) -> web.StreamResponse:
        """The learner as a parent: chunks `from`..`to` of a kept version (`?form=delta`: of its
        delta), through the uplink cap."""
        blob = self._blob(request, forms=("full", "delta"))
        try:
            start, end = parse_range(request.query, blob.manifest.num_chunks)
        except BadRange as e:
            raise Unreadable(str(e)) from None

        sent = 0

        async def get_chunk(index: int, wait: float) -> memoryview:
            nonlocal sent
            sent += len(blob.chunks[index])
            self.publisher.record_bytes_served(len(blob.chunks[index]))
            return blob.chunks[index]

        started = time.monotonic()
        try:
            return await serve_stream(
                request,
                start=start,
                end=lambda: end,
                get_chunk=get_chunk,
                bucket=self.uplink,
                keepalive_s=1.0,
                write_timeout_s=WRITE_TIMEOUT,
                stream_bucket=TokenBucket(self.stream_bps) if self.stream_bps else None,
            )
        finally:  # the learner's own account of what it sent this worker (cross-checks its report)
            if request[WORKER] is not None and sent:
                seconds = max(time.monotonic() - started, 1e-6)
                self.publisher.report_sent(None, blob.version, request[WORKER], sent, seconds)

    async def route(self, request: web.Request) -> web.Response:
        req = await read_body(request, RouteRequest)
        parent_id, url, form = self.publisher.route(req.worker_id, req.version, base=req.base, full=req.full)
        return self._route(req.worker_id, req.version, parent_id, url, form)

    async def failure(self, request: web.Request) -> web.Response:
        req = await read_body(request, FailureRequest)
        parent_id, url, form = self.publisher.report_failure(
            req.worker_id, req.version, req.parent_id, req.reason, req.detail
        )
        return self._route(req.worker_id, req.version, parent_id, url, form)

    def _route(
        self, worker_id: str, version: int, parent_id: str | None, url: str | None, form: str
    ) -> web.Response:
        floor = self.publisher.relay_floor(worker_id, version, parent_id)
        route = Route(version=version, parent_id=parent_id, url=url, min_rate_bps=floor, form=form)
        return web.json_response(route.model_dump())

    async def installed(self, request: web.Request) -> web.Response:
        req = await read_body(request, InstalledRequest)
        transfers = [(t.parent_id, t.bytes, t.seconds) for t in req.transfers]
        try:
            self.publisher.report_installed(req.worker_id, req.version, req.sha256, transfers)
        except Invalid as e:
            if e.reason == Reason.WRONG_SNAPSHOT and self.on_wrong_snapshot is not None:
                self.on_wrong_snapshot(req.worker_id, req.version)
            raise
        return web.json_response({"ok": True})

    async def sent(self, request: web.Request) -> web.Response:
        req = await read_body(request, SentRequest)
        self.publisher.report_sent(req.worker_id, req.version, req.child_id, req.bytes, req.seconds)
        return web.json_response({"ok": True})
