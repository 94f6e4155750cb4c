"""A broadcast-only worker (no model): `BroadcastPeer`, a `Worker` without an engine, and
`python -m echo2.rollout.broadcast_peer`, which runs one as a process (what `python bench/broadcast.py` starts
per host or network namespace). The API is in relay.py's docstring.

It shares the rollout worker's loop (rollout/worker.py): registration, heartbeats, snapshot
following, re-registration after an unknown-worker refusal and stopping when released all take the
same route. It replaces what needs an engine: it builds none, leases nothing, and "installs" a
snapshot by recording its digest. Imports no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from echo2.broadcast.chunks import SnapshotBytes
from echo2.rollout.broadcast_client import BroadcastClient, sleep_unless
from echo2.rollout.worker import Worker, WorkerConfig

logger = logging.getLogger(__name__)


class BroadcastPeer(Worker):
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
        learner_key: str | None = None,
        ca_file: str | None = None,
    ) -> None:
        config = WorkerConfig(
            url=coordinator_url,
            token=token,
            name=name,
            hardware="broadcast-only",
            inbound=inbound,
            relay_host=relay_host,
            relay_port=relay_port,
            relay_advertise=advertise_host,
            upload_mbps=upload_mbps,
            download_mbps=download_mbps,
            learner_key=learner_key,
            ca_file=ca_file,
        )
        super().__init__(config)
        self.installed: dict[int, str] = {}
        """Version -> SHA-256 of the snapshot bytes installed (verified before)."""

    @property
    def client(self) -> BroadcastClient | None:
        """The broadcast client, once registered."""
        return self.bcast

    @property
    def version(self) -> int:
        return self.bcast.installed_version if self.bcast is not None else -1

    async def prepare(self) -> None:
        """No engine to build."""

    async def step(self, stop: asyncio.Event) -> None:
        """Nothing to lease: the broadcast task does the work; wait."""
        await sleep_unless(stop, self.heartbeat_interval)

    async def install_snapshot(self, version: int, data: SnapshotBytes) -> None:
        self.installed[version] = self.bcast.digests[version]  # hashed once, in fetch


def main(argv: list[str] | None = None) -> int:
    """`python -m echo2.rollout.broadcast_peer`: one broadcast-only worker until SIGTERM/Ctrl-C."""
    p = argparse.ArgumentParser(
        prog="python -m echo2.rollout.broadcast_peer", description=BroadcastPeer.__doc__
    )
    p.add_argument("--coordinator", required=True, metavar="URL")
    p.add_argument("--token", default=os.environ.get("ECHO2_TOKEN"))
    p.add_argument("--name", required=True)
    p.add_argument("--inbound", action="store_true", help="serve chunks to a child (relay role)")
    p.add_argument("--relay-host", default="0.0.0.0")
    p.add_argument("--relay-port", type=int, default=0)
    p.add_argument("--relay-advertise", default=None, metavar="HOST")
    p.add_argument("--upload-mbps", type=float, default=None)
    p.add_argument("--download-mbps", type=float, default=None)
    p.add_argument("--learner-key", default=None, metavar="FINGERPRINT")
    p.add_argument("--ca-file", default=None, metavar="PEM")
    p.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)
    if not args.token:
        p.error("--token: missing (or set ECHO2_TOKEN)")
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO)

    async def run() -> None:
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
            learner_key=args.learner_key,
            ca_file=args.ca_file,
        )
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await peer.run(stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
