"""The coordinator's HTTP service (aiohttp), run by the learner process in a background thread.

Owns the transport only: authentication, body-size cap, per-handler timeout, request validation and
the mapping of refusals (control/errors.py) to HTTP statuses, in one table (`STATUS`) and one
middleware. Every decision is made by `CoordinatorState` (or the subclass it is given).
The endpoints are documented in docs/protocol.md. As the learner's end of snapshot broadcast it also
serves signed manifests and chunk streams (the learner is the parent of every chain's seed), paced
by one uplink token bucket shared by all of them.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from echo2.broadcast.bucket import TokenBucket
from echo2.broadcast.stream import PIECE, BadRange, parse_range, serve_stream
from echo2.control import errors, validate
from echo2.control.errors import Reason, Refused, Unreadable
from echo2.control.protocol import (
    API,
    FailureRequest,
    HeartbeatRequest,
    InstalledRequest,
    LeaseRequest,
    LeaseResponse,
    PushRequest,
    RegisterRequest,
    RegisterResponse,
    ReturnRequest,
    Route,
    RouteRequest,
    SnapshotInfo,
)
from echo2.control.state import CoordinatorState
from echo2.records import InvalidTrajectory, Trajectory

logger = logging.getLogger(__name__)

MAX_BODY = 64 * 2**20
HANDLER_TIMEOUT = 30.0
STREAMS = {"chunks", "snapshot_data"}
"""Routes that stream snapshot bytes: no overall timeout (each write has one instead)."""
WRITE_TIMEOUT = 60.0
LONG_POLL_MAX = 25.0


STATUS: dict[type[Refused], int] = {
    errors.Unreadable: 400,
    errors.Quarantined: 403,
    errors.LeaseLimit: 429,
    errors.UnknownWorker: 404,
    errors.NoSnapshot: 404,
    errors.Conflict: 409,
    errors.Released: 410,
    errors.Invalid: 422,
}
"""The HTTP status of each kind of refusal: that of the nearest ancestor listed here."""


def _error(status: int, reason: str, detail: str) -> web.Response:
    return web.json_response({"error": reason, "detail": detail}, status=status)


def refusal(error: Refused) -> web.Response:
    """The one answer to every refusal: its status from `STATUS`, `{"error": reason, "detail": ...}`."""
    return _error(next(STATUS[c] for c in type(error).__mro__ if c in STATUS), error.reason, error.detail)


class Coordinator:
    def __init__(
        self,
        state: CoordinatorState,
        *,
        token: str,
        run_info: dict[str, Any],
        heartbeat_interval: float,
        status_extra: Callable[[], dict[str, Any]] = dict,
        max_body: int = MAX_BODY,
        uplink_bps: float | None = None,
        stream_bps: float | None = None,
    ) -> None:
        self.max_body = max_body
        self.uplink_bps = uplink_bps
        """Cap on the snapshot bytes/s the learner sends, all streams together (None: uncapped)."""
        self.stream_bps = stream_bps
        """Cap on each of the learner's chunk streams, bytes/s (the paper's learner sends to each
        seed at Bw; None: only the shared cap)."""
        self.uplink: TokenBucket | None = None  # made in the server's own event loop
        self._published: asyncio.Event | None = None
        self._stopping = False
        self.state = state
        self.token = token
        self.run_info = run_info
        self.heartbeat_interval = heartbeat_interval
        self.status_extra = status_extra
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._expiry: asyncio.Task | None = None

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body, middlewares=[self._guard])
        app.add_routes(
            [
                web.post(f"{API}/register", self.register),
                web.post(f"{API}/heartbeat", self.heartbeat),
                web.post(f"{API}/lease", self.lease),
                web.post(f"{API}/lease/return", self.return_lease),
                web.post(f"{API}/trajectories", self.push),
                web.get(f"{API}/snapshot", self.manifest),
                web.get(f"{API}/snapshot/{{version}}", self.snapshot, name="snapshot_data"),
                web.get(f"{API}/published", self.published),
                web.get(f"{API}/manifest/{{version}}", self.chunk_manifest),
                web.get(f"{API}/chunks/{{version}}", self.chunks, name="chunks"),
                web.post(f"{API}/broadcast/route", self.route),
                web.post(f"{API}/broadcast/failure", self.failure),
                web.post(f"{API}/broadcast/installed", self.installed),
                web.get("/status", self.status),
            ]
        )
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        if not hmac.compare_digest(auth.encode(), f"Bearer {self.token}".encode()):
            return _error(401, "unauthorized", "missing or wrong bearer token")
        try:
            if request.match_info.route.name in STREAMS:
                return await handler(request)
            async with asyncio.timeout(HANDLER_TIMEOUT):
                return await handler(request)
        except Refused as e:
            return refusal(e)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            return refusal(errors.Invalid(Reason.MALFORMED, f"{where}: {err['msg']}"))
        except web.HTTPRequestEntityTooLarge as e:
            return _error(413, "too_large", validate.printable(e.text))
        except TimeoutError:
            return _error(503, "timeout", f"handler took over {HANDLER_TIMEOUT}s")
        except web.HTTPException as e:  # no route (404), wrong method (405): JSON like every answer
            if e.status < 400:
                raise
            reason = {404: Reason.NOT_FOUND, 405: Reason.METHOD_NOT_ALLOWED}.get(e.status, "http_error")
            return _error(
                e.status, reason, f"{request.method} {validate.printable(request.path)}: {e.reason}"
            )
        except Exception:  # a bug, not the peer's fault: logged, answered in JSON, the server lives on
            logger.exception("%s %s failed", request.method, validate.printable(request.path))
            return _error(500, "internal", "the coordinator failed on this request (logged)")

    @staticmethod
    async def _body(request: web.Request, model, *, limit: int = validate.SMALL_BODY):
        """The body as `model`: JSON of at most `limit` bytes (`max_body` for pushes), nested no
        deeper than the decoder's recursion limit."""
        if (request.content_length or 0) > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
        raw = await request.read()
        if len(raw) > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(raw))
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise Unreadable(f"body is not JSON: {validate.printable(e)}") from None
        except RecursionError:
            raise Unreadable("body is nested too deep") from None
        return model.model_validate(data)

    # ------------------------------------------------------------------ handlers
    async def register(self, request: web.Request) -> web.Response:
        req = await self._body(request, RegisterRequest)
        relay_url = None
        if req.relay_port is not None:
            host = req.relay_host or request.remote or ""
            if ":" in host and not host.startswith("["):  # IPv6 literal
                host = f"[{host}]"
            relay_url = f"http://{host}:{req.relay_port}"
        info = self.state.register(
            name=req.name,
            hardware=req.hardware,
            price_per_hour=req.price_per_hour,
            inbound=req.inbound,
            throughput=req.throughput,
            relay_url=relay_url,
        )
        return web.json_response(
            RegisterResponse(
                worker_id=info.worker_id,
                run=self.run_info,
                heartbeat_interval=self.heartbeat_interval,
                published_version=self.state.published_version,
                public_key=self.state.public_key,
            ).model_dump()
        )

    async def heartbeat(self, request: web.Request) -> web.Response:
        req = await self._body(request, HeartbeatRequest)
        self.state.heartbeat(req.worker_id, version=req.version, throughput=req.throughput)
        return web.json_response({"published_version": self.state.published_version})

    async def lease(self, request: web.Request) -> web.Response:
        req = await self._body(request, LeaseRequest)
        lease = self.state.lease(req.worker_id, version=req.version, max_groups=req.max_groups)
        if lease is None:
            return web.Response(status=204)
        deadline_s = lease.deadline - self.state.clock()
        body = LeaseResponse(lease_id=lease.lease_id, indices=list(lease.indices), deadline_s=deadline_s)
        return web.json_response(body.model_dump())

    async def return_lease(self, request: web.Request) -> web.Response:
        req = await self._body(request, ReturnRequest)
        self.state.return_lease(req.worker_id, req.lease_id)
        return web.json_response({"ok": True})

    async def push(self, request: web.Request) -> web.Response:
        try:
            req = await self._body(request, PushRequest, limit=self.max_body)
        except (ValidationError, Refused):
            self.state.count_rejected(Reason.MALFORMED, 1)  # a batch that does not parse counts once
            raise
        try:
            records = [Trajectory.from_dict(r.model_dump()) for r in req.records]
        except InvalidTrajectory as e:  # lengths disagree, non-finite reward: caught by Trajectory itself
            self.state.refuse(req.worker_id, e.reason, len(req.records))
            raise errors.InvalidBatch(e.reason, validate.printable(e)) from None
        problem = validate.batch_problem(records, reward_range=self.state.ingestion.limits.reward_range)
        if problem is not None:  # refused whole: nothing stored, only the refusal counted
            self.state.refuse(req.worker_id, problem.reason, len(records))
            raise errors.InvalidBatch(problem.reason, problem.detail)
        return web.json_response(self.state.ingest(req.worker_id, req.lease_id, records))

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

    # ------------------------------------------------------------------ snapshot broadcast
    async def published(self, request: web.Request) -> web.Response:
        """Long poll: answers as soon as a version newer than `after` is published, or after `wait`."""
        try:
            after = int(request.query.get("after", "-1"))
            wait = float(request.query.get("wait", "20"))
            if not math.isfinite(wait):
                raise ValueError
            wait = min(max(wait, 0.0), LONG_POLL_MAX)
        except ValueError:
            raise Unreadable("after must be an integer and wait a number") from None
        try:
            async with asyncio.timeout(wait):
                while self.state.published_version <= after and not (self.state.closed or self._stopping):
                    await self._published.wait()
        except TimeoutError:
            pass
        return web.json_response({"version": self.state.published_version})

    def notify_published(self) -> None:
        """Wake the long polls (called from the learner's thread after each publication)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop is shutting down
                pass

    def _wake(self) -> None:
        if self._published is not None:
            self._published.set()
            self._published = asyncio.Event()

    async def chunk_manifest(self, request: web.Request) -> web.Response:
        return web.json_response(self._blob(request).manifest.model_dump())

    async def chunks(self, request: web.Request) -> web.StreamResponse:
        """The learner as a parent: chunks `from`..`to` of a kept version, through the uplink cap."""
        blob = self._blob(request)
        try:
            start, end = parse_range(request.query, blob.manifest.num_chunks)
        except BadRange as e:
            raise Unreadable(str(e)) from None

        async def get_chunk(index: int, wait: float) -> memoryview:
            self.state.record_bytes_served(len(blob.chunks[index]))
            return blob.chunks[index]

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

    async def route(self, request: web.Request) -> web.Response:
        req = await self._body(request, RouteRequest)
        parent_id, url = self.state.route(req.worker_id, req.version)
        return web.json_response(Route(version=req.version, parent_id=parent_id, url=url).model_dump())

    async def failure(self, request: web.Request) -> web.Response:
        req = await self._body(request, FailureRequest)
        parent_id, url = self.state.report_failure(
            req.worker_id, req.version, req.parent_id, req.reason, req.detail
        )
        return web.json_response(Route(version=req.version, parent_id=parent_id, url=url).model_dump())

    async def installed(self, request: web.Request) -> web.Response:
        req = await self._body(request, InstalledRequest)
        transfers = [(t.parent_id, t.bytes, t.seconds) for t in req.transfers]
        self.state.report_installed(req.worker_id, req.version, req.sha256, transfers)
        return web.json_response({"ok": True})

    async def status(self, request: web.Request) -> web.Response:
        body = self.state.status()
        body.update(self.status_extra())
        return web.json_response(body)

    # ------------------------------------------------------------------ lifecycle (own thread)
    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        ready = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._start(host, port))
            except BaseException as e:  # reported to the starting thread
                failure.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._stop())
            loop.close()

        self._thread = threading.Thread(target=serve, name="coordinator", daemon=True)
        self._thread.start()
        ready.wait(timeout=30)
        if failure:
            raise failure[0]
        return self.url

    async def _start(self, host: str, port: int) -> None:
        self.uplink = TokenBucket(self.uplink_bps) if self.uplink_bps else None
        self._published = asyncio.Event()
        self._stopping = False
        self.state.listeners.append(self.notify_published)
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()  # port 0 -> the port the OS chose
        self.url = f"http://{bound[0]}:{bound[1]}"
        self._expiry = asyncio.get_running_loop().create_task(self._expire_forever())
        logger.info("coordinator listening on %s", self.url)

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.state.heartbeat_timeout / 4))
            try:
                self.state.expire()
            except Exception:  # e.g. a provider that cannot start a process: log, keep expiring
                logger.exception("expiry/scheduling failed; trying again")

    async def _stop(self) -> None:
        self._stopping = True
        self._wake()  # long polls answer now
        if self.notify_published in self.state.listeners:
            self.state.listeners.remove(self.notify_published)
        if self._expiry:
            self._expiry.cancel()
        if self._runner:
            await self._runner.cleanup()

    def stop(self) -> None:
        """Idempotent: stop serving and join the thread."""
        if self._loop and self._thread and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
