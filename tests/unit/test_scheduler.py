"""The activation policy with a fake clock: sustained deviations only, immediate replacement."""

from __future__ import annotations

from echo2.control.scheduler import Role, Scheduler, WorkerView


def pool(active_mu: list[float], standby: list[tuple[float, float]] = ((1.0, 0.3), (1.0, 0.9))):
    ws = [
        WorkerView(worker_id=f"a{i}", throughput=mu, price=0.5, role=Role.ACTIVE)
        for i, mu in enumerate(active_mu)
    ]
    ws += [
        WorkerView(worker_id=f"s{i}", throughput=mu, price=p, role=Role.STANDBY)
        for i, (mu, p) in enumerate(standby)
    ]
    return ws


def test_no_flapping_when_throughput_jitters_10_percent_around_the_target():
    sched = Scheduler(sustain_s=30, release_margin=0.15)
    decisions = []
    for t in range(0, 600, 5):  # +-10% every 5 s, never sustained for 30 s on one side
        mu = 4.0 * (1.1 if (t // 5) % 2 else 0.9)
        decisions += sched.decide(pool([mu / 2, mu / 2]), target=4.0, now=float(t))
    assert decisions == []


def test_activates_cheapest_standby_after_a_sustained_shortfall():
    sched = Scheduler(sustain_s=30)
    ws = pool([1.5, 1.5], standby=[(1.0, 0.9), (1.0, 0.3), (1.0, 0.5)])
    assert sched.decide(ws, target=4.0, now=0.0) == []
    assert sched.decide(ws, target=4.0, now=29.0) == []
    got = sched.decide(ws, target=4.0, now=30.0)
    assert [d.action for d in got] == ["activate"] and got[0].worker_id == "s1"  # rho 0.3
    assert "below target" in got[0].reason


def test_a_lost_worker_is_replaced_at_once():
    sched = Scheduler(sustain_s=30)
    ws = pool([2.0, 2.0])
    assert sched.decide(ws, target=4.0, now=0.0) == []
    ws[1] = WorkerView(worker_id="a1", throughput=2.0, price=0.5, role=Role.LOST)
    got = sched.decide(ws, target=4.0, now=1.0)
    assert [(d.action, d.worker_id) for d in got] == [("activate", "s0"), ("activate", "s1")]
    assert "replacing lost a1" in got[0].reason
    assert sched.decide(ws, target=4.0, now=2.0) == [], "a loss is acted on once"


def test_releases_most_expensive_only_after_the_sustained_interval():
    sched = Scheduler(sustain_s=30, release_margin=0.15)
    ws = [
        WorkerView(worker_id=f"w{i}", throughput=1.0, price=p, role=Role.ACTIVE)
        for i, p in enumerate([0.3, 0.9, 0.5, 0.4, 0.6, 0.35])
    ]
    assert sched.decide(ws, target=4.0, now=0.0) == []
    assert sched.decide(ws, target=4.0, now=29.9) == []
    got = sched.decide(ws, target=4.0, now=30.0)
    assert [d.worker_id for d in got] == ["w1", "w4"]  # $0.90 and $0.60; 4.0/s remain
    assert all(d.action == "release" for d in got)


def test_within_margin_nothing_is_released():
    sched = Scheduler(sustain_s=10, release_margin=0.15)
    ws = pool([2.2, 2.2])  # 4.4 = target * 1.1 < target * 1.15
    assert all(sched.decide(ws, target=4.0, now=float(t)) == [] for t in range(0, 100, 5))
