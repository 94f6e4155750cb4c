"""`echo2 simulate`: the chunk schedule against the chain formula, the simulated bubble ratio against
the capacity model, determinism, fault recovery and scenario errors."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from echo2.broadcast.plan import PeerInfo, build_chains, build_star, chain_broadcast_time
from echo2.fleet.scheduler import Role, WorkerView
from echo2.planning import capacity
from echo2.sim.broadcast import Transfer, fair_shares
from echo2.sim.fleet import RandomActivation
from echo2.sim.model import Simulation, simulate
from echo2.sim.report import metrics
from echo2.sim.scenario import expand, load_tree, validate

MIB = 2**20
PAPER = sorted(Path(__file__).resolve().parents[2].joinpath("scenarios", "paper").glob("*.toml"))

BASE = {
    "seed": 1,
    "steps": 40,
    "learner": {"t_train": 100.0, "batch": 256, "group_size": 8, "staleness": 3, "snapshot_gb": 1.0},
    "broadcast": {"topology": "star", "chunk_mib": 64.0},
    "workers": [{"name": "w", "count": 4, "throughput": 0.5, "download_mbps": 200.0}],
}


def tree(**sections) -> dict:
    out = copy.deepcopy(BASE)
    for key, value in sections.items():
        if isinstance(value, dict):
            out.setdefault(key, {}).update(value)
        else:
            out[key] = value
    return out


def run(t: dict) -> dict:
    return metrics(simulate(validate(t)))


# ---------------------------------------------------------------------------- chunk schedule
def test_chain_schedule_is_the_closed_form():
    bw, c, k, d = 12.5e6, 8 * MIB, 40, 0.05  # 100 Mbps, 40 chunks of 8 MiB, 50 ms per hop
    peers = [PeerInfo(worker_id=f"w{i}", score=50.0, inbound=True) for i in range(10)]
    plan = build_chains(peers, 3)  # chains of 4, 3, 3
    tr = Transfer(
        plan=plan,
        size_bytes=k * c,
        chunk_bytes=c,
        hop_delay_s=d,
        uplink_bps=3 * bw,
        link_cap=lambda s, r: bw,
        t0=0.0,
    )
    for chain in plan.chains:
        for hop, w in enumerate(chain, start=1):
            assert tr.install_time(w) == pytest.approx(hop * d + (k + hop - 1) * c / bw, rel=1e-12)
    last = max(tr.install_time(w) for w in plan.workers())
    assert last == pytest.approx(chain_broadcast_time(10, 3, k * c, c, bw, d), rel=1e-12)


def test_learner_uplink_is_shared_max_min_fair():
    assert fair_shares(200.0, [50.0, 100.0, 100.0]) == [50.0, 75.0, 75.0]
    assert fair_shares(math.inf, [10.0, 20.0]) == [10.0, 20.0]
    tr = Transfer(
        plan=build_star(["a", "b", "c"]),
        size_bytes=300.0,
        chunk_bytes=100.0,
        hop_delay_s=0.0,
        uplink_bps=200.0,
        link_cap=lambda s, r: {"a": 50.0, "b": 100.0, "c": 100.0}[r],
        t0=0.0,
    )
    assert [tr.install_time(w) for w in "abc"] == pytest.approx([6.0, 4.0, 4.0])


def test_dropped_relay_stalls_its_tail_until_the_chain_is_rebuilt():
    plan = build_chains(
        [PeerInfo(worker_id=w, score=s, inbound=True) for w, s in (("a", 3), ("b", 2), ("c", 1))], 1
    )
    assert plan.chains == (("a", "b", "c"),)
    tr = Transfer(
        plan=plan,
        size_bytes=100.0,
        chunk_bytes=10.0,
        hop_delay_s=0.0,
        uplink_bps=10.0,
        link_cap=lambda s, r: 10.0,
        t0=0.0,
    )
    assert tr.install_time("c") == pytest.approx(12.0)
    tr.drop("b", 5.0)  # c gets chunk k at k + 3: it holds chunks 0..2 when b vanishes
    assert tr.install_time("c") == math.inf and tr.arrivals("c")[:3] == pytest.approx([3.0, 4.0, 5.0])
    assert tr.reattach("b", 20.0) == "c"
    assert tr.plan.chains == (("a", "c"),)
    # c resumes from a (who has everything) at 20 s with the 7 chunks it lacks: done at 27 s.
    assert tr.install_time("c") == pytest.approx(27.0)


def test_demoted_relay_keeps_receiving_and_its_tail_moves_behind_a_free_chain_tail():
    plan = build_chains([PeerInfo(worker_id=w, score=9 - i, inbound=True) for i, w in enumerate("adbec")], 2)
    assert plan.chains == (("a", "b", "c"), ("d", "e"))
    tr = Transfer(
        plan=plan, size_bytes=100.0, chunk_bytes=10.0, hop_delay_s=0.0, uplink_bps=20.0,
        link_cap=lambda s, r: 10.0, t0=0.0,
    )  # fmt: skip
    assert [tr.install_time(w) for w in "abcde"] == pytest.approx([10.0, 11.0, 12.0, 10.0, 11.0])
    assert tr.demote("b", 5.0, open_tails={"e", "c"}) == ["c"]
    assert tr.plan.chains == (("a",), ("d", "e", "c"), ("b",))
    assert tr.links["c"].sender == "e" and tr.links["b"].sender == "a"
    # c held chunks 0..2 at 5 s; e holds chunk k from k + 2, so c gets chunks 3..9 at 6..12 s
    assert tr.arrivals("c") == pytest.approx([3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0])
    assert tr.install_time("b") == pytest.approx(11.0), "b still receives from a"


def test_slow_link_recompute_keeps_sent_bytes():
    rate = {"a": 10.0}
    tr = Transfer(
        plan=build_star(["a"]), size_bytes=100.0, chunk_bytes=50.0, hop_delay_s=0.0, uplink_bps=math.inf,
        link_cap=lambda s, r: rate[r], t0=0.0,
    )  # fmt: skip
    assert tr.install_time("a") == pytest.approx(10.0)
    rate["a"] = 5.0
    tr.recompute(2.5)  # 25 of the first 50 bytes sent; 75 left at 5 B/s
    assert tr.install_time("a") == pytest.approx(2.5 + 75 / 5)


# ---------------------------------------------------------------------------- closed forms
def test_simulated_chain_broadcast_matches_the_formula():
    # 10 workers, B0 = 300 Mbps, Bw = 100 Mbps: 3 chains of 4, 3, 3 hops; 40 chunks of 16 MiB.
    t = tree(
        steps=4,
        learner={"snapshot_gb": 40 * 16 * MIB / 1e9, "staleness": 2},
        broadcast={"topology": "chains", "uplink_mbps": 300.0, "chunk_mib": 16.0, "hop_delay_s": 0.05},
        workers=[{"name": "w", "count": 10, "throughput": 0.5, "download_mbps": 100.0}],
    )
    m = run(t)
    hops, bw, c = 4, 100e6 / 8, 16 * MIB
    formula = hops * 0.05 + (40 + hops - 1) * c / bw
    assert m["t_bcast_q100"] == pytest.approx(formula, rel=0.01)
    assert m["t_bcast_formula"] == pytest.approx(formula, rel=0.01)


@pytest.mark.parametrize(
    ("snapshot_gb", "workers", "staleness"),
    [(1.0, 4, 3), (4.0, 4, 3), (4.0, 4, 2), (4.0, 3, 6), (1.0, 8, 3)],
)
def test_bubble_matches_the_capacity_model_when_rollouts_stop_during_broadcast(
    snapshot_gb, workers, staleness
):
    """The capacity model's cycle (App. B.1) is exactly what happens when workers generate nothing
    between a publication and their install, all at once (star, equal links, no jitter, no faults)."""
    t = tree(
        steps=60,
        learner={"snapshot_gb": snapshot_gb, "staleness": staleness},
        broadcast={"uplink_mbps": math.inf},
        rollout={"keep_generating": False},
        workers=[{"name": "w", "count": workers, "throughput": 0.5, "download_mbps": 200.0}],
    )
    m = run(t)
    kappa = max(1, staleness - 1)
    predicted = capacity.bubble_ratio(
        kappa=kappa, t_train=100.0, t_bcast=m["t_bcast_q100"], batch=256, mu_pool=workers * 0.5
    )
    assert m["bubble_ratio"] == pytest.approx(predicted, rel=0.01, abs=1e-9)


def test_bubble_matches_the_continuous_model_when_workers_keep_generating():
    m = run(tree(steps=60, learner={"snapshot_gb": 1.0}, broadcast={"uplink_mbps": math.inf}))
    predicted = capacity.bubble_ratio_continuous(
        kappa=2, staleness=3, t_train=100.0, t_bcast=m["t_bcast_q100"], batch=256, mu_pool=2.0
    )
    assert predicted == pytest.approx(1 - 2.0 * 100 / 256)
    assert m["bubble_ratio"] == pytest.approx(predicted, rel=0.01)
    assert m["max_staleness"] <= 3 and m["dropped_stale"] == 0


# ---------------------------------------------------------------------------- determinism, faults
FAULTY = tree(
    steps=16,
    learner={"t_train": 100.0, "jitter": 0.2, "snapshot_gb": 2.0},
    broadcast={
        "topology": "chains",
        "uplink_mbps": 300.0,
        "chunk_mib": 32.0,
        "hop_delay_s": 0.05,
        "storage_mbps": 800.0,
    },
    workers=[{"name": "w", "count": 12, "throughput": 0.9, "jitter": 0.3, "download_mbps": 200.0}],
    scheduler={"enabled": True, "gamma": 1.0, "sustain_s": 10.0, "window_s": 10.0},
    rollout={"keep_generating": False},
)


def test_same_seed_same_run_other_seed_other_run():
    t = copy.deepcopy(FAULTY)
    t["faults"] = [{"worker": "forwarder", "kind": "drop", "publication": 2, "offset_s": 20.0}]
    a, b = run(t), run(t)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    t["seed"] = 2
    assert run(t)["wait_per_step_series"] != a["wait_per_step_series"]


FAULTS = {
    "broadcast: forwarder slows": {"worker": "forwarder", "kind": "slow", "stage": "link", "publication": 3, "offset_s": 20.0, "duration_s": 60.0},
    "broadcast: forwarder drops": {"worker": "forwarder", "kind": "drop", "publication": 3, "offset_s": 20.0},
    "rollout: worker slows": {"worker": "tail", "kind": "slow", "stage": "rollout", "publication": 3, "offset_s": 120.0},
    "rollout: worker drops": {"worker": "tail", "kind": "drop", "publication": 3, "offset_s": 120.0},
}  # fmt: skip


@pytest.mark.parametrize("name", list(FAULTS))
def test_each_fault_recovers(name):
    t = copy.deepcopy(FAULTY)
    t["learner"]["jitter"] = 0.0
    t["workers"][0]["jitter"] = 0.0
    t["faults"] = [FAULTS[name]]
    sim = simulate(validate(t))
    m = metrics(sim)
    assert not m["stalled"] and m["steps"] == 16
    (f,) = m["faults"]
    assert f["throughput_drop"] > 0, "the fault had no effect"
    assert f["recovery_s"] < 3 * 2 * 100.0, "mu_pool did not return to the target"
    if FAULTS[name]["kind"] == "drop":
        assert any(d["action"] == "activate" for d in m["scheduler_decisions"]), "no replacement"


def test_a_permanently_slow_forwarder_is_demoted_and_never_slows_a_broadcast_again():
    """Its child measures it below the relay floor (3/4 of the peers' rate) and reports it within one
    window of reading; it leaves the chain in flight, sits out the next plan as a tail, and no later
    broadcast is slower than those before the fault. (Before demotion existed, the scores kept a
    half-speed forwarder ahead of untried workers and every later broadcast went through it.)"""
    t = copy.deepcopy(FAULTY)
    t["learner"]["jitter"] = t["workers"][0]["jitter"] = 0.0
    t["faults"] = [{"worker": "forwarder", "kind": "slow", "stage": "link", "publication": 2}]
    sim = simulate(validate(t))
    fault = sim.faults[0]
    hit = [p for p in sim.publications if p.time <= fault.time][-1]  # the broadcast it slowed
    ((at, demoted),) = hit.demoted
    assert demoted == fault.worker and fault.time < at <= fault.time + 10.0  # progress_timeout_s
    later = [p for p in sim.publications if p.time > fault.time]
    assert later[0].plan.child_of(fault.worker) is None, "only a tail in the next plan"
    normal = max(p.t_bcast(1.0, set(sim.workers)) for p in sim.publications if p.time < hit.time)
    for p in later:
        assert p.t_bcast(1.0, set(sim.workers)) <= normal * 1.01
        assert p.plan.child_of(fault.worker) is None or p.demoted  # tried again: caught again


def test_without_demotion_a_slow_forwarder_keeps_forwarding():
    """`slow_relay_fraction = 0`: only the scores rank it, and its record keeps it a relay."""
    t = copy.deepcopy(FAULTY)
    t["learner"]["jitter"] = t["workers"][0]["jitter"] = 0.0
    t["broadcast"]["slow_relay_fraction"] = 0.0
    t["faults"] = [{"worker": "forwarder", "kind": "slow", "stage": "link", "publication": 2}]
    sim = simulate(validate(t))
    slow = sim.faults[0].worker
    later = [p for p in sim.publications if p.time > sim.faults[0].time]
    assert later and all(p.plan.child_of(slow) is not None and not p.demoted for p in later)


def table4_run(label: str):
    """One series of scenarios/paper/table4-faults.toml: its scenario, the simulation and its metrics."""
    runs = expand(load_tree(Path(PAPER[0]).with_name("table4-faults.toml")))
    ((_, _, sc),) = [r for r in runs if r[0] == label]
    sim = simulate(sc)
    return sc, sim, metrics(sim)


def test_table4_half_speed_forwarder_recovers_within_the_papers_time():
    """Table 4's broadcast row "1 forwarder slows 0.5x" (scenarios/paper/table4-faults.toml): the
    paper recovers in 312 s with an 8.94% drop. Demoted 5 s after the fault, its chain's tail moved
    behind another chain's tail, no worker lags past a normal broadcast."""
    sc, sim, m = table4_run("Broadcast: 1 forwarder slows 0.5x")
    (f,) = m["faults"]
    assert f["recovery_s"] is not None and f["recovery_s"] <= 312.0
    assert f["throughput_drop"] <= 0.0894
    assert [w for p in sim.publications for _, w in p.demoted] == [f["worker"]]
    assert not m["stalled"] and m["steps"] == sc.steps


def test_random_activation_fills_a_sustained_shortfall_replaces_the_lost_and_never_releases():
    """The w/o-Cost ablation policy, asked directly (its draws come from the run's one rng)."""
    world = Simulation(
        validate(tree(scheduler={"enabled": True, "policy": "random", "sustain_s": 10.0}))
    ).world
    policy = RandomActivation(world)

    def views(**roles: Role) -> list[WorkerView]:
        return [
            WorkerView(
                worker_id=w, throughput=0.5, price=1.0, role=roles.get(w.replace("-", "_"), Role.STANDBY)
            )
            for w in world.workers
        ]

    one_active = views(w_0=Role.ACTIVE)
    assert policy.pending
    assert policy.decide(one_active, target=1.2, now=0.0) == []  # below target since 0 s
    assert policy.decide(one_active, target=1.2, now=9.0) == []  # not sustained yet
    out = policy.decide(one_active, target=1.2, now=10.0)
    assert [d.action for d in out] == ["activate", "activate"]  # 0.5 + 2 * 0.5 >= 1.2
    assert {d.worker_id for d in out} <= {"w-1", "w-2", "w-3"}
    # a newly lost worker is replaced at once, without waiting for sustain_s
    (d,) = policy.decide(views(w_0=Role.LOST, w_1=Role.ACTIVE), target=1.0, now=11.0)
    assert d.action == "activate" and d.worker_id in {"w-2", "w-3"}
    # far above target: nothing is released
    assert policy.decide(views(w_0=Role.ACTIVE, w_1=Role.ACTIVE, w_2=Role.ACTIVE), target=0.1, now=99.0) == []


def test_table4_dropped_forwarder_recovers_within_the_papers_time():
    """Table 4's broadcast row "1 forwarder drops out": the paper recovers in 312 s ("from fault
    injection to the moment mu_pool returns to mu_target"). The dropped relay's child reports it
    after the progress timeout (10 s), before the heartbeat timeout (15 s) marks it lost, and is
    routed around it; the replacement fetches from storage. Its two downstream workers still
    install after the rest (the 10 s without a parent and the chunk lost in flight), which
    `recovered_for_good_s` shows as a later dip."""
    sc, sim, m = table4_run("Broadcast: 1 forwarder drops out")
    (f,) = m["faults"]
    assert f["recovery_s"] is not None and f["recovery_s"] <= 312.0
    assert f["recovered_for_good_s"] is not None and f["recovered_for_good_s"] >= f["recovery_s"]
    fault = sim.faults[0]
    hit = [p for p in sim.publications if p.time <= fault.time][-1]
    orphans = [w for c in hit.plan.chains if c[0] == fault.worker for w in c[1:]]
    assert orphans, "the dropped worker was a forwarder"
    others = max(t for w, t in hit.installs.items() if w not in orphans)  # a chain as long, unbroken
    late = max(hit.installs[w] for w in orphans) - others
    # without a parent for the progress timeout (not the heartbeat timeout), plus the chunk in flight
    chunk_s = sc.broadcast.chunk_bytes / (sc.workers[0].download_mbps * 1e6 / 8)
    assert sc.broadcast.progress_timeout_s <= late <= sc.broadcast.progress_timeout_s + chunk_s + 0.5
    assert not m["stalled"] and m["steps"] == sc.steps
