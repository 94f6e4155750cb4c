"""The coordinator's HTTP service (aiohttp), run by the learner process in a background thread.

Owns the transport only: authentication (the run token admits new workers; every call made as a
worker must carry that worker's own credential, issued at registration), the body-size cap, the
workers' calls (register, heartbeat, lease, push), the status, and the server's thread (the long
poll for publications is a `PublishedPoll`, longpoll.py). A push's sender (its credential, its
quarantine) and its declared size are checked from the headers before a byte of its body is read;
a refused body is not drained (the connection closes). The connections are capped
(MAX_CONNECTIONS, and PER_ADDRESS_CONNECTIONS from one peer address) and an idle one, or one still
sending its headers, is closed after KEEPALIVE_S. What blocks (a push's parse, door and referee,
the state's lock) runs off the event loop: a push on `ingest_pool` (one at a time, so a burst of
large pushes queues instead of contending; a large body is parsed in a process of its own,
pushparse.py), a heartbeat on the loop only when the lock is free, every other state call on the
loop's default executor. The guard middleware, body reading and the answer to every refusal are in
http.py; the learner's end of snapshot broadcast (manifests and chunk streams paced by one uplink
token bucket, the receivers' reports) is a `SnapshotRoutes` (snapshot_routes.py) whose routes it
serves. Every decision is made by `CoordinatorState` and its parts. The endpoints are documented
in docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import hmac
import json
import logging
import ssl
import sys
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web

from echo2.coordinator import prom, sessions, status_page
from echo2.coordinator.http import WORKER, capped, guard, read_body, read_raw, refusal
from echo2.coordinator.longpoll import PublishedPoll
from echo2.coordinator.prom import exposition
from echo2.coordinator.pushparse import IN_THREAD, Parser, outcome, records_of
from echo2.coordinator.snapshot_routes import STREAMS, SnapshotRoutes
from echo2.coordinator.state import CoordinatorState
from echo2.wire import errors, identity
from echo2.wire.errors import Forbidden, Unauthorized
from echo2.wire.protocol import (
    API,
    HeartbeatRequest,
    LeaseRequest,
    LeaseResponse,
    RegisterRequest,
    RegisterResponse,
    ReturnRequest,
    RunView,
)

logger = logging.getLogger(__name__)

MAX_BODY = 64 * 2**20
MAX_CONNECTIONS = 4096
"""Open connections served at once; one more is closed as soon as it is accepted."""
PER_ADDRESS_CONNECTIONS = 256
"""Open connections one peer address may hold, so one address's idle sockets cannot take every
slot (workers behind one NAT address share it: an `echo2 worker` holds a few)."""
KEEPALIVE_S = 15.0
"""An idle connection, or one that has not finished sending a request's headers, is closed after
this (a request's body is bounded by the handler timeout instead)."""
SWITCH_INTERVAL_S = 0.001
"""The interpreter's thread switch interval while the coordinator serves (the default is 5 ms).
A push being checked keeps the ingest thread busy in Python, and the event loop's thread waits up
to one interval each time it takes the GIL back, several times per request: a heartbeat took tens
of milliseconds at the median during 4,096-record pushes (docs/benchmarks.md)."""
FREEZE_HEAP = True
"""`start` freezes what the process holds (gc.freeze; `stop` undoes it): a full collection then walks
only what arrived since, not the learner's ~400,000 start-up containers with every thread stopped
(~290 ms each during 4,096-record pushes: heartbeat p95 131 -> 6 ms, bench/heartbeat_gc.py).
One freeze per process: two coordinators in one process (tests) share it, and the first `stop`
undoes it for both."""
WORKER_CALLS = {"heartbeat", "lease", "return_lease", "push", "route", "failure", "installed", "sent"}
"""Routes made as one worker: they need that worker's credential, and their body's worker_id must
be the credential's."""
STOPS_WORKER = {f"{API}/{name}" for name in ("register", "heartbeat", "lease", "trajectories")}
"""Calls on which a worker acts on `run_finished` by stopping (the broadcast client's just retry)."""


class Coordinator:
    def __init__(
        self,
        state: CoordinatorState,
        *,
        token: str,
        run_info: RunView | dict[str, Any],
        heartbeat_interval: float,
        status_extra: Callable[[], dict[str, Any]] = dict,
        max_body: int = MAX_BODY,
        uplink_bps: float | None = None,
        stream_bps: float | None = None,
        ssl_context: ssl.SSLContext | None = None,
        any_relay_host: bool = False,
    ) -> None:
        self.ssl_context = ssl_context
        """Serve HTTPS with this context (coordinator.tls_cert / tls_key); None: plain HTTP."""
        self.any_relay_host = any_relay_host
        """Accept a relay_host other than the address a registration came from."""
        self.max_body = max_body
        self.snapshots = SnapshotRoutes(state.publisher, uplink_bps=uplink_bps, stream_bps=stream_bps)
        self.snapshots.on_wrong_snapshot = state.intake.install_refused
        """The learner's end of snapshot broadcast (snapshot_routes.py)."""
        self.poll = PublishedPoll(state)
        """The long poll for publications (longpoll.py)."""
        self.state = state
        self.token = token
        self.run_info = run_info if isinstance(run_info, RunView) else RunView.model_validate(run_info)
        """What workers are told of the run (protocol.RunView), checked once here."""
        self.heartbeat_interval = heartbeat_interval
        self.status_extra = status_extra
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._switch: float | None = None
        """The interpreter's switch interval before `start` lowered it (restored by `stop`)."""
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._expiry: asyncio.Task | None = None
        self.told: set[str] = set()
        """Workers answered `run_finished` (RemoteRollout.close waits for the live ones)."""
        self.ingest_pool: concurrent.futures.ThreadPoolExecutor | None = None
        """The thread pushes are parsed, checked and ingested in (one: they queue, in order)."""
        self.parser = Parser()
        """Parses a large push's body in its own process (pushparse.py), started at the first registration."""
        self.max_connections = MAX_CONNECTIONS
        self.max_connections_per_address = PER_ADDRESS_CONNECTIONS
        self.refused_connections = 0
        """Connections closed at once because MAX_CONNECTIONS were open."""
        self._listener: asyncio.Server | None = None

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.max_body,
            middlewares=[
                status_page.middleware(lambda: self.token),
                guard(self._caller, streams=STREAMS),
                self._finished,
            ],
        )
        app.add_routes(
            [
                web.post(f"{API}/register", self.register, name="register"),
                web.post(f"{API}/heartbeat", self.heartbeat, name="heartbeat"),
                web.post(f"{API}/lease", self.lease, name="lease"),
                web.post(f"{API}/lease/return", self.return_lease, name="return_lease"),
                web.post(f"{API}/trajectories", self.push, name="push"),
                web.get(f"{API}/published", self.poll.handler),
                *self.snapshots.routes(),
                web.get("/status", self.status),
                web.get("/metrics", self.metrics),
                *status_page.routes(),
            ]
        )
        return app

    def _caller(self, request: web.Request) -> str | None:
        """The worker a request is made by (None: the run token's holder), or a refusal."""
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        if scheme != "Bearer" or not presented:
            raise Unauthorized("missing bearer token")
        name = request.match_info.route.name
        # aiohttp decodes header bytes that are not UTF-8 to lone surrogates (surrogateescape):
        # compared as the bytes that came, never encoded strictly
        if hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), self.token.encode()):
            if name in WORKER_CALLS:
                raise Forbidden("a worker's call needs the credential it was given at registration")
            return None
        if name == "register":
            self.state.check_not_banned(presented)  # a quarantined worker's own credential: 403
            raise Unauthorized("registration needs the run token")
        if not presented.isascii():  # credentials are ASCII (identity.credential)
            raise Unauthorized("wrong bearer token")
        worker_id = self.state.authenticate(presented)
        if name not in WORKER_CALLS:  # reads (status, manifests, chunk streams): not numbered
            return worker_id
        try:
            seq = sessions.parse_seq(request.headers.get(identity.SEQ_HEADER))
        except ValueError as e:
            raise errors.Invalid(errors.Reason.MALFORMED, str(e)) from None
        self.state.check_session(worker_id, seq)  # the calls that act: one client (sessions.py)
        return worker_id

    @web.middleware
    async def _finished(self, request: web.Request, handler) -> web.StreamResponse:
        """Once the run is over (state closed), every worker call is answered 410 `run_finished`,
        so workers stop (exit 0) instead of retrying a learner that is gone; `told` keeps who heard."""
        if not (self.state.shared.closed and request.method == "POST" and request.path.startswith(API + "/")):
            return await handler(request)
        try:
            worker_id = json.loads(await request.read()).get("worker_id")
        except (ValueError, AttributeError, RecursionError, web.HTTPRequestEntityTooLarge):
            worker_id = None
        if isinstance(worker_id, str) and request.path in STOPS_WORKER:
            self.told.add(worker_id)
        return refusal(errors.RunFinished("the learner finished this run; stop"))

    # ------------------------------------------------------------------ handlers
    async def register(self, request: web.Request) -> web.Response:
        req = await read_body(request, RegisterRequest)
        self.parser.start()  # ready before this worker's first push (pushparse.py)
        observed = request.remote or ""
        relay_url = identity.relay_url(req.relay_port, req.relay_host, observed, any_host=self.any_relay_host)
        info = await self._blocking(
            self.state.register,
            name=req.name,
            hardware=req.hardware,
            price_per_hour=req.price_per_hour,
            inbound=req.inbound,
            throughput=req.throughput,
            relay_url=relay_url,
            slot_proof=req.slot_proof,
        )
        return web.json_response(
            RegisterResponse(
                worker_id=info.worker_id,
                run=self.run_info,
                heartbeat_interval=self.heartbeat_interval,
                published_version=self.state.shared.published_version,
                public_key=self.state.publisher.public_key,
                credential=self.state.issue_credential(info.worker_id),
                epoch=self.state.epoch,
            ).model_dump()
        )

    async def _blocking(self, fn, *args, **kwargs):
        """`fn` in the loop's default executor: a state call waits for the state's lock, which a
        push being ingested holds, so it never runs on the loop itself."""
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))

    async def heartbeat(self, request: web.Request) -> web.Response:
        req = await read_body(request, HeartbeatRequest)
        state, kw = self.state, {"version": req.version, "throughput": req.throughput}
        if state.shared.lock.acquire(blocking=False):  # free: noted here, no thread hop (an RLock)
            try:
                state.heartbeat(req.worker_id, **kw)
            finally:
                state.shared.lock.release()
        elif not state.heartbeat_later(req.worker_id, **kw):  # held (a push being stored)
            await self._blocking(functools.partial(state.heartbeat, req.worker_id, **kw))  # to raise
        return web.json_response(
            {"published_version": self.state.shared.published_version, "epoch": self.state.epoch}
        )

    async def lease(self, request: web.Request) -> web.Response:
        req = await read_body(request, LeaseRequest)
        lease = await self._blocking(
            self.state.intake.lease, req.worker_id, version=req.version, max_groups=req.max_groups
        )
        if lease is None:
            return web.Response(status=204)
        deadline_s = lease.deadline - self.state.shared.clock()
        body = LeaseResponse(
            lease_id=lease.lease_id,
            indices=list(lease.indices),
            deadline_s=deadline_s,
            sampling_seed=lease.sampling_seed,
        )
        return web.json_response(body.model_dump())

    async def return_lease(self, request: web.Request) -> web.Response:
        req = await read_body(request, ReturnRequest)
        await self._blocking(self.state.intake.return_lease, req.worker_id, req.lease_id)
        return web.json_response({"ok": True})

    async def push(self, request: web.Request) -> web.Response:
        """The sender was authenticated from its headers (guard); its quarantine and the declared
        size are checked before the body is read, and the rest runs on `ingest_pool`."""
        worker_id = request[WORKER]
        if worker_id is not None:
            self.state.intake._check_trusted(worker_id)  # the intake's own rule (intake.py)
        raw = await read_raw(request, limit=self.max_body)
        loop = asyncio.get_running_loop()
        return web.json_response(await loop.run_in_executor(self.ingest_pool, self._ingest, raw, worker_id))

    def _ingest(self, raw: bytes, worker_id: str | None) -> dict[str, int]:
        """Parse, check and ingest one push (blocking: on `ingest_pool`; a body over IN_THREAD
        bytes is parsed in the parser process, pushparse.py)."""
        pusher = self.state.registry.workers.get(worker_id)  # who pushed, as the coordinator knows it
        tag = {"worker": getattr(pusher, "name", worker_id)}
        result = self.parser.outcome(raw, worker_id, tag) if len(raw) > IN_THREAD else None
        result = result or outcome(raw, worker_id, tag)  # None: small, or the parser is starting
        lease_id, records = records_of(result, self.state.intake, worker_id)
        return self.state.intake.ingest(worker_id, lease_id, records)

    def full_status(self) -> dict[str, Any]:
        body = self.state.status()
        body.update(self.status_extra())
        body["clock"] = self.state.shared.clock()  # the time base of `scheduler_decisions`
        return body

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.full_status())

    async def metrics(self, request: web.Request) -> web.Response:
        """The status in the Prometheus text format (coordinator/prom.py)."""
        return web.Response(body=exposition(self.full_status), headers={"Content-Type": prom.CONTENT_TYPE})

    # ------------------------------------------------------------------ lifecycle (own thread)
    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, SWITCH_INTERVAL_S))
        if FREEZE_HEAP:
            gc.collect()
            gc.freeze()
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
        self.snapshots.start()
        self.poll.start()
        self.state.publisher.listeners.append(self.poll.notify)
        self.ingest_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="coordinator-ingest")
        # lingering_time 0: a refused body is not read to its end; the connection closes instead
        self._runner = web.AppRunner(
            self.app(), access_log=None, shutdown_timeout=2.0, keepalive_timeout=KEEPALIVE_S, lingering_time=0
        )
        await self._runner.setup()
        assert self._runner.server is not None
        self._listener = await asyncio.get_running_loop().create_server(
            capped(
                self._runner.server,
                lambda: self.max_connections,
                self._count_refused_connection,
                per_address=lambda: self.max_connections_per_address,
            ),
            host,
            port,
            ssl=self.ssl_context,
            backlog=1024,
        )
        bound = self._listener.sockets[0].getsockname()  # port 0 -> the port the OS chose
        scheme = "https" if self.ssl_context is not None else "http"
        self.url = f"{scheme}://{bound[0]}:{bound[1]}"
        self._expiry = asyncio.get_running_loop().create_task(self._expire_forever())
        logger.info("coordinator listening on %s", self.url)

    def _count_refused_connection(self) -> None:
        self.refused_connections += 1

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.state.registry.heartbeat_timeout / 4))
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.state.expire)  # provider calls
            except Exception:  # e.g. a provider that cannot start a process: log, keep expiring
                logger.exception("expiry/scheduling failed; trying again")

    async def _stop(self) -> None:
        self.poll.stop()  # long polls answer now
        if self.poll.notify in self.state.publisher.listeners:
            self.state.publisher.listeners.remove(self.poll.notify)
        if self._expiry:
            self._expiry.cancel()
        if self._listener:
            self._listener.close()
        if self._runner:
            await self._runner.cleanup()
        if self.ingest_pool:
            self.ingest_pool.shutdown(wait=False, cancel_futures=True)
        self.parser.close()

    def stop(self) -> None:
        """Idempotent: stop serving and join the thread."""
        if self._switch is not None:
            sys.setswitchinterval(self._switch)
            self._switch = None
            if FREEZE_HEAP:
                gc.unfreeze()
        if self._loop and self._thread and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
