"""Snapshot broadcast over real loopback HTTP: a coordinator (port 0) and six broadcast-only workers
(`BroadcastPeer`, each with its own relay server on port 0) in one process, no torch.

Every worker installs every snapshot (chains and star); a relay killed mid-broadcast, a relay that
stops making progress and a relay that flips a byte are all routed around, and every survivor
still installs exactly the published bytes; a manifest with a bad signature is refused; the
learner reports T_bcast. Each test is bounded by `asyncio.wait_for`.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from broadcast_net import (
    TOKEN,
    bounded,
    get_status,
    give_score,
    publish,
    snapshot_bytes,
    start_coordinator,
)
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from support import Fleet

from echo2.broadcast.relay import RelayServer


# ---------------------------------------------------------------------------- the happy path
@pytest.mark.parametrize("mode", ["chain", "star"])
def test_every_worker_installs_every_snapshot(mode):
    """Three versions to six workers. Chain: two chains of three, so the learner sends each version
    twice and the other four copies are relayed by peers. Star: the learner sends all six. T_bcast
    at q = 0.9 and q = 1 is reported for every version, in /status too."""
    server, state = start_coordinator(mode=mode, chains=2)

    async def scenario():
        async with Fleet(server.url, 6, token=TOKEN) as fleet:
            for v in range(3):
                digest = publish(state, v)
                await fleet.installed(v)
                assert all(p.installed[v] == digest for p in fleet.peers)
                while v not in state.publisher.t_bcast_all:  # the last install report is on its way
                    await asyncio.sleep(0.01)
            return fleet

    try:
        fleet = bounded(scenario())
        plan0 = state.publisher.bcast.plans.get(0)
        st = state.publisher.bcast
        size = len(snapshot_bytes(0))
        if mode == "chain":
            relayed = [p for p in fleet.peers if any(t is not None for t in _parents(st, p.worker_id))]
            assert relayed, "some workers received from a peer"
            assert st.bytes_served < 6 * 3 * size, "peers carried part of the load"
        else:
            assert st.bytes_served == 6 * 3 * size, "star: the learner sends every copy"
            assert plan0 is None or all(len(c) == 1 for c in plan0.chains)
        for v in range(3):
            assert v in state.publisher.t_bcast and v in state.publisher.t_bcast_all
            assert 0 <= state.publisher.t_bcast[v] <= state.publisher.t_bcast_all[v] < 60
        status = get_status(server)["broadcast"]
        assert status["mode"] == mode
        assert status["t_bcast_by_version"]["2"]["q1"] == pytest.approx(state.publisher.t_bcast_all[2])
        assert status["installed_by_version"]["2"] == 6
        assert st.failures == {}, "nothing failed on the happy path"
    finally:
        server.stop()


def _parents(st, worker_id):
    """Parents a worker was routed to, across the kept plans."""
    out = []
    for plan in st.plans.values():
        try:
            out.append(plan.parent_of(worker_id))
        except KeyError:
            pass
    return out


def test_chain_plan_has_n_ch_chains_fed_by_the_learner_once_each():
    """B0 = 2 Bw: two chains of three; the learner streams each version to the two seeds only."""
    server, state = start_coordinator(mode="chain", chains=2)

    async def scenario():
        async with Fleet(server.url, 6, token=TOKEN) as fleet:
            digest = publish(state, 0)
            plan = state.publisher.bcast.plans[0]
            assert sorted(len(c) for c in plan.chains) == [3, 3]
            await fleet.installed(0)
            assert {p.installed[0] for p in fleet.peers} == {digest}

    try:
        bounded(scenario())
        assert state.publisher.bcast.bytes_served == 2 * len(snapshot_bytes(0))
    finally:
        server.stop()


# ---------------------------------------------------------------------------- failures
def test_relay_killed_mid_broadcast():
    """One chain of six, downloads capped at 16 Mbit/s so the broadcast takes seconds. The second
    worker of the chain is killed once it holds a few chunks: its child reports it, is reattached
    to the killed worker's parent and resumes from its first missing chunk; every survivor
    installs the snapshot, and T_bcast at q = 1 counts the survivors once the dead one is lost."""
    server, state = start_coordinator(mode="chain", chains=1, download_mbps=16, heartbeat_timeout=1.0)

    async def scenario():
        async with Fleet(server.url, 6, token=TOKEN) as fleet:
            digest = publish(state, 0)
            chain = state.publisher.bcast.plans[0].chains[0]
            victim, child = fleet.by_id(chain[1]), fleet.by_id(chain[2])
            while len(victim.member.store.chunks.get(0, {})) < 4:
                await asyncio.sleep(0.01)
            assert not victim.member.store.complete(0), "killed mid-broadcast"
            await fleet.kill(victim)
            survivors = [p for p in fleet.peers if p is not victim]
            await fleet.installed(0, survivors)
            assert {p.installed[0] for p in survivors} == {digest}
            assert (0, victim.worker_id, "unreachable") in child.client.failures
            assert child.client.transfers == {}, "transfers went out with the install report"
            while 0 not in state.publisher.t_bcast_all:  # until the dead worker is marked lost
                await asyncio.sleep(0.05)
            return victim, chain

    try:
        victim, chain = bounded(scenario())
        plan = state.publisher.bcast.plans[0]
        assert victim.worker_id not in plan.workers()
        assert plan.parent_of(chain[2]) == chain[0], "reattached to the nearest healthy upstream peer"
        assert state.publisher.bcast.stats[victim.worker_id].failures >= 1, "its score fell"
    finally:
        server.stop()


class StallingRelay(RelayServer):
    """Sends two chunks of each stream, then nothing at all (a hung process)."""

    sent = 0

    async def chunk(self, version, index, wait):
        self.sent += 1
        if self.sent > 2:
            await asyncio.sleep(3600)
        return await super().chunk(version, index, wait)


def test_relay_that_stops_making_progress_is_excised():
    server, state = start_coordinator(mode="chain", chains=1)

    async def scenario():
        fleet = Fleet(server.url, 6, token=TOKEN)
        staller = fleet.peers[0]
        staller.member.relay = StallingRelay(staller.member.store)
        async with fleet:
            give_score(state, staller.worker_id)  # the seed: it has a child
            digest = publish(state, 0)
            child_id = state.publisher.bcast.plans[0].child_of(staller.worker_id)
            await fleet.installed(0)
            assert {p.installed[0] for p in fleet.peers} == {digest}
            assert (0, staller.worker_id, "stalled") in fleet.by_id(child_id).client.failures

    try:
        bounded(scenario())
        assert state.publisher.bcast.failures["stalled"] >= 1
    finally:
        server.stop()


def test_slow_relay_is_reported_demoted_and_only_a_tail_in_the_next_plan():
    """A seed whose relay upload is throttled to 100 kB/s (far below the peers' measured loopback
    rate): its child judges a progress timeout of reading below the route's floor, reports it
    `slow`, and moves behind the other chain's tail; every worker installs the published bytes, and
    in the next plan the slow worker has no child."""
    from echo2.broadcast.bucket import TokenBucket

    server, state = start_coordinator(mode="chain", chains=2)

    async def scenario():
        async with Fleet(server.url, 6, token=TOKEN) as fleet:
            slow = fleet.peers[0]
            publish(state, 0)
            await fleet.installed(0)
            while len(state.publisher.bcast.credits.rates) < 6:  # both sides' accounts of all six streams
                await asyncio.sleep(0.02)
            with state.shared.lock:  # B0 = 2.5 x the measured Bw_hat: two chains again
                policy = state.publisher.bcast.policy
                state.publisher.bcast.policy = dataclasses.replace(
                    policy, uplink_budget_bps=2.5 * state.publisher.bcast.bw_hat()
                )
            slow.member.relay.upload_bucket = TokenBucket(1e5)
            give_score(state, slow.worker_id)  # the first seed, with a child
            digest = publish(state, 1)
            child_id = state.publisher.bcast.plans[1].child_of(slow.worker_id)
            assert child_id is not None
            await fleet.installed(1)
            assert {p.installed[1] for p in fleet.peers} == {digest}
            assert (1, slow.worker_id, "slow") in fleet.by_id(child_id).client.failures
            plan = state.publisher.bcast.plans[1]
            assert slow.worker_id not in plan.workers(), "it left the chain in flight"
            assert plan.parent_of(child_id) is not None, "moved behind a peer, not onto the learner"
            assert state.publisher.bcast.stats[slow.worker_id].demoted
            publish(state, 2)
            assert state.publisher.bcast.plans[2].child_of(slow.worker_id) is None, "only a tail"
            await fleet.installed(2)
            return slow.worker_id

    try:
        slow_id = bounded(scenario())
        assert state.publisher.bcast.failures["slow"] == 1
        assert not state.publisher.bcast.stats[slow_id].demoted, "it sat out one plan"
    finally:
        server.stop()


def flip_first_byte(relay) -> None:
    """Fault injection: from now on `relay` corrupts every chunk it forwards (the first byte flipped)."""
    honest = relay.chunk

    async def lying(version: int, index: int, wait: float) -> bytes | None:
        data = await honest(version, index, wait)
        return None if data is None else bytes([data[0] ^ 0xFF]) + data[1:]

    relay.chunk = lying


def test_relay_that_flips_a_byte_is_detected_and_the_chunk_refetched():
    """A relay whose chunks are corrupted on purpose (`flip_first_byte`). Its child drops the
    first bad chunk (never stored, never forwarded), reports the relay, and gets the chunk again
    from the relay's parent (here the learner); every worker installs exactly the published bytes."""
    server, state = start_coordinator(mode="chain", chains=1)

    async def scenario():
        fleet = Fleet(server.url, 6, token=TOKEN)
        liar = fleet.peers[0]
        flip_first_byte(liar.member.relay)
        async with fleet:
            give_score(state, liar.worker_id)
            ref = state.publisher.bcast.reference_bps()  # Speed against one reference, before and after
            before = state.publisher.bcast.stats[liar.worker_id].score(state.shared.clock(), ref)
            digest = publish(state, 0)
            child = fleet.by_id(state.publisher.bcast.plans[0].child_of(liar.worker_id))
            await fleet.installed(0)
            assert {p.installed[0] for p in fleet.peers} == {digest}, "only verified bytes installed"
            assert (0, liar.worker_id, "bad_chunk") in child.client.failures
            assert child.member.store.complete(0) and child.member.store.assemble(0) == snapshot_bytes(0)
            after = state.publisher.bcast.stats[liar.worker_id].score(state.shared.clock(), ref)
            assert after < before, "the lying relay's score fell"
            # next publication: it is not a seed any more, and it gets no child for version 0
            assert liar.worker_id in state.publisher.bcast.leaf_only[0]

    try:
        bounded(scenario())
        assert state.publisher.bcast.failures["bad_chunk"] == 1
    finally:
        server.stop()


