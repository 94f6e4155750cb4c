"""Identity: the run token only admits new workers; every call made as a worker needs that worker's
own credential (issued once, at registration), and transfer reports count for a relay's score only
when the coordinator's route, the receiver's and the sender's accounts agree.

Each attack is made the strongest way the coordinator allows: as another worker with the
attacker's own credential (or the run token, where the coordinator issues no credential), and as
itself."""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request

import pytest
from support import FakeClock, make_state

from echo2.broadcast.tracker import BroadcastPolicy
from echo2.coordinator.server import Coordinator

TOKEN = "identity-token"


@pytest.fixture
def coord():
    clock = FakeClock()
    state = make_state(
        clock,
        broadcast=BroadcastPolicy(mode="chain", chunk_size=16, uplink_budget_bps=1e6, worker_bps=1e6),
    )
    server = Coordinator(state, token=TOKEN, run_info={}, heartbeat_interval=1.0)
    server.start()
    yield server, state, clock
    server.stop()


def call(server, path, body, secret):
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Authorization", f"Bearer {secret}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            payload = resp.read()
            return resp.status, (json.loads(payload) if payload else None)
    except urllib.error.HTTPError as e:
        payload = e.read()
        try:
            return e.code, json.loads(payload or b"null")
        except ValueError:  # not every server answers errors in JSON
            return e.code, payload.decode(errors="replace")


def register(server, name, **extra) -> tuple[str, str]:
    """(worker id, what its calls carry: its credential, or the run token if none is issued)."""
    status, reply = call(server, "/v1/register", {"name": name, **extra}, TOKEN)
    assert status == 200
    return reply["worker_id"], reply.get("credential", TOKEN)


def worker_view(state, wid):
    w = state.registry.workers[wid]
    return (
        w.version,
        w.throughput,
        w.status,
        w.last_seen,
        dict(state.intake.ingestion.leases),
        list(state.intake.ingestion.reissue),
    )


def test_a_worker_cannot_act_as_another(coord):
    """What was seen: any worker_id shown in /status could heartbeat, lease or return leases for
    that worker. Now each such call, made with another worker's credential, the run token, or a
    guessed secret, is refused (401/403) and changes nothing."""
    server, state, clock = coord
    victim, victim_secret = register(server, "victim")
    attacker, attacker_secret = register(server, "mallory")
    state.publisher.publish(0, b"v0", keep=2)
    status, lease = call(
        server, "/v1/lease", {"worker_id": victim, "version": 0, "max_groups": 1}, victim_secret
    )
    assert status == 200
    clock.now += 1.0
    before = worker_view(state, victim)
    attempts = [
        ("/v1/heartbeat", {"worker_id": victim, "version": 0, "throughput": 999.0}),
        ("/v1/lease", {"worker_id": victim, "version": 0, "max_groups": 4}),
        ("/v1/lease/return", {"worker_id": victim, "lease_id": lease["lease_id"]}),
        ("/v1/broadcast/route", {"worker_id": victim, "version": 0}),
        (
            "/v1/broadcast/installed",
            {"worker_id": victim, "version": 0, "sha256": hashlib.sha256(b"v0").hexdigest()},
        ),
        (
            "/v1/broadcast/failure",
            {"worker_id": victim, "version": 0, "parent_id": None, "reason": "stalled"},
        ),
    ]
    for secret in {attacker_secret, TOKEN, f"{victim}.guessed-secret"}:
        for path, body in attempts:
            status, got = call(server, path, body, secret)
            assert status in (401, 403), (path, secret[:8], status, got)
            assert got["error"] in ("unauthorized", "forbidden") and got["detail"]
    assert worker_view(state, victim) == before, "nothing changed for the victim"
    assert 0 not in state.publisher.bcast.plans or victim not in state.publisher.bcast.receiving.get(0, set())
    # the victim itself still can
    assert call(server, "/v1/heartbeat", {"worker_id": victim, "version": 0}, victim_secret)[0] == 200


def test_forged_install_reports_do_not_make_the_attacker_a_parent(coord):
    """What was seen: forged install reports crediting itself made an attacker the victim's relay
    parent for 11 of 11 versions despite 9 failure reports against it. Now a report counts only for
    a transfer the coordinator routed and the sender also accounted for, once: the attacker's
    reports (as the victim, or as itself crediting itself) move nothing, and the victim's failure
    reports push it off the head of the chain."""
    server, state, clock = coord
    attacker, attacker_secret = register(server, "mallory", inbound=True, relay_port=9)
    victim, victim_secret = register(server, "victim", inbound=True, relay_port=10)
    parent_of_victim = []
    for v in range(11):
        data = f"snapshot {v}".encode() * 8
        state.publisher.publish(v, data, keep=2)
        digest = hashlib.sha256(data).hexdigest()
        forged = [{"parent_id": attacker, "bytes": 10**9, "seconds": 1e-3}] * 256
        for reporter, secret in ((victim, attacker_secret), (attacker, attacker_secret)):
            body = {"worker_id": reporter, "version": v, "sha256": digest, "transfers": forged}
            call(server, "/v1/broadcast/installed", body, secret)
        body = {"worker_id": attacker, "version": v, "child_id": victim, "bytes": len(data), "seconds": 1e-3}
        call(server, "/v1/broadcast/sent", body, attacker_secret)  # the sender's side, forged too
        clock.now += 1.0
        status, route = call(
            server, "/v1/broadcast/route", {"worker_id": victim, "version": v}, victim_secret
        )
        assert status == 200
        parent_of_victim.append(route["parent_id"])
        if route["parent_id"] == attacker:  # the attacker sends nothing: the victim reports it
            failure = {"worker_id": victim, "version": v, "parent_id": attacker, "reason": "unreachable"}
            call(server, "/v1/broadcast/failure", failure, victim_secret)
        clock.now += 1.0
    assert parent_of_victim.count(attacker) <= 1, parent_of_victim
    stats = state.publisher.bcast.stats.get(attacker)
    assert stats is None or stats.successes == 0, "no forged transfer was credited"


