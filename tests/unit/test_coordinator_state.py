"""The pure parts of the coordinator state (registry, leases and ingestion, fleet) and the façade
that composes them, driven by a fake clock and injected ids: no sockets, no sleeps. Also: the
provider is never called while the state's lock is held."""

from __future__ import annotations

import itertools
import threading

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from support import LIMITS, FakeClock, make_state

from echo2.broadcast.chunks import public_key_hex
from echo2.coordinator.activation import Call, Fleet, Slots
from echo2.coordinator.leases import Leases, Work
from echo2.coordinator.registry import Registry, WorkerStatus
from echo2.data.buffer import ReplayBuffer
from echo2.fleet.scheduler import Kind, Scheduler
from echo2.fleet.selection import WorkerOffer
from echo2.records import Trajectory
from echo2.wire.errors import InvalidBatch, LeaseExpired, Released, Stale, UnknownWorker


def ids(prefix: str = "id"):
    counter = itertools.count()
    return lambda: f"{prefix}{next(counter)}"


def add(reg: Registry, wid: str, *, name: str | None = None, now: float = 0.0, provided: bool = False, **kw):
    fields = dict(
        hardware="x", price_per_hour=1.0, inbound=False, throughput=1.0, relay_url=None, standby=False
    )
    return reg.add(wid, name=name or wid, provided=provided, now=now, **(fields | kw))


def rec(gid: str, rid: str, *, version: int = 0, response=(3, 4)) -> Trajectory:
    return Trajectory(
        group_id=gid,
        prompt_ids=(1, 2),
        response_ids=tuple(response),
        behaviour_logprobs=tuple(-0.1 for _ in response),
        loss_mask=tuple(1 for _ in response),
        reward=1.0,
        version=version,
        record_id=rid,
    )


# ---------------------------------------------------------------------- registry
def test_registry_expiry_and_refusals():
    reg = Registry(heartbeat_timeout=10.0)
    add(reg, "a", now=0.0)
    add(reg, "b", now=0.0)
    assert reg.get("a", 8.0).last_seen == 8.0
    assert [w.worker_id for w in reg.expire(10.5)] == ["b"], "silent for 10.5 s > 10 s"
    assert reg.expire(10.5) == [], "lost once"
    assert reg.is_lost("b") and not reg.is_lost("a") and reg.is_lost("nobody")
    assert set(reg.peers()) == {"a"}
    with pytest.raises(UnknownWorker):
        reg.get("b", 11.0)
    with pytest.raises(UnknownWorker):
        reg.get("nobody", 11.0)
    reg.workers["a"].status = WorkerStatus.RELEASED
    with pytest.raises(Released):
        reg.get("a", 11.0)


def test_registry_windowed_throughput():
    reg = Registry(heartbeat_timeout=10.0, window_s=30.0)
    info = add(reg, "a", throughput=5.0)
    assert reg.windowed_throughput(info, 0.0) == 5.0, "the declared rate until a heartbeat"
    reg.sample(info, 0.0, 1.0)
    assert reg.windowed_throughput(info, 1.0) == 5.0, "a zero rate is not a measurement"
    for t, mu in [(0.0, 1.0), (20.0, 2.0), (40.0, 6.0)]:
        reg.sample(info, mu, t)
    assert reg.windowed_throughput(info, 40.0) == pytest.approx(4.0), "the sample at t=0 left the window"
    assert reg.windowed_throughput(info, 100.0) == 6.0, "window empty: the last report"


# ---------------------------------------------------------------------- leases and ingestion
def leases() -> Leases:
    return Leases(
        Work(buffer=ReplayBuffer(staleness=1, group_size=2), limits=LIMITS, group_id_of=lambda i: f"g{i}"),
        lease_timeout=30.0,
    )


