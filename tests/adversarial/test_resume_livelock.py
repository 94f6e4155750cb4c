"""A restarted learner is a new epoch: workers that hold versions it has not published drop them and
reinstall, and no lease is granted to a worker whose version it cannot admit.

What was seen: with checkpoint_every = 3 a SIGKILLed learner resumed at version 6 while workers held
version 7; leases were granted and 13,440 pushes were refused as future_version in 150 s."""

from __future__ import annotations

import asyncio
import hashlib
import random

import pytest
from support import make_state

from echo2.broadcast.tracker import BroadcastPolicy
from echo2.coordinator.server import Coordinator
from echo2.rollout.broadcast_peer import BroadcastPeer
from echo2.rollout.worker_config import PeerConfig
from echo2.wire.errors import Invalid

TOKEN = "epoch-token"
CHUNK = 64 * 1024


def test_no_lease_for_a_version_the_learner_has_not_published():
    state = make_state()
    wid = state.register(name="w", hardware="x", price_per_hour=0.0, inbound=False).worker_id
    state.publisher.publish(6, b"v6", keep=2)
    with pytest.raises(Invalid) as e:
        state.intake.lease(wid, version=7, max_groups=1)
    assert e.value.reason == "future_version"
    assert not state.intake.ingestion.leases and state.intake.ingestion.next_index == 0
    assert state.intake.lease(wid, version=6, max_groups=1) is not None


def snapshot(seed: int) -> bytes:
    return random.Random(seed).randbytes(3 * CHUNK)


def coordinator(state, port: int = 0) -> Coordinator:
    server = Coordinator(
        state, token=TOKEN, run_info={"broadcast": {"progress_timeout_s": 2.0}}, heartbeat_interval=0.2
    )
    server.start(port=port)
    return server


def test_a_worker_ahead_of_a_restarted_learner_drops_its_version_and_reinstalls():
    """The first learner publishes versions 0..2 and dies; the second (same key, same address, a new
    epoch) resumes at version 1 with other weights. The worker registers again, drops version 2,
    installs the new version 1 and heartbeats it, so leases are granted again."""
    key_state = make_state(broadcast=BroadcastPolicy(mode="star", chunk_size=CHUNK))
    first = coordinator(key_state)
    port = int(first.url.rsplit(":", 1)[1])
    second = None

    async def scenario():
        nonlocal second
        stop = asyncio.Event()
        peer = BroadcastPeer(PeerConfig(url=first.url, token=TOKEN, name="w"))
        task = asyncio.create_task(peer.run(stop))
        try:
            for v in range(3):
                key_state.publisher.publish(v, snapshot(v), keep=2)
            while peer.version != 2:
                assert not task.done()
                await asyncio.sleep(0.02)
            first.stop()
            resumed = make_state(
                broadcast=BroadcastPolicy(mode="star", chunk_size=CHUNK), signing_key=key_state.publisher.signing_key
            )
            second = coordinator(resumed, port)
            new_v1 = snapshot(101)
            resumed.publisher.publish(1, new_v1, keep=2)
            deadline = asyncio.get_running_loop().time() + 20
            while not (peer.installed.get(1) == hashlib.sha256(new_v1).hexdigest() and peer.version == 1):
                assert asyncio.get_running_loop().time() < deadline, (peer.version, peer.installed)
                assert not task.done()
                await asyncio.sleep(0.05)
            while peer.worker_id not in resumed.registry.workers or resumed.registry.workers[peer.worker_id].version != 1:
                assert asyncio.get_running_loop().time() < deadline, "heartbeats carry version 1"
                await asyncio.sleep(0.05)
            assert resumed.intake.lease(peer.worker_id, version=peer.version, max_groups=1) is not None
        finally:
            stop.set()
            await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        first.stop()
        if second is not None:
            second.stop()
