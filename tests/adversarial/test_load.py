"""Load a hostile (or merely large) fleet puts on the coordinator: registrations that are never
purged, leases hoarded by one worker, heartbeats whose cost grows with the versions kept."""

from __future__ import annotations

import json

from hostile import Door, HostileWorker


def test_lost_registrations_are_purged(door: Door):
    state, clock = door.state, door.clock
    for i in range(20_000):
        state.register(name=f"sybil-{i}", hardware="x", price_per_hour=0.0, inbound=False)
    clock.now += state.registry.heartbeat_timeout + 1
    state.expire()  # all lost
    assert len(state.registry.workers) == 20_000
    clock.now += state.purge_after
    state.expire()  # lost for longer than purge_after: forgotten
    assert len(state.registry.workers) == 0
    status, body = HostileWorker(door.url, "").call("GET", "/status")
    assert status == 200 and len(json.dumps(body)) < 20_000
    door.learner_trains()


def test_one_worker_cannot_hoard_leases(door: Door, mallory: HostileWorker):
    granted, refused = [], []
    for _ in range(200):
        status, body = mallory.lease(max_groups=1024)
        (granted if status == 200 else refused).append((status, body))
        if len(refused) == 1:
            before = door.snapshot()
    assert len(granted) == door.state.intake.max_leases_per_worker
    assert all(len(b["indices"]) <= door.state.intake.max_groups_per_lease for _, b in granted)
    assert {(s, b["error"]) for s, b in refused} == {(429, "lease_limit")}
    door.invariant(before, None)


def test_a_repeated_heartbeat_costs_the_same_whatever_the_versions_kept(door: Door, monkeypatch):
    """1,000 workers, 64 kept versions: once each worker's version is noted, its heartbeats neither
    recount T_bcast nor rebuild the live set."""
    state = door.state
    for v in range(1, 64):
        state.publisher.publish(v, b"w%d" % v, keep=64)
    ids = [
        state.register(name=f"w{i}", hardware="x", price_per_hour=0.0, inbound=False).worker_id
        for i in range(1000)
    ]
    for wid in ids:
        state.heartbeat(wid, version=63, throughput=1.0)
    assert len(state.publisher.bcast.snapshots) == 64 and state.publisher.t_bcast_all[63] == 0.0
    calls = {"t_bcast": 0, "peers": 0}
    update, peers = state.publisher.bcast.installs.update, state.registry.peers

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)

        return wrapper

    monkeypatch.setattr(state.publisher.bcast.installs, "update", counted("t_bcast", update))
    monkeypatch.setattr(state.registry, "peers", counted("peers", peers))
    with state.shared.lock:  # the coordinator's expiry round (which recounts) waits meanwhile
        for wid in ids:
            state.heartbeat(wid, version=63, throughput=1.0)
    assert calls == {"t_bcast": 0, "peers": 0}
    door.learner_trains()
