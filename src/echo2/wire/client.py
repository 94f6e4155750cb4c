"""The one HTTP client of the coordinator's API (docs/protocol.md): `CoordinatorClient`.

Owns the caller's side of the wire: one aiohttp session, the credentials (the run's token for
registration; from then on the worker's own credential, which `register` keeps from the reply),
TLS (an https URL, verified against the system's CAs or `ca_file`), one typed coroutine per endpoint
built on the pydantic models of protocol.py, a timeout on every call, refusals raised as the very
classes the coordinator raised (wire/errors.py, picked by status and JSON `error` reason), and
ONE retry policy
(tenacity): connection errors, timeouts and 5xx answers are retried with capped exponential backoff,
bounded in attempts and in time, each retry logged; a 4xx answer is never retried. What a refusal
means to the caller (register again, drop a batch, stop) is the caller's business: this module does
not know what a worker or a snapshot is for.

Usage::

    async with await CoordinatorClient.create(url, token, retry=RetryPolicy(give_up_after=60)) as c:
        reply = await c.register(RegisterRequest(name="w"))
        lease = await c.lease(LeaseRequest(worker_id=reply.worker_id, version=-1, max_groups=1))

The session is also what the broadcast client streams chunks with, so a worker holds one session
in all; it carries no default credential (`auth_headers()` is added to coordinator calls only, so
nothing is ever sent to a relay) and follows no redirect.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import BaseModel
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)
from tenacity.stop import stop_base

from echo2.aio import sleep_unless
from echo2.wire import errors
from echo2.wire.errors import Refused
from echo2.wire.identity import SEQ_HEADER
from echo2.wire.protocol import (
    API,
    FailureRequest,
    HeartbeatRequest,
    HeartbeatResponse,
    InstalledRequest,
    LeaseRequest,
    LeaseResponse,
    Published,
    PushRequest,
    PushResponse,
    RegisterRequest,
    RegisterResponse,
    ReturnRequest,
    Route,
    RouteRequest,
    SentRequest,
)

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- refusals
class ServerError(Exception):
    """5xx: the coordinator failed to answer (transient; retried, never raised by `call`)."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status, self.body = status, body


class Unreachable(ConnectionError):
    """The retry policy gave up: the coordinator could not be reached (or kept failing) for
    `give_up_after` seconds or `max_attempts` attempts, or the caller's stop event was set."""


def refusal(status: int, body: Any) -> Refused | ServerError:
    """The exception for an error answer (status >= 400): the refusal's own class
    (wire/errors.py, by status and reason), or a transient `ServerError` for a 5xx."""
    return ServerError(status, body) if status >= 500 else errors.from_answer(status, body)


def is_transient(e: BaseException) -> bool:
    """Worth retrying: the request may succeed as it is a moment later."""
    return isinstance(e, ServerError | aiohttp.ClientConnectionError | TimeoutError | OSError)