def test_leases_reissue_first_and_expire():
    ls = leases()
    first = ls.issue("L0", "w", max_groups=2, now=0.0)
    assert first.indices == (0, 1) and first.deadline == 30.0 and first.group_ids == {"g0", "g1"}
    first.done_groups.add("g0")
    ls.give_back("other", "L0")
    assert "L0" in ls.leases, "a lease is returned only by its holder"
    ls.give_back("w", "L0")
    assert list(ls.reissue) == [1] and ls.reissued == 1, "a complete group is not regenerated"
    second = ls.issue("L1", "v", max_groups=2, now=5.0)
    assert second.indices == (1, 2)
    ls.expire(35.0, lost=lambda w: False)
    assert "L1" in ls.leases, "deadline 35 is not passed at 35"
    ls.expire(35.5, lost=lambda w: False)
    assert ls.leases == {} and list(ls.reissue) == [1, 2]
    ls.issue("L2", "u", max_groups=1, now=40.0)
    ls.expire(41.0, lost=lambda w: w == "u")
    assert ls.leases == {} and ls.pending() == [1, 2], "put back behind 2, 1 is still handed out first"


def test_ingest_is_all_or_nothing_and_stale_batches_reissue():
    ls = leases()
    lease = ls.issue("L0", "w", max_groups=1, now=0.0)
    with pytest.raises(LeaseExpired):
        ls.ingest("x", "L0", [rec("g0", "a")], published_version=0)
    with pytest.raises(InvalidBatch) as bad:
        ls.ingest("w", "L0", [rec("g0", "a"), rec("g0", "b", response=(3, 100))], published_version=0)
    assert bad.value.reason == "out_of_vocab" and len(ls.buffer) == 0
    with pytest.raises(InvalidBatch) as future:
        ls.ingest("w", "L0", [rec("g0", "a", version=1)], published_version=0)
    assert future.value.reason == "future_version"
    assert dict(ls.rejected) == {"lease_expired": 1, "out_of_vocab": 2, "future_version": 1}
    assert ls.ingest("w", "L0", [rec("g0", "a"), rec("g0", "b")], published_version=0) == {
        "accepted": 2,
        "duplicates": 0,
    }
    assert ls.leases == {} and lease.done_groups == {"g0"}, "a lease whose groups are complete closes"
    assert ls.ingest("w", "L0", [rec("g0", "a")], published_version=0) == {"accepted": 0, "duplicates": 1}

    ls.issue("L1", "w", max_groups=1, now=0.0)
    ls.buffer.set_learner_version(2)  # floor 1
    with pytest.raises(Stale):
        ls.ingest("w", "L1", [rec("g1", "c")], published_version=2)
    assert ls.leases == {} and list(ls.reissue) == [1], "stale: its prompts are generated again"
    assert not ls.admits(0) and ls.admits(1)


def test_a_buffered_group_evicted_as_stale_has_its_prompt_generated_again():
    """A complete group that waited in the buffer until the learner moved past S goes back to the
    queue (first in line), so no prompt is lost to staleness; a checkpoint counts it as pending."""
    ls = leases()
    ls.issue("L0", "w", max_groups=2, now=0.0)
    batch = [rec("g0", "a"), rec("g0", "b"), rec("g1", "c"), rec("g1", "d")]
    assert ls.ingest("w", "L0", batch, published_version=0)["accepted"] == 4
    assert ls.pending() == [0, 1], "generated but not consumed yet"
    groups, _ = ls.buffer.take(1)
    ls.taken(groups)
    assert [g[0].group_id for g in groups] == ["g0"] and ls.pending() == [1]
    ls.requeue_evicted(ls.buffer.set_learner_version(2))  # S = 1: version 0 is now too old
    assert ls.buffer.rejected["stale"] == 2 and list(ls.reissue) == [1] and ls.reissued == 1
    assert ls.issue("L1", "w", max_groups=2, now=1.0).indices == (1, 2), "regenerated first"


