"""The activation policy with a fake clock: sustained deviations only, immediate replacement."""

from __future__ import annotations

from dataclasses import replace

from echo2.fleet.scheduler import Role, Scheduler, WorkerView


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


def test_standby_workers_of_unknown_throughput_are_activated_one_at_a_time_after_known_ones():
    """rho is infinite for a worker not measured yet: it comes after every known one, and alone in
    its decision, so an unmeasured reserve is never activated all at once."""
    sched = Scheduler(sustain_s=10)
    ws = pool([], standby=[(0.0, 0.2), (0.0, 0.1), (1.0, 3.0), (0.0, 0.3)])
    assert sched.decide(ws, target=5.0, now=0.0) == []
    got = sched.decide(ws, target=5.0, now=10.0)
    assert [d.worker_id for d in got] == ["s2"], "the known one; not the unknown ones with it"
    ws = [w if w.worker_id != "s2" else replace(w, role=Role.ACTIVE) for w in ws]
    assert sched.decide(ws, target=5.0, now=15.0) == [], "the shortfall is timed again"
    got = sched.decide(ws, target=5.0, now=20.0)
    assert [d.worker_id for d in got] == ["s0"] and "not known yet" in got[0].reason


def test_five_standby_workers_are_activated_in_rho_order_not_all_at_once():
    """Five standby workers of different prices, registered with declared or calibrated throughput
    (none with 0): as the target grows, each decision activates the next lowest rho = price /
    throughput, and only as many as reach the target (not price order, not registration order)."""
    from support import FakeClock, make_state

    clock = FakeClock()
    target = {"mu": 1.5}
    state = make_state(clock, scheduler=Scheduler(sustain_s=20.0), target=lambda: target["mu"])
    state.publisher.publish(0, b"v0", keep=2)
    # name: ($/h, trajectories/s, declared at registration or calibrated and sent in a heartbeat)
    pool_ = {
        "a": (3.0, 6.0, "declared"),  # rho 0.5
        "b": (0.2, 0.1, "calibrated"),  # rho 2.0
        "c": (1.0, 1.0, "declared"),  # rho 1.0
        "d": (2.0, 0.5, "calibrated"),  # rho 4.0
        "e": (0.5, 2.0, "calibrated"),  # rho 0.25
    }
    ids = {
        name: state.register(
            name=name,
            hardware="x",
            price_per_hour=price,
            inbound=False,
            throughput=mu if how == "declared" else 0.0,
        ).worker_id
        for name, (price, mu, how) in pool_.items()
    }

    def beat() -> None:
        for name, (_, mu, how) in pool_.items():  # a calibrated worker reports its figure
            state.heartbeat(ids[name], version=0, throughput=mu if how == "calibrated" else 0.0)

    beat()
    assert all(r["state"] == "standby" for r in state.status()["workers"])
    activated = []
    for mu in (1.5, 7.5, 8.5, 9.05, 9.5):  # each needs exactly one more worker, by rho
        target["mu"] = mu
        state.expire()  # the shortfall starts being timed
        for _ in range(4):
            clock.now += 5.0
            beat()
            state.expire()
        now = [d["worker"] for d in state.fleet.decisions if d["action"] == "activate"]
        assert len(now) == len(activated) + 1, f"target {mu}: one activation, got {now[len(activated) :]}"
        activated = now
    assert activated == ["e", "a", "c", "b", "d"]
    assert [d["reason"].rsplit("rho=", 1)[1] for d in state.fleet.decisions] == ["0.25", "0.5", "1", "2", "4"]
