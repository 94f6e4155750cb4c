"""Relays are untrusted: a hostile relay (hostile_relay.py) that redirects, listens for credentials
or drips bytes gets nothing and holds nobody up, and a worker cannot point its children at another
host. Each test starts a coordinator whose one chain is headed by the hostile relay, and an honest
broadcast-only peer that is routed to it first."""

from __future__ import annotations

import asyncio
import hashlib
import random

import pytest
from hostile_relay import HostileRelay, bearer, keep_alive, register_relay
from support import make_state

from echo2.broadcast.tracker import BroadcastPolicy
from echo2.coordinator.server import Coordinator
from echo2.rollout.broadcast_peer import BroadcastPeer
from echo2.rollout.worker_config import PeerConfig

TOKEN = "relay-trust-token"
CHUNK = 512 * 1024
WORKER_BPS = 1e6
PROGRESS_TIMEOUT = 1.0


def bounded(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def start_coordinator(**kw) -> tuple[Coordinator, object]:
    state = make_state(
        heartbeat_timeout=30.0,
        broadcast=BroadcastPolicy(
            mode="chain", chunk_size=CHUNK, uplink_budget_bps=WORKER_BPS, worker_bps=WORKER_BPS
        ),
    )
    run_info = {"broadcast": {"progress_timeout_s": PROGRESS_TIMEOUT, "min_relay_mbps": 1.0}}
    server = Coordinator(state, token=TOKEN, run_info=run_info, heartbeat_interval=0.2, **kw)
    server.start()
    return server, state


async def honest_peer_behind(hostile: HostileRelay, *, arm=None, wait_s: float = 30.0):
    """Coordinator + the hostile relay at the head of the one chain + an honest peer. Publishes one
    version (`arm(state)` runs right after, e.g. to hand the relay the real bytes) and waits up to
    `wait_s` for the peer to install it. Returns (state, mallory's id, the peer, the data)."""
    server, state = start_coordinator()
    stop = asyncio.Event()
    tasks: list[asyncio.Task] = []
    await hostile.start()
    try:
        mallory = await register_relay(server.url, TOKEN, hostile.port)
        for t in range(10):  # a fine history: the planner makes it the chain's head
            state.publisher.bcast._stats(mallory["worker_id"]).record_transfer(
                10**8, 1.0, now=state.shared.clock() + t
            )
        peer = BroadcastPeer(PeerConfig(url=server.url, token=TOKEN, name="honest"))
        tasks += [
            asyncio.create_task(keep_alive(server.url, mallory, stop)),
            asyncio.create_task(peer.run(stop)),
        ]
        while peer.client is None:
            await asyncio.sleep(0.02)
        data = random.Random(0).randbytes(2 * CHUNK)
        state.publisher.publish(0, data, keep=2)
        assert state.publisher.bcast.plans[0].parent_of(peer.worker_id) == mallory["worker_id"]
        if arm is not None:
            arm(state)
        deadline = asyncio.get_running_loop().time() + wait_s
        while 0 not in peer.installed and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return state, mallory["worker_id"], peer, data
    finally:
        stop.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert not any(isinstance(r, Exception) for r in results), results
        await hostile.stop()
        server.stop()


def test_a_relay_redirect_is_not_followed():
    """What was seen: a relay answering 302 was followed to any URL. Now the redirect is a refusal:
    the target is never asked, the relay is reported, and the peer gets the version elsewhere."""

    async def scenario():
        catcher = HostileRelay()
        await catcher.start()
        try:
            relay = HostileRelay(redirect_to=catcher.url)
            state, mallory, peer, data = await honest_peer_behind(relay)
        finally:
            await catcher.stop()
        assert relay.requests, "the peer asked the relay"
        assert catcher.requests == [], "the redirect was not followed"
        assert (0, mallory, "refused") in peer.client.failures
        assert peer.installed.get(0) == hashlib.sha256(data).hexdigest()

    bounded(scenario())


def test_no_credential_is_sent_to_a_relay():
    """What was seen: a worker sent `Authorization: Bearer <token>` to whatever relay address a peer
    advertised. Now a relay gets no credential of any kind."""

    async def scenario():
        relay = HostileRelay()  # answers 404 not_held and records what it was sent
        state, mallory, peer, data = await honest_peer_behind(relay)
        assert relay.requests, "the peer asked the relay"
        assert relay.authorizations() == [], relay.authorizations()
        assert peer.installed.get(0) == hashlib.sha256(data).hexdigest()

    bounded(scenario())


def test_a_dripping_relay_is_reported_and_excised():
    """What was seen: a relay dripping 64 KiB every 0.9 of the progress timeout was never reported
    (29 min for a 12.7 MB snapshot). Now a chunk arriving below broadcast.min_relay_mbps is a stall:
    the relay is reported and excised within a few progress timeouts, and the peer gets the
    version from the learner instead."""

    async def scenario():
        relay = HostileRelay(piece=64 * 1024, every=0.9 * PROGRESS_TIMEOUT)

        def arm(state):
            relay.blob = state.publisher.bcast.snapshots[0]

        start = asyncio.get_running_loop().time()
        # drip: 2 chunks of 512 KiB at 64 KiB / 0.9 s would take 14.4 s; the peer is done long before
        state, mallory, peer, data = await honest_peer_behind(relay, arm=arm, wait_s=8.0)
        took = asyncio.get_running_loop().time() - start
        assert (0, mallory, "stalled") in peer.client.failures
        assert peer.installed.get(0) == hashlib.sha256(data).hexdigest()
        assert took < 8.0 and relay.bytes_sent < len(data) / 2
        assert (
            mallory in state.publisher.bcast.leaf_only[0]
            and state.publisher.bcast.stats[mallory].failures >= 1
        )

    bounded(scenario())


def test_keep_alives_then_gone_cost_the_relay_its_score():
    """Issue 41 item 7. What was seen: a relay that sent keep-alives for 2.5 progress timeouts and
    then a "gone" frame held its child on every version and kept its score, "gone" being no fault.
    Now keep-alives for more than a progress timeout followed by "gone" are a stall: reported
    `stalled`, a failure on the relay's record, excised for the version; the peer gets it elsewhere."""

    async def scenario():
        relay = HostileRelay(stall_then_gone=2.5 * PROGRESS_TIMEOUT)
        state, mallory, peer, data = await honest_peer_behind(relay, wait_s=15.0)
        assert relay.requests, "the peer asked the relay"
        assert (0, mallory, "stalled") in peer.client.failures, peer.client.failures
        assert state.publisher.bcast.stats[mallory].failures >= 1
        assert mallory in state.publisher.bcast.leaf_only[0]
        assert peer.installed.get(0) == hashlib.sha256(data).hexdigest()

    bounded(scenario())


@pytest.mark.parametrize("any_host", [False, True])
def test_an_advertised_relay_must_be_the_workers_own_address(any_host):
    """What was seen: a worker could advertise any host (e.g. an internal service) as its relay,
    and peers would stream from it with the run's token. Now the advertised host must be the
    address the registration came from, unless coordinator.any_relay_host is set."""

    async def scenario():
        import aiohttp

        server, state = start_coordinator(any_relay_host=any_host)
        try:
            body = {"name": "m", "inbound": True, "relay_port": 8080, "relay_host": "10.9.8.7"}
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{server.url}/v1/register", json=body, headers=bearer(TOKEN)) as r:
                    status, reply = r.status, await r.json()
                body["relay_host"] = "127.0.0.1"  # its own address is always fine
                async with s.post(f"{server.url}/v1/register", json=body, headers=bearer(TOKEN)) as r:
                    assert r.status == 200
        finally:
            server.stop()
        urls = sorted(w.relay_url for w in state.registry.workers.values())
        if any_host:
            assert status == 200 and urls == ["http://10.9.8.7:8080", "http://127.0.0.1:8080"]
        else:
            assert (status, reply["error"]) == (403, "forbidden") and "relay_host" in reply["detail"]
            assert urls == ["http://127.0.0.1:8080"], "the refused registration left nothing"

    bounded(scenario())