# ---------------------------------------------------------------------- fleet
def test_fleet_plans_provider_calls_without_calling():
    reg = Registry(heartbeat_timeout=10.0)
    fleet = Fleet(scheduler=Scheduler(sustain_s=0.0), target=lambda: 2.0, has_provider=True)
    add(reg, "w1", name="a", provided=True, price_per_hour=0.3)
    slots = Slots(
        offers=[
            WorkerOffer(name="c", throughput=1.0, price=0.4),
            WorkerOffer(name="d", throughput=1.0, price=0.9),
        ],
        running=[],
    )
    steps = fleet.plan(reg, slots, now=0.0)
    assert [(s.name, s.call) for s in steps] == [("c", Call(name="c", start=True))]
    assert steps[0].decision.kind is Kind.SLOT and steps[0].decision.worker_id == "c" and not fleet.decisions
    fleet.record(steps[0], 0.0)
    assert [d["worker"] for d in fleet.decisions] == ["c"]
    lost = reg.expire(100.0)
    assert fleet.stop_lost(lost) == [Call(name="a", start=False, failed=True)]
    assert Fleet(scheduler=None, target=lambda: 2.0, has_provider=True).plan(reg, slots, now=0.0) == []
    assert (
        Fleet(scheduler=Scheduler(), target=lambda: None, has_provider=True).plan(reg, slots, now=0.0) == []
    )


# ---------------------------------------------------------------------- the façade
def test_facade_is_deterministic_with_injected_key_and_ids():
    key = Ed25519PrivateKey.from_private_bytes(bytes(32))
    runs = []
    for _ in range(2):
        state = make_state(FakeClock(), signing_key=key, ids=ids())
        w = state.register(name="a", hardware="x", price_per_hour=1.0, inbound=False).worker_id
        blob = state.publisher.publish(0, b"weights", keep=2)
        lease = state.intake.lease(w, version=0, max_groups=1)
        runs.append((w, lease.lease_id, state.publisher.public_key, blob.manifest.model_dump()))
    assert runs[0] == runs[1]
    assert runs[0][:3] == ("id0", "id1", public_key_hex(key))


class LockCheckingProvider:
    """A provider that fails the test if it is called while the state's lock is held (by any thread:
    another thread tries to take it without blocking)."""

    def __init__(self, offers) -> None:
        self.lock: threading.RLock | None = None
        self.all = {n: WorkerOffer(name=n, throughput=mu, price=p) for n, mu, p in offers}
        self.live: set[str] = set()
        self.failed: set[str] = set()
        self.calls: list[str] = []

    def _unlocked(self, what: str) -> None:
        self.calls.append(what)
        free: list[bool] = []

        def probe() -> None:
            got = self.lock.acquire(blocking=False)
            if got:
                self.lock.release()
            free.append(got)

        t = threading.Thread(target=probe)
        t.start()
        t.join()
        if not free[0]:
            pytest.fail(f"provider.{what} called while the coordinator state's lock is held")

    def offers(self):
        self._unlocked("offers")
        return [o for n, o in self.all.items() if n not in self.live and n not in self.failed]

    def running(self):
        self._unlocked("running")
        return [self.all[n] for n in sorted(self.live)]

    def owns(self, name):
        self._unlocked("owns")
        return name in self.all

    def proves(self, name, proof):
        self._unlocked("proves")
        return True  # this test is about the lock: every registration proves its slot

    def start_slot(self, name):
        self._unlocked(f"start {name}")
        self.live.add(name)

    def stop_slot(self, name, *, failed=False):
        self._unlocked(f"stop{'-failed' if failed else ''} {name}")
        self.live.discard(name)
        if failed:
            self.failed.add(name)


