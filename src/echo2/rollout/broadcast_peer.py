"""A broadcast-only worker (no model): `BroadcastPeer`, and `python -m echo2.rollout.broadcast_peer`,
which runs one as a process (what `python bench/broadcast.py` starts per host or network namespace).
The API is in relay.py's docstring.

A peer is a `Membership` (rollout/membership.py: registration, heartbeats, snapshot following with
its `BroadcastClient`, re-registration after an unknown-worker refusal, stopping when released),
the same one a rollout worker has, and nothing else: it builds no engine, leases nothing, and
"installs" a snapshot by recording its digest. Its flags are `PeerConfig`'s fields
(rollout/worker_config.py), as `echo2 worker`'s are. Imports no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from echo2.broadcast.chunks import SnapshotBytes
from echo2.config import ConfigError
from echo2.rollout.broadcast_client import BroadcastClient
from echo2.rollout.membership import Membership
from echo2.rollout.worker_config import PeerConfig, add_flags, from_flags

logger = logging.getLogger(__name__)

HARDWARE = "broadcast-only"
"""What a peer registers as its hardware (shown in /status)."""


class BroadcastPeer:
    """A worker that only receives and relays snapshots (no model): registers (as a relay when
    `inbound`), heartbeats its installed version, follows every published version and reports each
    install. Caps in Mbit/s; None takes the run's `broadcast.worker_*_mbps`."""

    def __init__(self, config: PeerConfig) -> None:
        self.member = Membership(config, version=lambda: self.version)
        self.installed: dict[int, str] = {}
        """Version -> SHA-256 of the snapshot bytes installed (verified before)."""

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop` is set or the coordinator releases this peer."""
        await self.member.serve(stop, install=self._install, work=stop.wait)

    async def _install(self, version: int, data: SnapshotBytes) -> None:
        self.installed[version] = self.client.digests[version]  # hashed once, in fetch

    @property
    def client(self) -> BroadcastClient | None:
        """The broadcast client, once registered."""
        return self.member.bcast

    @property
    def version(self) -> int:
        return self.client.installed_version if self.client is not None else -1

    @property
    def worker_id(self) -> str | None:
        return self.member.worker_id


def main(argv: list[str] | None = None) -> int:
    """`python -m echo2.rollout.broadcast_peer`: one broadcast-only worker until SIGTERM/Ctrl-C."""
    p = argparse.ArgumentParser(
        prog="python -m echo2.rollout.broadcast_peer", description=BroadcastPeer.__doc__
    )
    add_flags(p, PeerConfig, exclude=("hardware", "price_per_hour"), token=os.environ.get("ECHO2_TOKEN"))
    p.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)
    try:
        config = from_flags(PeerConfig, args, hardware=HARDWARE)
    except ConfigError as e:
        p.error(str(e))
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO)

    async def run() -> None:
        peer = BroadcastPeer(config)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await peer.run(stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