def test_manifest_with_a_bad_signature_is_refused():
    """A manifest signed by another key (a spoofed learner) is refused by every worker: each one
    records the refusal (the signature check ran), and nothing of that version is stored, relayed or
    installed. The next properly signed version goes through."""
    server, state = start_coordinator(mode="chain", chains=2)

    async def scenario():
        async with Fleet(server.url, 6, token=TOKEN) as fleet:
            good_key = state.publisher.signing_key
            state.publisher.signing_key = Ed25519PrivateKey.generate()
            publish(state, 0)
            # every worker has decided about version 0: refused it, or (were the check gone) installed it
            while not all(0 in p.client.refused or 0 in p.installed for p in fleet.peers):
                await asyncio.sleep(0.02)
            assert all("signature" in p.client.refused.get(0, "") for p in fleet.peers)
            assert all(0 not in p.installed and 0 not in p.member.store.manifests for p in fleet.peers)
            assert all(p.client.installed_version == -1 for p in fleet.peers)
            state.publisher.signing_key = good_key
            digest = publish(state, 1)
            await fleet.installed(1)
            assert {p.installed[1] for p in fleet.peers} == {digest}
            assert all(0 not in p.installed for p in fleet.peers)

    try:
        bounded(scenario())
    finally:
        server.stop()


