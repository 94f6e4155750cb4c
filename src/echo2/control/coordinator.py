"""The coordinator's HTTP service (aiohttp), run by the learner process in a background thread.

Owns the transport only: authentication, body-size cap, per-handler timeout, request validation and
the mapping of `Rejected` to 4xx answers with a reason. Every decision is made by `CoordinatorState`.
The endpoints are documented in docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from echo2.control.protocol import (
    API,
    HeartbeatRequest,
    LeaseRequest,
    LeaseResponse,
    Manifest,
    PushRequest,
    RegisterRequest,
    RegisterResponse,
    ReturnRequest,
)
from echo2.control.state import CoordinatorState, Rejected
from echo2.records import InvalidTrajectory, Trajectory

logger = logging.getLogger(__name__)

MAX_BODY = 64 * 2**20
HANDLER_TIMEOUT = 30.0


def _error(status: int, reason: str, detail: str) -> web.Response:
    return web.json_response({"error": reason, "detail": detail}, status=status)


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
    ) -> None:
        self.max_body = max_body
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
                web.get(f"{API}/snapshot/{{version}}", self.snapshot),
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
            async with asyncio.timeout(HANDLER_TIMEOUT):
                return await handler(request)
        except Rejected as e:
            return _error(e.status, e.reason, e.detail)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            return _error(422, "malformed", f"{where}: {err['msg']}")
        except web.HTTPRequestEntityTooLarge:
            return _error(413, "too_large", f"body over {self.max_body} bytes")
        except TimeoutError:
            return _error(503, "timeout", f"handler took over {HANDLER_TIMEOUT}s")

    @staticmethod
    async def _body(request: web.Request, model):
        try:
            raw = await request.read()
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise Rejected(400, "malformed", f"body is not JSON: {e}") from None
        return model.model_validate(data)

    # ------------------------------------------------------------------ handlers
    async def register(self, request: web.Request) -> web.Response:
        req = await self._body(request, RegisterRequest)
        info = self.state.register(
            name=req.name,
            hardware=req.hardware,
            price_per_hour=req.price_per_hour,
            inbound=req.inbound,
            throughput=req.throughput,
        )
        return web.json_response(
            RegisterResponse(
                worker_id=info.worker_id,
                run=self.run_info,
                heartbeat_interval=self.heartbeat_interval,
                published_version=self.state.published_version,
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
        deadline = lease.deadline - self.state.clock()
        return web.json_response(
            LeaseResponse(
                lease_id=lease.lease_id, indices=list(lease.indices), deadline_s=deadline
            ).model_dump()
        )

    async def return_lease(self, request: web.Request) -> web.Response:
        req = await self._body(request, ReturnRequest)
        self.state.return_lease(req.worker_id, req.lease_id)
        return web.json_response({"ok": True})

    async def push(self, request: web.Request) -> web.Response:
        try:
            req = await self._body(request, PushRequest)
        except (ValidationError, Rejected):
            with self.state.lock:
                self.state.rejected["malformed"] += 1  # a batch that does not parse counts once
            raise
        try:
            records = [Trajectory.from_dict(r.model_dump()) for r in req.records]
        except InvalidTrajectory as e:  # lengths disagree, non-finite reward: caught by Trajectory itself
            with self.state.lock:
                self.state.rejected[e.reason] += len(req.records)
            raise Rejected(422, e.reason, str(e)) from None
        return web.json_response(self.state.ingest(req.worker_id, req.lease_id, records))

    async def manifest(self, request: web.Request) -> web.Response:
        with self.state.lock:
            v = self.state.published_version
            blob = self.state.snapshots.get(v)
        if blob is None:
            return _error(404, "no_snapshot", "nothing published yet")
        return web.json_response(Manifest(version=v, size=len(blob.data), sha256=blob.sha256).model_dump())

    async def snapshot(self, request: web.Request) -> web.StreamResponse:
        try:
            version = int(request.match_info["version"])
        except ValueError:
            return _error(400, "malformed", "version must be an integer")
        with self.state.lock:
            blob = self.state.snapshots.get(version)
        if blob is None:
            return _error(404, "no_snapshot", f"version {version} is not kept")
        return web.Response(
            body=blob.data, content_type="application/octet-stream", headers={"X-Sha256": blob.sha256}
        )

    async def status(self, request: web.Request) -> web.Response:
        st = self.state
        with st.lock:
            body = {
                "learner_version": st.buffer.learner_version,
                "published_version": st.published_version,
                "workers": [
                    {
                        "worker_id": w.worker_id,
                        "name": w.name,
                        "state": "standby" if w.standby and w.status.value == "active" else w.status.value,
                        "version": w.version,
                        "throughput": w.throughput,
                        "price_per_hour": w.price_per_hour,
                        "inbound": w.inbound,
                        "hardware": w.hardware,
                    }
                    for w in st.workers.values()
                ],
                "buffer_by_version": {str(k): v for k, v in st.buffer.contents_by_version().items()},
                "accepted": st.accepted,
                "rejected": dict(st.rejected),
                "buffer_rejected": dict(st.buffer.rejected),
                "leases_open": len(st.leases),
                "reissue_queue": len(st.reissue),
                "reissued": st.reissued,
                "scheduler_target": st.target() if st.scheduler else None,
                "scheduler_decisions": list(st.decisions)[-20:],  # all of them with a learner (timings)
            }
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
        self._runner = web.AppRunner(self.app(), access_log=None)
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
            self.state.expire()

    async def _stop(self) -> None:
        if self._expiry:
            self._expiry.cancel()
        if self._runner:
            await self._runner.cleanup()

    def stop(self) -> None:
        """Idempotent: stop serving and join the thread."""
        if self._loop and self._thread and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
