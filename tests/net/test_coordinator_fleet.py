"""The coordinator's scheduler over real loopback HTTP: the scheduler in the coordinator's state, and
with a provider that starts and stops workers."""

from __future__ import annotations

import pytest
from support import FakeClock, FakeProvider, make_state

from echo2.wire.errors import Released


def test_scheduler_in_the_coordinator_state():
    """Standby workers get no leases; the cheapest per unit throughput are activated after the
    sustained interval; a lost worker is replaced within one heartbeat timeout; decisions are kept
    with their reasons."""
    from echo2.fleet.scheduler import Scheduler

    clock = FakeClock()
    state = make_state(clock, scheduler=Scheduler(sustain_s=20.0), target=lambda: 2.0)
    state.publisher.publish(0, b"v0", keep=2)
    ids = {
        name: state.register(
            name=name, hardware="x", price_per_hour=price, inbound=False, throughput=1.0
        ).worker_id
        for name, price in [("a", 0.3), ("b", 0.9), ("c", 0.4), ("d", 0.5)]
    }
    assert state.intake.lease(ids["a"], version=0, max_groups=1) is None, "standby: no lease"
    state.expire()
    clock.now += 20.0
    for wid in ids.values():
        state.heartbeat(wid, version=0, throughput=1.0)
    state.expire()
    assert [d["worker"] for d in state.fleet.decisions] == ["a", "c"]  # rho 0.3, 0.4 reach 2.0/s
    assert state.intake.lease(ids["a"], version=0, max_groups=1) is not None
    # "c" dies: within one heartbeat timeout it is lost and "d" (next cheapest) replaces it at once
    for _ in range(6):
        clock.now += 2.0
        for name in ("a", "b", "d"):
            state.heartbeat(ids[name], version=0, throughput=1.0)
        state.expire()
    assert (
        state.fleet.decisions[-1]["worker"] == "d" and "replacing lost" in state.fleet.decisions[-1]["reason"]
    )
    assert len(state.fleet.decisions) == 3


def test_scheduler_with_a_provider_starts_and_stops_workers():
    """With a provider, standby workers are offers, not processes: activation starts one (counted
    while it starts, so no double start), release stops it (released, not lost, not replaced), and a
    silent worker is stopped as failed and replaced at once."""
    from echo2.coordinator.registry import WorkerStatus
    from echo2.fleet.scheduler import Scheduler

    clock = FakeClock()
    target = {"mu": 2.0}
    provider = FakeProvider([("a", 1.0, 0.3), ("b", 1.0, 0.9), ("c", 1.0, 0.4), ("d", 1.0, 0.5)])
    state = make_state(
        clock, scheduler=Scheduler(sustain_s=20.0), target=lambda: target["mu"], provider=provider
    )
    state.publisher.publish(0, b"v0", keep=2)
    state.expire()
    clock.now += 20.0
    state.expire()
    assert provider.calls == [("start", "a"), ("start", "c")]  # rho 0.3, 0.4 reach 2.0/s
    clock.now += 40.0
    state.expire()
    assert len(provider.calls) == 2, "started-but-unregistered workers count toward capacity"
    ids = {
        n: state.register(
            name=n, hardware="x", price_per_hour=p, inbound=False, throughput=1.0, slot_proof=provider.secrets[n]
        ).worker_id
        for n, p in [("a", 0.3), ("c", 0.4)]
    }
    assert state.intake.lease(ids["a"], version=0, max_groups=1) is not None, "a started worker is active"

    target["mu"] = 0.8  # capacity 2.0 is far above: after the sustained interval, "c" (dearer) goes
    for _ in range(11):
        clock.now += 2.0
        for wid in ids.values():
            state.heartbeat(wid, version=0, throughput=1.0)
        state.expire()
    assert provider.calls[-1] == ("stop", "c")
    assert state.registry.workers[ids["c"]].status is WorkerStatus.RELEASED
    assert state.fleet.decisions[-1]["action"] == "release" and state.fleet.decisions[-1]["worker"] == "c"
    with pytest.raises(Released):  # told to stop, not to register again (410 on the wire)
        state.intake.lease(ids["c"], version=0, max_groups=1)
    n_decisions = len(state.fleet.decisions)
    for _ in range(10):  # "c" says nothing any more: released, never lost, never replaced
        clock.now += 2.0
        state.heartbeat(ids["a"], version=0, throughput=1.0)
        state.expire()
    assert (
        state.registry.workers[ids["c"]].status is WorkerStatus.RELEASED
        and len(state.fleet.decisions) == n_decisions
    )

    target["mu"] = 1.0  # "a" goes silent: lost within one heartbeat timeout, stopped as failed, replaced
    clock.now += 11.0
    state.expire()
    assert state.registry.workers[ids["a"]].status is WorkerStatus.LOST
    assert ("stop-failed", "a") in provider.calls
    assert provider.calls[-1] == ("start", "c") and "replacing lost" in state.fleet.decisions[-1]["reason"]
