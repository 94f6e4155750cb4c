"""A broadcast-only worker (no model): `BroadcastPeer`, and `python -m echo2.broadcast.relay` which runs
one as a process (what `python bench/broadcast.py` starts per host). The API is in relay.py's docstring.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import Any

import aiohttp

from echo2.broadcast.client import BroadcastClient, CoordinatorError, _sleep_unless, client_for
from echo2.broadcast.relay import API, FAULT_FLIP_BYTE_ENV, ChunkStore, RelayServer

logger = logging.getLogger(__name__)


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
            self.client = client_for(
                self.url,
                self.token,
                self.worker_id,
                self.store,
                self.relay,
                reply,
                upload_mbps=self.upload_mbps,
                download_mbps=self.download_mbps,
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
