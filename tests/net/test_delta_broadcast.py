"""Delta snapshots over real loopback HTTP (issue 24): a coordinator (port 0) publishing, beside each
snapshot, a delta from the previous one, and broadcast-only workers (`BroadcastPeer`, relays on
port 0) in one process, no torch.

A worker that runs the delta's base installs from the delta, bit for bit the full snapshot, and a
relay forwards the delta down its chain; a wrong base, a missing one (a worker joining mid-run) and
a stale one (a worker that missed a version) fall back to the full snapshot; a tampered delta chunk
is refused and fetched again. Each test is bounded by `asyncio.wait_for`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct

import numpy as np
from support import Fleet, make_state

from echo2.broadcast.chunks import SnapshotBytes
from echo2.broadcast.relay import ChunkStore
from echo2.broadcast.tracker import BroadcastPolicy
from echo2.coordinator.server import Coordinator
from echo2.rollout.broadcast_client import BroadcastClient, Receiving
from echo2.rollout.broadcast_peer import BroadcastPeer
from echo2.wire.client import CoordinatorClient
from echo2.wire.protocol import RegisterRequest

TOKEN = "delta-token"
CHUNK = 4 * 1024
WORKER_BPS = 1e6
ELEMENTS = 2**19  # two bf16 tensors of 2**18 elements: a 1 MiB snapshot


def start_coordinator(*, chains: int = 2):
    state = make_state(
        heartbeat_timeout=30.0,
        broadcast=BroadcastPolicy(
            mode="chain",
            chunk_size=CHUNK,
            uplink_budget_bps=chains * WORKER_BPS,
            worker_bps=WORKER_BPS,
            delta=True,
        ),
    )
    server = Coordinator(
        state, token=TOKEN, run_info={"broadcast": {"progress_timeout_s": 1.0}}, heartbeat_interval=0.2
    )
    server.start()
    return server, state


def snapshot(version: int) -> bytes:
    """Safetensors bytes of two bf16 tensors; each version changes 2% of the elements by one ulp
    at places of its own (what an RL step at a small learning rate does in bf16)."""
    rng = np.random.default_rng(0)
    weights = rng.integers(0x3C00, 0x3F80, ELEMENTS, dtype=np.uint16)
    for v in range(1, version + 1):
        changed = np.random.default_rng(v).choice(ELEMENTS, ELEMENTS // 50, replace=False)
        weights[changed] += 1
    half = ELEMENTS // 2
    header = {
        name: {"dtype": "BF16", "shape": [half], "data_offsets": [i * 2 * half, (i + 1) * 2 * half]}
        for i, name in enumerate(["a.weight", "b.weight"])
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + weights.astype("<u2").tobytes()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def publish(state, version: int) -> str:
    data = snapshot(version)
    state.publisher.publish(version, data, keep=2)
    return sha(data)


def bounded(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def held(peer: BroadcastPeer) -> tuple[int, bytes]:
    version, data = peer.client.base
    return version, bytes(data)


def test_workers_install_from_the_delta_bit_for_bit_and_relays_forward_it():
    server, state = start_coordinator(chains=2)

    async def scenario():
        async with Fleet(server.url, 4, token=TOKEN) as fleet:
            publish(state, 0)
            await fleet.installed(0)
            sent_before = {p.worker_id: p.member.relay.bytes_sent for p in fleet.peers}
            served_before = state.publisher.bcast.bytes_served
            digest = publish(state, 1)
            delta = state.publisher.deltas[1]
            assert delta.manifest.form == "delta" and delta.manifest.base_version == 0
            assert delta.manifest.sha256 == digest and len(delta.data) < len(snapshot(1)) / 4
            assert delta.manifest.num_chunks > 1
            await fleet.installed(1)
            for p in fleet.peers:
                assert p.installed[1] == digest and p.client.forms[1] == "delta"
                assert held(p) == (1, snapshot(1)), "bit for bit the full snapshot"
            # the chains carried the delta: every non-seed got it from a peer's relay
            plan = state.publisher.bcast.plans[1]
            children = [w for chain in plan.chains for w in chain[1:]]
            assert children, "a chain of more than one worker"
            for child in children:
                parent = fleet.by_id(plan.parent_of(child))
                relayed = parent.member.relay.bytes_sent - sent_before[parent.worker_id]
                assert len(delta.data) <= relayed < len(snapshot(1)), "the relay forwarded the delta"
                assert fleet.by_id(child).member.deltas.complete(1)
            # the learner sent each seed the delta, and no full snapshot
            served = state.publisher.bcast.bytes_served - served_before
            assert served == len(plan.chains) * len(delta.data)
            status = state.publisher.status()["delta"]
            assert status["published"] == 1 and 0 < status["ratio"] < 0.25

    try:
        bounded(scenario())
    finally:
        server.stop()


def test_a_wrong_base_falls_back_to_the_full_snapshot():
    """A worker that claims the delta's base but holds other bytes: BaseMismatch, then the full
    snapshot from the learner; it ends on the published bytes. Its chain neighbours are unharmed."""
    server, state = start_coordinator(chains=1)

    async def scenario():
        async with Fleet(server.url, 3, token=TOKEN) as fleet:
            publish(state, 0)
            await fleet.installed(0)
            liar = fleet.peers[1]
            liar.client.base = (0, SnapshotBytes.of(snapshot(5)))  # the right number, other bytes
            digest = publish(state, 1)
            await fleet.installed(1)
            assert {p.installed[1] for p in fleet.peers} == {digest}
            assert liar.client.forms[1] == "full" and liar.client.delta_fallbacks
            assert "needs base" in liar.client.delta_fallbacks[0][1]
            assert held(liar) == (1, snapshot(1))
            assert state.publisher.forms[1][liar.worker_id] == "full"
            assert liar.worker_id not in state.publisher.bcast.plans[1].workers(), "out of the delta's chains"
            others = [p for p in fleet.peers if p is not liar]
            assert all(p.client.forms[1] == "delta" for p in others)

    try:
        bounded(scenario())
    finally:
        server.stop()


def flip_delta_bytes(relay) -> None:
    """Fault injection: `relay` corrupts every delta chunk it forwards (full ones pass)."""
    honest = relay.chunk

    async def lying(version, index, wait, store=None):
        data = await (honest(version, index, wait) if store is None else honest(version, index, wait, store))
        if data is None or store is None:
            return data
        return bytes([data[0] ^ 0xFF]) + data[1:]

    relay.chunk = lying


def test_a_tampered_delta_chunk_is_refused_and_fetched_again():
    server, state = start_coordinator(chains=1)

    async def scenario():
        async with Fleet(server.url, 3, token=TOKEN) as fleet:
            publish(state, 0)
            await fleet.installed(0)
            seed = fleet.by_id(state.publisher.bcast.plans[0].chains[0][0])
            flip_delta_bytes(seed.member.relay)
            digest = publish(state, 1)
            await fleet.installed(1)
            assert {p.installed[1] for p in fleet.peers} == {digest}
            assert all(held(p) == (1, snapshot(1)) for p in fleet.peers)
            child_id = state.publisher.bcast.plans[0].child_of(seed.worker_id)
            reports = [f for p in fleet.peers for f in p.client.failures if f[0] == 1]
            assert (1, seed.worker_id, "bad_chunk") in reports, reports
            assert child_id is not None

    try:
        bounded(scenario())
        assert state.publisher.bcast.failures["bad_chunk"] >= 1
    finally:
        server.stop()


def test_a_worker_joining_mid_run_gets_the_full_snapshot_then_deltas():
    server, state = start_coordinator(chains=2)

    async def scenario():
        async with Fleet(server.url, 2, token=TOKEN) as fleet:
            publish(state, 0)
            await fleet.installed(0)
            publish(state, 1)
            await fleet.installed(1)
            async with Fleet(server.url, 1, token=TOKEN, first=2) as late:
                newcomer = late.peers[0]
                await late.installed(1)
                assert newcomer.client.forms[1] == "full" and not newcomer.client.delta_fallbacks
                digest = publish(state, 2)
                await late.installed(2)
                await fleet.installed(2)
                assert newcomer.client.forms[2] == "delta" and newcomer.installed[2] == digest
                assert held(newcomer) == (2, snapshot(2))

    try:
        bounded(scenario())
    finally:
        server.stop()


def test_a_worker_that_missed_a_version_gets_the_full_snapshot():
    """A receiver holding version 0 when version 2 (delta from 1) is its next: the full snapshot."""
    server, state = start_coordinator(chains=1)

    async def scenario():
        async with await CoordinatorClient.create(server.url, TOKEN) as c:
            reg = await c.register(RegisterRequest(name="behind", inbound=False))
            client = BroadcastClient(
                c,
                ChunkStore(),
                Receiving(progress_timeout=1.0),
                worker_id=reg.worker_id,
                public_key=reg.public_key,
            )
            publish(state, 0)
            data = await client.fetch(0)
            client.hold(0, data)
            await client.report_installed(0, data)
            publish(state, 1)
            digest = publish(state, 2)
            assert state.publisher.deltas[2].manifest.base_version == 1
            data = await client.fetch(2)
            assert client.forms[2] == "full" and not client.delta_fallbacks
            assert bytes(data) == snapshot(2) and client.digests[2] == digest
            client.hold(2, data)
            digest = publish(state, 3)
            data = await client.fetch(3)
            assert client.forms[3] == "delta" and bytes(data) == snapshot(3) and client.digests[3] == digest

    try:
        bounded(scenario())
    finally:
        server.stop()
