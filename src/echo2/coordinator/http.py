"""The coordinator's HTTP plumbing, shared by its route objects (coordinator.py, snapshot_routes.py):
the guard middleware that names the caller and turns every refusal into its answer, the reading of
a body into its request model, and the one JSON shape of a refusal.

Knows aiohttp and the refusals of errors.py; knows no state and no route: the caller's
authentication is the coordinator's, passed in.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable

from aiohttp import web
from pydantic import ValidationError

from echo2.coordinator.pushparse import parse_body
from echo2.wire import errors, validate
from echo2.wire.errors import Reason, Refused

logger = logging.getLogger(__name__)

HANDLER_TIMEOUT = 30.0
WORKER = web.RequestKey("worker", str)
"""The worker a request is made as (None: the run token's holder)."""


def error_response(status: int, reason: str, detail: str) -> web.Response:
    return web.json_response({"error": reason, "detail": detail}, status=status)


def refusal(error: Refused) -> web.Response:
    """The one answer to every refusal: its class's status, `{"error": reason, "detail": ...}`."""
    assert error.status >= 400, f"{type(error).__name__} has no HTTP status"
    return error_response(error.status, error.reason, error.detail)


def guard(caller: Callable[[web.Request], str | None], *, streams: set[str]):
    """The middleware every request passes: `caller(request)` names who makes it (`WORKER`, or a
    refusal), the handler runs within HANDLER_TIMEOUT (routes named in `streams` have a timeout per
    write instead), and whatever it raises is answered in JSON."""

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        try:
            request[WORKER] = caller(request)
            if request.match_info.route.name in streams:
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
            return refusal(errors.TooLarge(validate.printable(e.text)))
        except TimeoutError:
            return error_response(503, "timeout", f"handler took over {HANDLER_TIMEOUT}s")
        except web.HTTPException as e:  # no route (404), wrong method (405): JSON like every answer
            if e.status < 400:
                raise
            detail = f"{request.method} {validate.printable(request.path)}: {e.reason}"
            cls = {404: errors.NotFound, 405: errors.MethodNotAllowed}.get(e.status)
            return refusal(cls(detail)) if cls else error_response(e.status, "http_error", detail)
        except Exception:  # a bug, not the peer's fault: logged, answered in JSON, the server lives on
            logger.exception("%s %s failed", request.method, validate.printable(request.path))
            return error_response(500, "internal", "the coordinator failed on this request (logged)")

    return middleware


async def read_body(request: web.Request, model, *, limit: int = validate.SMALL_BODY):
    """The body as `model`: JSON of at most `limit` bytes (`max_body` for pushes), nested no deeper
    than the decoder's recursion limit, and made as the caller's own worker if it names one."""
    return parse_body(await read_raw(request, limit=limit), model, request[WORKER])


async def read_raw(request: web.Request, *, limit: int) -> bytes:
    """The body's bytes, at most `limit`: a declared length over it is refused (413) before a byte
    is read, and an undeclared (chunked) one as soon as it passes it."""
    if (request.content_length or 0) > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    raw = await request.read()
    if len(raw) > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(raw))
    return raw


def capped(
    server: web.Server,
    limit: Callable[[], int],
    on_refused: Callable[[], None],
    per_address: Callable[[], int] | None = None,
) -> Callable[[], asyncio.BaseProtocol]:
    """A protocol factory for aiohttp's `server` (which has no connection cap of its own): over
    `limit()` open connections, or over `per_address()` from the connection's peer address (both
    read at each connection), a new one is closed as soon as it is made (`on_refused` counts it),
    so one address holding idle sockets cannot take the slots every other address needs."""
    counts: Counter[str] = Counter()

    def protocol() -> asyncio.BaseProtocol:
        if len(server.connections) >= limit():
            on_refused()
            return _Refuse()
        if per_address is None:
            return server()
        return _PerAddress(server, counts, per_address(), on_refused)

    return protocol


class _Refuse(asyncio.Protocol):
    """A connection over the cap: closed as soon as it is made."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.abort()


class _PerAddress(asyncio.Protocol):
    """A connection counted against its peer address while it is open: closed at once when its
    address already holds `limit`; otherwise aiohttp's handler, made here and fed every event."""

    def __init__(self, server: web.Server, counts: Counter[str], limit: int, on_refused: Callable[[], None]):
        self.server, self.counts, self.limit, self.on_refused = server, counts, limit, on_refused
        self.address: str | None = None
        self.handler: asyncio.Protocol | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if self.counts[address] >= self.limit:
            self.on_refused()
            transport.abort()
            return
        self.counts[address] += 1
        self.address = address
        self.handler = self.server()
        self.handler.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.address is not None:
            self.counts[self.address] -= 1
            if self.counts[self.address] <= 0:
                del self.counts[self.address]
            self.address = None
        if self.handler is not None:
            self.handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.handler is not None:
            self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.handler is not None else None

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()