def test_provider_is_never_called_under_the_lock():
    clock = FakeClock()
    target = {"mu": 2.0}
    provider = LockCheckingProvider([("a", 1.0, 0.3), ("b", 1.0, 0.9), ("c", 1.0, 0.4)])
    state = make_state(
        clock, scheduler=Scheduler(sustain_s=0.0), target=lambda: target["mu"], provider=provider, ids=ids()
    )
    provider.lock = state.shared.lock
    state.publisher.publish(0, b"v0", keep=2)
    state.expire()
    assert [c for c in provider.calls if c.startswith(("start", "stop"))] == ["start a", "start c"]
    ids_ = {
        n: state.register(name=n, hardware="x", price_per_hour=p, inbound=False).worker_id
        for n, p in [("a", 0.3), ("c", 0.4)]
    }
    assert "owns" in provider.calls and "proves" in provider.calls
    target["mu"] = 0.5  # far above: "c" (dearer) is released through the provider
    clock.now += 1.0
    for wid in ids_.values():
        state.heartbeat(wid, version=0, throughput=1.0)
    state.expire()
    assert "stop c" in provider.calls and state.registry.workers[ids_["c"]].status is WorkerStatus.RELEASED
    clock.now += 11.0  # "a" goes silent: stopped as failed
    state.expire()
    assert "stop-failed a" in provider.calls
    assert [d["worker"] for d in state.fleet.decisions][:3] == ["a", "c", "c"]


def test_probe_detects_a_call_under_the_lock():
    """The check above can fail: a provider call made while holding the lock is caught."""
    provider = LockCheckingProvider([("a", 1.0, 0.3)])
    provider.lock = threading.RLock()
    with provider.lock, pytest.raises(pytest.fail.Exception):
        provider.offers()


def test_a_failing_provider_call_records_nothing_and_propagates():
    class Broken(LockCheckingProvider):
        def start_slot(self, name):
            raise OSError("cannot start")

    clock = FakeClock()
    provider = Broken([("a", 1.0, 0.3)])
    state = make_state(clock, scheduler=Scheduler(sustain_s=0.0), target=lambda: 1.0, provider=provider)
    provider.lock = state.shared.lock
    with pytest.raises(OSError):
        state.expire()
    assert list(state.fleet.decisions) == [] and not state.shared.lock._is_owned()


def test_a_heartbeat_noted_while_a_push_holds_the_lock_counts_at_the_next_round():
    """`heartbeat_later` answers without the lock; the expiry round applies the beat (its time, its
    version, its throughput) before it looks for silent workers, so the worker is not lost."""
    clock = FakeClock()
    state = make_state(clock)
    state.publisher.publish(0, b"v0", keep=2)
    wid = state.register(name="w", hardware="cpu", price_per_hour=0.0, inbound=False).worker_id
    clock.now += 9.0
    with state.shared.lock:  # a push being stored, in another thread
        done = threading.Event()
        threading.Thread(
            target=lambda: done.set() if state.heartbeat_later(wid, version=0, throughput=3.0) else None
        ).start()
        assert done.wait(5), "heartbeat_later waited for the lock"
    clock.now += 9.0  # 18 s after registering, 9 s after the beat: silent for 10 s would be lost
    state.expire()
    info = state.registry.workers[wid]
    assert info.status is WorkerStatus.ACTIVE and info.last_seen == 1009.0 and info.throughput == 3.0
    clock.now += 2.0
    state.expire()  # 11 s after the beat, nothing since
    assert state.registry.workers[wid].status is WorkerStatus.LOST


def test_heartbeat_later_refuses_what_the_locked_heartbeat_refuses():
    """A future version raises at once; a worker that is not active is left to the blocking path
    (False), which raises as the registry does; a beat of a worker lost meanwhile counts for nothing."""
    clock = FakeClock()
    state = make_state(clock)
    state.publisher.publish(0, b"v0", keep=2)
    wid = state.register(name="w", hardware="cpu", price_per_hour=0.0, inbound=False).worker_id
    with pytest.raises(Exception, match="version 3 > published 0"):
        state.heartbeat_later(wid, version=3, throughput=0.0)
    assert state.heartbeat_later("nobody", version=0, throughput=0.0) is False
    with pytest.raises(UnknownWorker):
        state.heartbeat("nobody", version=0, throughput=0.0)
    clock.now += 1.0
    assert state.heartbeat_later(wid, version=0, throughput=5.0)
    info = state.registry.workers[wid]
    info.status = WorkerStatus.LOST
    state.expire()
    assert info.status is WorkerStatus.LOST and info.last_seen == 1000.0 and info.throughput != 5.0
