"""A hostile relay and an on-path proxy, on real loopback (port 0), for the adversarial suite.

`HostileRelay` answers `GET /v1/chunks/{v}` the way a relay an attacker runs would: with a redirect
to another URL (`redirect_to`), or by dripping valid chunk bytes of a real snapshot slowly (`drip`:
`piece` bytes every `every` seconds). It records every request's headers, so a test can check what
a worker sent it (a bearer token to capture). `register_relay` enrols it with a coordinator as a
worker whose relay it is, and keeps that worker alive with heartbeats.

`KeySwapProxy` sits between a worker and the coordinator, passing everything through until `swap`
is set; from then on it answers with its own key in registration replies, its own signed manifest
and its own chunks (a snapshot of its choosing), and refuses the next calls as `unknown_worker`
so the worker registers again through it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.broadcast.blob import make_blob
from echo2.broadcast.chunks import public_key_hex
from echo2.broadcast.stream import GONE, HEADER, KEEPALIVE, parse_range


class HostileRelay:
    def __init__(
        self,
        *,
        redirect_to: str | None = None,
        blob=None,
        piece: int = 64 * 1024,
        every: float = 0.9,
        stall_then_gone: float | None = None,
    ) -> None:
        self.redirect_to = redirect_to
        self.stall_then_gone = stall_then_gone
        """Seconds of keep-alive frames (every 0.2 s) before a "gone" frame, no chunk ever sent."""
        self.blob = blob
        """The real snapshot whose bytes a drip sends (valid, so only its rate is hostile)."""
        self.piece, self.every = piece, every
        self.requests: list[dict[str, str]] = []
        """Headers of every request received, in order."""
        self.bytes_sent = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.add_routes([web.get("/{tail:.*}", self._handle)])
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def authorizations(self) -> list[str]:
        return [h["Authorization"] for h in self.requests if "Authorization" in h]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(dict(request.headers))
        if self.redirect_to is not None:
            raise web.HTTPFound(self.redirect_to + request.path_qs)
        if self.stall_then_gone is not None:
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            await resp.prepare(request)
            try:
                until = asyncio.get_running_loop().time() + self.stall_then_gone
                while asyncio.get_running_loop().time() < until:
                    await resp.write(HEADER.pack(KEEPALIVE, 0))
                    await asyncio.sleep(0.2)
                await resp.write(HEADER.pack(GONE, 0))
            except (ConnectionError, asyncio.CancelledError):
                pass
            return resp
        if self.blob is None:
            return web.json_response({"error": "not_held", "detail": "nothing here"}, status=404)
        start, _ = parse_range(request.query, self.blob.manifest.num_chunks)
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await resp.prepare(request)
        try:
            for index in range(start, self.blob.manifest.num_chunks):
                data = bytes(self.blob.chunks[index])
                await resp.write(HEADER.pack(index, len(data)))
                for at in range(0, len(data), self.piece):
                    await resp.write(data[at : at + self.piece])
                    self.bytes_sent += len(data[at : at + self.piece])
                    await asyncio.sleep(self.every)
        except (ConnectionError, asyncio.CancelledError):
            pass
        return resp


async def register_relay(url: str, token: str, port: int, name: str = "mallory") -> dict[str, Any]:
    """Register a worker whose relay listens on 127.0.0.1:`port`; returns the registration reply
    (and `auth`, the headers its calls carry: its credential where the coordinator issues one)."""
    async with aiohttp.ClientSession() as s:
        body = {"name": name, "inbound": True, "relay_port": port}
        async with s.post(f"{url}/v1/register", json=body, headers=bearer(token)) as r:
            assert r.status == 200, await r.text()
            reply = await r.json()
    reply["auth"] = bearer(reply.get("credential", token))
    return reply


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def keep_alive(url: str, reply: dict, stop: asyncio.Event, interval: float = 0.2) -> None:
    """Heartbeat as the registered worker until `stop` (a relay that never answers as a worker
    would otherwise be marked lost)."""
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            body = {"worker_id": reply["worker_id"], "version": -1}
            async with s.post(f"{url}/v1/heartbeat", json=body, headers=reply["auth"]) as r:
                await r.read()
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except TimeoutError:
                pass


class KeySwapProxy:
    """An on-path proxy in front of the coordinator at `upstream`."""

    def __init__(self, upstream: str, fake_snapshot: bytes, chunk_size: int) -> None:
        self.upstream = upstream
        self.key = Ed25519PrivateKey.generate()
        self.public_key = public_key_hex(self.key)
        self.fake_snapshot, self.chunk_size = fake_snapshot, chunk_size
        self.swap = False
        self.forced: set[str] = set()
        """Credentials (or tokens) already refused once as unknown after `swap` was set."""
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> str:
        self._session = aiohttp.ClientSession()
        app = web.Application(client_max_size=64 * 2**20)
        app.add_routes([web.route("*", "/{tail:.*}", self._handle)])
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()

    def fake(self, version: int):
        return make_blob(version, self.fake_snapshot, self.chunk_size, self.key)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path, body = request.path, await request.read()
        auth = request.headers.get("Authorization", "")
        if self.swap and path.startswith("/v1/manifest/"):
            return web.json_response(self.fake(int(path.rsplit("/", 1)[1])).manifest.model_dump())
        if self.swap and path.startswith("/v1/chunks/"):
            blob = self.fake(int(path.rsplit("/", 1)[1]))
            resp = web.StreamResponse()
            await resp.prepare(request)
            start, _ = parse_range(request.query, blob.manifest.num_chunks)
            for index in range(start, blob.manifest.num_chunks):
                await resp.write(HEADER.pack(index, len(blob.chunks[index])) + bytes(blob.chunks[index]))
            await resp.write_eof()
            return resp
        if self.swap and path != "/v1/register" and path.startswith("/v1/") and request.method == "POST":
            if auth not in self.forced:  # make the worker register again, through us
                self.forced.add(auth)
                return web.json_response({"error": "unknown_worker", "detail": "register again"}, status=404)
        headers = {k: v for k, v in request.headers.items() if k in ("Authorization", "Content-Type")}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=body or None, headers=headers
        ) as up:
            payload = await up.read()
            if self.swap and path == "/v1/register" and up.status == 200:
                reply = json.loads(payload)
                reply["public_key"] = self.public_key
                return web.json_response(reply)
            return web.Response(body=payload, status=up.status, content_type=up.content_type)