def test_a_peer_marked_lost_registers_again_and_keeps_installing():
    """The coordinator marks a peer lost (its clock jumps past the heartbeat timeout): the peer's
    next heartbeat is refused as unknown, it registers again by the worker's one route (same relay,
    same store) and installs the next version under its new id."""
    now = [1000.0]
    server, state = start_coordinator(mode="star", clock=lambda: now[0])

    async def scenario():
        async with Fleet(server.url, 1, token=TOKEN) as fleet:
            (peer,) = fleet.peers
            first = peer.worker_id
            now[0] += 100.0
            state.expire()
            assert state.registry.workers[first].status.value == "lost"
            while peer.worker_id == first:
                await asyncio.sleep(0.02)
            assert peer.member.reregistered == 1 and peer.client.worker_id == peer.worker_id
            digest = publish(state, 0)
            await fleet.installed(0)
            assert peer.installed[0] == digest
            deadline = asyncio.get_running_loop().time() + 10.0  # the install report follows the install
            while peer.worker_id not in state.publisher.bcast.installs.installed_at.get(0, {}):
                assert asyncio.get_running_loop().time() < deadline, "no install report"
                await asyncio.sleep(0.02)

    try:
        bounded(scenario())
    finally:
        server.stop()


def test_uplink_cap_paces_the_learner():
    """The learner's uplink bucket is shared by all its streams: star mode, four workers, 2 MiB each
    at 64 Mbit/s (8 MB/s) takes at least one second."""
    server, state = start_coordinator(mode="star", uplink_bps=8e6)

    async def scenario():
        async with Fleet(server.url, 4, token=TOKEN) as fleet:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            publish(state, 0)
            await fleet.installed(0)
            return loop.time() - t0

    try:
        took = bounded(scenario())
        assert took >= 4 * 2 * 2**20 / 8e6 * 0.9
    finally:
        server.stop()


# ---------------------------------------------------------------------------- bad requests
CREDENTIALS: dict[str, str] = {}
