"""Snapshot broadcast over loopback as tests/net's broadcast tests drive it: the constants of their
links, `start_coordinator` (a coordinator on port 0 with its broadcast policy), `snapshot_bytes`,
`sha`, `publish`, `bounded` (a coroutine under `asyncio.wait_for`), `get_status` and `give_score`."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import urllib.error
import urllib.request

from support import make_state

from echo2.broadcast.tracker import BroadcastPolicy
from echo2.coordinator.server import Coordinator
from echo2.coordinator.state import CoordinatorState

TOKEN = "bcast-token"
CHUNK = 64 * 1024
WORKER_BPS = 1e6  # the configured Bw_hat, bytes/s
PROGRESS_TIMEOUT = 1.0


def start_coordinator(
    *, mode="chain", chains=2, uplink_bps=None, download_mbps=None, heartbeat_timeout=30.0, **extra
):
    """A coordinator whose plan has `chains` chains until transfers are measured."""
    state = make_state(
        **extra,
        heartbeat_timeout=heartbeat_timeout,
        heartbeat_interval=0.2,  # the Coordinator's below
        broadcast=BroadcastPolicy(
            mode=mode, chunk_size=CHUNK, uplink_budget_bps=chains * WORKER_BPS, worker_bps=WORKER_BPS
        ),
    )
    run_info = {  # no stall floor: these tests judge relays by the coordinator's slow-relay floor
        "broadcast": {
            "progress_timeout_s": PROGRESS_TIMEOUT,
            "worker_download_mbps": download_mbps,
            "min_relay_mbps": 0.0,
        }
    }
    server = Coordinator(state, token=TOKEN, run_info=run_info, heartbeat_interval=0.2, uplink_bps=uplink_bps)
    server.start()
    return server, state


def snapshot_bytes(version: int, size: int = 2 * 2**20) -> bytes:
    return random.Random(version).randbytes(size)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def publish(state: CoordinatorState, version: int) -> str:
    data = snapshot_bytes(version)
    state.publisher.publish(version, data, keep=2)
    return sha(data)


def bounded(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def get_status(server) -> dict:
    req = urllib.request.Request(server.url + "/status", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def give_score(state: CoordinatorState, worker_id: str) -> None:
    """History that ranks this worker first (it becomes the seed of a chain)."""
    with state.shared.lock:
        for t in range(10):
            state.publisher.bcast._stats(worker_id).record_transfer(10**8, 1.0, now=state.shared.clock() + t)