# ---------------------------------------------------------------------------- retry policy
@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """Capped exponential backoff for transient failures, bounded in attempts and in time."""

    max_attempts: int = 200
    give_up_after: float = 300.0
    """Seconds from the first attempt after which no new attempt starts."""
    initial_delay: float = 0.2
    max_delay: float = 5.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before attempt `attempt + 1` (the same backoff tenacity applies)."""
        return min(self.initial_delay * 2**attempt, self.max_delay)

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.give_up_after < 0 or not 0 < self.initial_delay <= self.max_delay:
            raise ValueError(f"retry policy out of range: {self}")


NO_RETRY = RetryPolicy(max_attempts=1)


class _StopWhenSet(stop_base):
    def __init__(self, event: asyncio.Event | None) -> None:
        self.event = event

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.event is not None and self.event.is_set()


# ---------------------------------------------------------------------------- client
class CoordinatorClient:
    """Typed calls to one coordinator. Build with `await CoordinatorClient.create(...)` or use as
    an async context manager; `close()` is idempotent. `stop`, if given, ends retries (and the
    sleeps between them) as soon as it is set."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        retry: RetryPolicy | None = None,
        call_timeout: float = 60.0,
        stop: asyncio.Event | None = None,
        ca_file: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.credential: str | None = None
        """This worker's own credential, from the registration reply (None until registered)."""
        self.credentials: dict[str, str] = {}
        """Credential of each worker id this client registered as (a call still in flight as an
        earlier id, after registering again, goes with that id's credential)."""
        self._seq = itertools.count(1)
        """The number on this client's next call made with a credential (coordinator/sessions.py)."""
        self.retry = retry or RetryPolicy()
        self.call_timeout = call_timeout
        self.stop = stop
        self.retries = 0
        """Attempts that failed transiently and were retried (for tests and status)."""
        context = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context or True))

    @classmethod
    async def create(cls, url: str, token: str, **kw: Any) -> CoordinatorClient:
        """Build in a running event loop (aiohttp sessions belong to one)."""
        return cls(url, token, **kw)

    async def close(self) -> None:
        if not self.session.closed:
            await self.session.close()

    async def __aenter__(self) -> CoordinatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def auth_headers(self, *, run_token: bool = False, worker_id: str | None = None) -> dict[str, str]:
        """What a call to the coordinator carries: the credential of the worker it is made as (the
        newest one when no id is named; the run token for registration, or before). Never sent
        anywhere else."""
        secret = self.credentials.get(worker_id or "") or self.credential
        return {"Authorization": f"Bearer {self.token if run_token or secret is None else secret}"}

    # ------------------------------------------------------------------ the one request path
    async def _once(self, method: str, path: str, body: BaseModel | None, timeout: float, params) -> Any:
        data = body.model_dump_json() if body is not None else None  # the model straight to JSON
        t = aiohttp.ClientTimeout(total=timeout, connect=min(10.0, timeout))
        run_token = path == f"{API}/register"
        headers = self.auth_headers(run_token=run_token, worker_id=getattr(body, "worker_id", None))
        if not run_token and self.credential is not None:  # each attempt a new number (sessions.py)
            headers[SEQ_HEADER] = str(next(self._seq))
        if data is not None:
            headers["Content-Type"] = "application/json"
        async with self.session.request(
            method,
            self.url + path,
            data=data,
            params=params,
            timeout=t,
            headers=headers,
            allow_redirects=False,
        ) as resp:
            if resp.status == 204:
                return None
            if 300 <= resp.status < 400:  # never followed: the credential would go with it
                raise Refused.from_answer(
                    resp.status, {"error": "redirect", "detail": "redirects are not followed"}
                )
            data = await resp.json(content_type=None)
            if resp.status >= 400:
                raise refusal(resp.status, data)
            return data

    async def call(
        self,
        method: str,
        path: str,
        body: BaseModel | None = None,
        *,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
        params: dict[str, Any] | None = None,
    ) -> Any:
        """One API call: the JSON answer (None for 204), the refusal's own class (wire/errors.py),
        Unreachable once the retry policy gives up on transient failures."""
        policy = retry or self.retry
        started = time.monotonic()

        def log_retry(state: RetryCallState) -> None:
            self.retries += 1
            e = state.outcome.exception() if state.outcome else None
            wait = state.next_action.sleep if state.next_action else 0.0
            logger.info("%s %s failed (%r); retry %d in %.1fs", method, path, e, state.attempt_number, wait)

        retrying = AsyncRetrying(
            stop=stop_after_attempt(policy.max_attempts)
            | stop_after_delay(policy.give_up_after)
            | _StopWhenSet(self.stop),
            wait=wait_exponential(multiplier=policy.initial_delay, max=policy.max_delay),
            retry=retry_if_exception(is_transient),
            before_sleep=log_retry,
            sleep=self._sleep,
            reraise=True,
        )
        try:
            return await retrying(self._once, method, path, body, timeout or self.call_timeout, params)
        except Exception as e:
            if not is_transient(e):
                raise
            raise Unreachable(
                f"{method} {path}: gave up after {time.monotonic() - started:.0f}s: {e!r}"
            ) from e

    async def _sleep(self, seconds: float) -> None:
        await (asyncio.sleep(seconds) if self.stop is None else sleep_unless(self.stop, seconds))

    # ------------------------------------------------------------------ rollout
    async def register(self, req: RegisterRequest) -> RegisterResponse:
        """Register (with the run token); the reply's credential is used for every later call."""
        reply = RegisterResponse.model_validate(await self.call("POST", f"{API}/register", req))
        self.credential = self.credentials[reply.worker_id] = reply.credential
        while len(self.credentials) > 8:  # ids older than that have long been refused as unknown
            del self.credentials[next(iter(self.credentials))]
        return reply

    async def heartbeat(self, req: HeartbeatRequest) -> HeartbeatResponse:
        """One heartbeat, not retried (the next one follows)."""
        reply = await self.call("POST", f"{API}/heartbeat", req, retry=NO_RETRY)
        return HeartbeatResponse.model_validate(reply)

    async def lease(self, req: LeaseRequest) -> LeaseResponse | None:
        """A lease of prompts, or None when there is nothing to do now."""
        reply = await self.call("POST", f"{API}/lease", req)
        return None if reply is None else LeaseResponse.model_validate(reply)

    async def return_lease(self, req: ReturnRequest, *, timeout: float = 5.0) -> None:
        """Give a lease back (on stop): one attempt, short timeout."""
        await self.call("POST", f"{API}/lease/return", req, retry=NO_RETRY, timeout=timeout)

    async def push(self, req: PushRequest) -> PushResponse:
        """Push a batch; retried safely (ingestion is idempotent)."""
        return PushResponse.model_validate(await self.call("POST", f"{API}/trajectories", req))

    # ------------------------------------------------------------------ snapshot broadcast
    async def published(self, *, after: int = -1, wait: float = 20.0) -> int:
        """Long poll: the newest published version, as soon as it is newer than `after`."""
        reply = await self.call(
            "GET", f"{API}/published", params={"after": after, "wait": wait}, timeout=wait + self.call_timeout
        )
        return Published.model_validate(reply).version

    async def manifest(self, version: int, form: str = "full") -> dict[str, Any]:
        """The signed manifest of `version` (in `form`: "full" or "delta") as sent: the receiver
        parses it with `manifest_of` (broadcast/chunks.py), which tells a malformed or forged
        manifest from a refusal."""
        params = {"form": form} if form != "full" else None
        return await self.call("GET", f"{API}/manifest/{version}", params=params)

    async def route(self, req: RouteRequest) -> Route:
        return Route.model_validate(await self.call("POST", f"{API}/broadcast/route", req))

    async def report_failure(self, req: FailureRequest) -> Route:
        """Report the parent that failed; returns the new route."""
        return Route.model_validate(await self.call("POST", f"{API}/broadcast/failure", req))

    async def report_installed(self, req: InstalledRequest) -> None:
        await self.call("POST", f"{API}/broadcast/installed", req)

    async def report_sent(self, req: SentRequest) -> None:
        """A relay's account of a stream it served (one attempt: the next stream sends another)."""
        await self.call("POST", f"{API}/broadcast/sent", req, retry=NO_RETRY)