def test_a_transfer_counts_once_when_both_sides_agree(coord):
    """The honest path: the coordinator routes B to A, B reports what it received from A and A what
    it sent B; A's score rises once (once A's own receipt from the learner is credited), at a rate
    no faster than the coordinator saw."""
    server, state, clock = coord
    a, a_secret = register(server, "a", inbound=True, relay_port=9)
    b, b_secret = register(server, "b", inbound=True, relay_port=10)
    data = b"x" * 4096
    state.publisher.publish(0, data, keep=2)
    head, tail = state.publisher.bcast.plans[0].chains[0]
    secrets = {a: a_secret, b: b_secret}
    assert call(server, "/v1/broadcast/route", {"worker_id": head, "version": 0}, secrets[head])[0] == 200
    status, route = call(server, "/v1/broadcast/route", {"worker_id": tail, "version": 0}, secrets[tail])
    assert route["parent_id"] == head
    clock.now += 2.0  # the transfer took 2 s as the coordinator saw it, whatever is claimed
    digest = hashlib.sha256(data).hexdigest()
    received = {
        "worker_id": tail,
        "version": 0,
        "sha256": digest,
        "transfers": [{"parent_id": head, "bytes": 4096, "seconds": 1e-3}],
    }
    assert call(server, "/v1/broadcast/installed", received, secrets[tail])[0] == 200
    assert head not in state.publisher.bcast.stats, "the receiver's word alone counts for nothing"
    sent = {"worker_id": head, "version": 0, "child_id": tail, "bytes": 4096, "seconds": 1e-3}
    for _ in range(3):
        assert call(server, "/v1/broadcast/sent", sent, secrets[head])[0] == 200
    assert head not in state.publisher.bcast.stats, "held until the relay's own receipt is credited"
    state.publisher.report_sent(
        None, 0, head, 4096, 1e-3
    )  # the learner's stream, as the HTTP layer reports it
    own = {**received, "worker_id": head, "transfers": [{"parent_id": None, "bytes": 4096, "seconds": 1e-3}]}
    assert call(server, "/v1/broadcast/installed", own, secrets[head])[0] == 200
    stats = state.publisher.bcast.stats[head]
    assert stats.successes == 1 and list(stats.rates) == [4096 / 2.0]


def test_honest_relays_are_credited_through_both_accounts():
    """Real peers on loopback: a relay's own account (`/v1/broadcast/sent`, sent by its relay
    server after each stream) and its child's install report meet, and the relay's score rises;
    the learner's streams are accounted by the coordinator itself (Bw_hat moves off its default)."""
    import asyncio
    import random

    from echo2.rollout.broadcast_peer import BroadcastPeer
    from echo2.rollout.worker_config import PeerConfig

    state = make_state(
        broadcast=BroadcastPolicy(mode="chain", chunk_size=64 * 1024, uplink_budget_bps=1e6, worker_bps=1e6)
    )
    server = Coordinator(
        state, token=TOKEN, run_info={"broadcast": {"progress_timeout_s": 2.0}}, heartbeat_interval=0.2
    )
    server.start()

    async def scenario():
        stop = asyncio.Event()
        config = {"url": server.url, "token": TOKEN, "inbound": True, "relay_host": "127.0.0.1"}
        peers = [BroadcastPeer(PeerConfig(**config, name=f"p{i}")) for i in range(3)]
        tasks = [asyncio.create_task(p.run(stop)) for p in peers]
        try:
            while not all(p.client is not None for p in peers):
                await asyncio.sleep(0.02)
            state.publisher.publish(0, random.Random(0).randbytes(256 * 1024), keep=2)
            (chain,) = state.publisher.bcast.plans[0].chains
            assert len(chain) == 3
            deadline = asyncio.get_running_loop().time() + 30
            while state.publisher.bcast.ledger.outcomes["credited"] < 3:  # learner -> head -> middle -> tail
                assert asyncio.get_running_loop().time() < deadline, dict(
                    state.publisher.bcast.ledger.outcomes
                )
                await asyncio.sleep(0.05)
            head, middle, _ = chain
            for relay in (head, middle):
                assert state.publisher.bcast.stats[relay].successes == 1
            assert state.publisher.bcast.bw_hat() != 1e6
            assert state.publisher.bcast.ledger.outcomes["disputed"] == 0
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        server.stop()
