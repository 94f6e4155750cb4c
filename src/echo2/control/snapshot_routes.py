"""The learner's end of snapshot broadcast, as coordinator routes: the newest snapshot whole, signed
chunk manifests and chunk streams paced by the learner's uplink bucket (the learner is the parent
of every chain's seed), and the receivers' reports (routes, failures, installs, transfers).

A mixin of `Coordinator` (control/coordinator.py), which owns the app, the authentication and the
uplink bucket; every decision is `CoordinatorState`'s.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from echo2.broadcast.bucket import TokenBucket
from echo2.broadcast.stream import PIECE, BadRange, parse_range, serve_stream
from echo2.control.errors import Unreadable
from echo2.control.protocol import (
    FailureRequest,
    InstalledRequest,
    Route,
    RouteRequest,
    SentRequest,
    SnapshotInfo,
)

WRITE_TIMEOUT = 60.0
"""Seconds one write of a snapshot stream may take."""
WORKER = web.RequestKey("worker", str)
"""The worker a request is made as (None: the run token's holder)."""


class SnapshotRoutes:
    """Handlers of `Coordinator` (which sets `state`, `uplink`, `stream_bps` and `_body`)."""

    async def manifest(self, request: web.Request) -> web.Response:
        blob = self.state.blob()
        return web.json_response(
            SnapshotInfo(version=blob.version, size=len(blob.data), sha256=blob.sha256).model_dump()
        )

    def _blob(self, request: web.Request):
        try:
            version = int(request.match_info["version"])
        except ValueError:
            raise Unreadable("version must be an integer") from None
        return self.state.blob(version)

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
        self.state.record_bytes_served(len(view))
        await resp.write_eof()
        return resp

    async def chunk_manifest(self, request: web.Request) -> web.Response:
        return web.json_response(self._blob(request).manifest.model_dump())

    async def chunks(self, request: web.Request) -> web.StreamResponse:
        """The learner as a parent: chunks `from`..`to` of a kept version, through the uplink cap."""
        blob = self._blob(request)
        try:
            start, end = parse_range(request.query, blob.manifest.num_chunks)
        except BadRange as e:
            raise Unreadable(str(e)) from None

        sent = 0

        async def get_chunk(index: int, wait: float) -> memoryview:
            nonlocal sent
            sent += len(blob.chunks[index])
            self.state.record_bytes_served(len(blob.chunks[index]))
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
                self.state.report_sent(None, blob.version, request[WORKER], sent, seconds)

    async def route(self, request: web.Request) -> web.Response:
        req = await self._body(request, RouteRequest)
        parent_id, url = self.state.route(req.worker_id, req.version)
        return self._route(req.worker_id, req.version, parent_id, url)

    async def failure(self, request: web.Request) -> web.Response:
        req = await self._body(request, FailureRequest)
        parent_id, url = self.state.report_failure(
            req.worker_id, req.version, req.parent_id, req.reason, req.detail
        )
        return self._route(req.worker_id, req.version, parent_id, url)

    def _route(self, worker_id: str, version: int, parent_id: str | None, url: str | None) -> web.Response:
        floor = self.state.relay_floor(worker_id, version, parent_id)
        route = Route(version=version, parent_id=parent_id, url=url, min_rate_bps=floor)
        return web.json_response(route.model_dump())

    async def installed(self, request: web.Request) -> web.Response:
        req = await self._body(request, InstalledRequest)
        transfers = [(t.parent_id, t.bytes, t.seconds) for t in req.transfers]
        self.state.report_installed(req.worker_id, req.version, req.sha256, transfers)
        return web.json_response({"ok": True})

    async def sent(self, request: web.Request) -> web.Response:
        req = await self._body(request, SentRequest)
        self.state.report_sent(req.worker_id, req.version, req.child_id, req.bytes, req.seconds)
        return web.json_response({"ok": True})
