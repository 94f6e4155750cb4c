"""Chain planning and worker scores (Appendix C.3), pinned against hand-computed values."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2.broadcast import plan as bp
from echo2.broadcast.plan import ChainPlan, PeerInfo, PeerStats, ScoreParams
from echo2.config import SLOW_RELAY_FRACTION

MB = 1_000_000


def stats_with(n: int, rate: float, start: float = 0.0) -> PeerStats:
    s = PeerStats()
    for i in range(n):
        s.record_transfer(int(rate), 1.0, now=start + i)
    return s


# --- scores -------------------------------------------------------------------------------------


def test_no_history_scores_neutral_55():
    assert PeerStats().score(now=1e6, reference_bps=MB) == bp.NEUTRAL_SCORE == 55.0


def test_ten_transfers_at_the_peers_rate_score_100():
    s = stats_with(10, 1 * MB)
    assert s.speed(reference_bps=MB) == pytest.approx(100.0)  # at the peers' rate: 100
    assert s.success() == 1.0 and s.stability() == 1.0
    assert s.score(now=9.0, reference_bps=MB) == pytest.approx(0.5 * 100 + 35 + 15)  # 100, no decay
    assert s.score(now=9.0, reference_bps=2 * MB) == pytest.approx(0.5 * 100 * (1 - math.log10(2)) + 50)


def test_decay_caps_at_30_percent_after_idle():
    s = stats_with(10, 1 * MB)  # last update at t = 9
    assert s.score(now=9 + 60, reference_bps=MB) == pytest.approx(0.9 * 100)  # 1 - 60/600
    assert s.score(now=9 + 180, reference_bps=MB) == pytest.approx(0.7 * 100)  # 1 - 0.3
    assert s.score(now=9 + 600, reference_bps=MB) == pytest.approx(0.7 * 100)
    assert s.score(now=0.0, reference_bps=MB) == pytest.approx(
        100
    )  # a clock behind the last update: no decay


def test_speed_scale_is_relative_to_the_peers_rate_and_clamped():
    # 100 * (1 + log10(rate / reference)): 100 at the peers' rate or faster, 0 a decade below
    for rate, speed in [(1e5, 0.0), (2e5, 30.103), (5e5, 69.897), (1e6, 100.0), (1e7, 100.0), (1e3, 0.0)]:
        assert stats_with(1, rate).speed(reference_bps=MB) == pytest.approx(speed, abs=1e-3)
    assert stats_with(1, 1e6).speed(reference_bps=1e7) == pytest.approx(0.0)  # a tenth of faster peers
    s = PeerStats()
    s.record_transfer(1 * MB, 1.0, now=0)
    s.record_transfer(3 * MB, 1.0, now=1)  # mean of rates (2 MB/s), not of scores
    assert s.speed(reference_bps=4 * MB) == pytest.approx(100 * (1 - math.log10(2)))  # 69.9
    wide = PeerStats(params=ScoreParams(speed_decades=2.0))
    wide.record_transfer(MB // 10, 1.0, now=0)
    assert wide.speed(reference_bps=MB) == pytest.approx(50.0)  # a tenth is half of two decades down
    with pytest.raises(ValueError):
        s.speed(reference_bps=0.0)


def test_speed_dominates_a_relay_at_a_tenth_of_its_peers_rate_ranks_below_a_newcomer():
    """Appendix C.3: ranking is dominated by Speed. The old absolute log scale (log10(rate) - 3) / 5
    moved a relay at a tenth of 12.5 MB/s by only 10 points (81 vs 91), so a perfect record kept it
    above a newcomer (55); against the peers' rate a tenth scores 0 + 35 + 15 = 50, half 84.9."""
    peers_rate = 12.5 * MB
    tenth, half, healthy = (stats_with(10, r * peers_rate) for r in (0.1, 0.5, 1.0))
    assert tenth.score(now=9.0, reference_bps=peers_rate) == pytest.approx(50.0)
    assert half.score(now=9.0, reference_bps=peers_rate) == pytest.approx(
        0.5 * 100 * (1 + math.log10(0.5)) + 50
    )
    assert healthy.score(now=9.0, reference_bps=peers_rate) == pytest.approx(100.0)
    newcomer = PeerStats().score(now=9.0, reference_bps=peers_rate)
    assert (
        tenth.score(now=9.0, reference_bps=peers_rate)
        < newcomer
        < half.score(now=9.0, reference_bps=peers_rate)
    )
    fleet = [
        PeerInfo(worker_id=w, score=st_.score(now=9.0, reference_bps=peers_rate), inbound=True)
        for w, st_ in (("slow", tenth), ("new", PeerStats()), ("ok", healthy))
    ]
    assert bp.build_chains(fleet, 1).chains == (("ok", "new", "slow"),)  # the slow relay is the tail


def test_speed_uses_only_the_last_ten_transfers():
    s = PeerStats()
    s.record_transfer(100 * MB, 1.0, now=0)
    for i in range(10):
        s.record_transfer(1 * MB, 1.0, now=1 + i)
    assert s.speed(reference_bps=10 * MB) == pytest.approx(0.0)  # with the 100 MB/s one: mean 10 MB/s, 100
    assert s.successes == 11


def test_zero_duration_counts_as_success_without_rate():
    s = PeerStats()
    s.record_transfer(10, 0.0, now=0)
    assert s.speed(reference_bps=MB) == 0.0 and s.success() == 1.0
    assert s.score(now=0, reference_bps=MB) == pytest.approx(35 + 0.15 * 10)


def test_failures_lower_success_and_stability():
    s = stats_with(10, 1 * MB)
    for i in range(4):
        s.record_failure(now=10 + i)
    assert s.consecutive_failures == 4 and s.stability() == 0.0  # more than 3 in a row
    assert s.success() == pytest.approx(10 / 14)
    assert s.score(now=13, reference_bps=MB) == pytest.approx(0.5 * 100 + 35 * 10 / 14)  # 75
    assert not s.may_relay()  # failed as a parent more than 3 times in a row: only a tail
    s.record_transfer(MB, 1.0, now=14)  # one success resets the failure run
    assert s.consecutive_failures == 0 and s.stability() == pytest.approx(0.1) and s.may_relay()


def test_a_slow_report_is_a_failure_and_demotes_for_one_plan():
    s = stats_with(10, 1 * MB)
    assert s.may_relay()
    s.record_slow(now=10)
    assert s.demoted and not s.may_relay()
    assert s.failures == 1 and s.consecutive_failures == 1 and s.stability() == 0.0
    assert s.score(now=10, reference_bps=MB) == pytest.approx(0.5 * 100 + 35 * 10 / 11)  # 81.8
    s.demoted = False  # the plan it sat out was made
    assert s.may_relay()


def test_relay_floor_is_a_fraction_of_the_measured_peers_rate():
    assert (
        bp.relay_floor(12.5 * MB, SLOW_RELAY_FRACTION)
        == pytest.approx(0.75 * 12.5 * MB)
        == pytest.approx(9.375 * MB)
    )
    assert bp.relay_floor(12.5 * MB, 0.5) == pytest.approx(6.25 * MB)
    assert bp.relay_floor(None, SLOW_RELAY_FRACTION) is None  # not measured: a configured Bw is no evidence
    assert bp.relay_floor(12.5 * MB, 0.0) is None  # demotion off


def test_only_failures_scores_zero():
    s = PeerStats()
    s.record_failure(now=0)
    assert s.success() == 0.0 and s.score(now=0, reference_bps=MB) == 0.0


def test_score_params_are_configurable():
    s = PeerStats(params=ScoreParams(success_saturation=5, decay_window_s=100, history=2))
    for i in range(3):
        s.record_transfer([100 * MB, MB, MB][i], 1.0, now=i)
    assert s.speed(reference_bps=10 * MB) == pytest.approx(0.0)  # history 2 drops the 100 MB/s transfer
    assert s.stability() == pytest.approx(3 / 5)
    assert s.decay(now=2 + 10) == pytest.approx(0.9)
    assert PeerStats().success() == 0.5  # no history


# --- chain count and formulas ---------------------------------------------------------------------


def test_n_chains():
    assert bp.n_chains(100 * MB, 10 * MB, 50) == 10
    assert bp.n_chains(100 * MB, 10 * MB, 4) == 4  # no more chains than workers
    assert bp.n_chains(5 * MB, 10 * MB, 8) == 1  # at least one
    assert bp.n_chains(125 * MB, 10 * MB, 50) == 12  # floor
    assert bp.n_chains(0.3, 0.1, 10) == 3  # not floor(2.9999999999999996)
    assert bp.n_chains(math.inf, 10 * MB, 7) == 7
    assert bp.n_chains(100 * MB, 10 * MB, 0) == 1
    with pytest.raises(ValueError):
        bp.n_chains(100 * MB, 0, 5)


def test_broadcast_time_formulas_hand_computed():
    # L = ceil(8/2) = 4 hops, K = 25 chunks of 4 MB at 10 MB/s: 4 * 0.05 + (25 + 3) * 0.4 = 11.4 s
    assert bp.chain_broadcast_time(8, 2, 100 * MB, 4 * MB, 10 * MB, 0.05) == pytest.approx(11.4)
    # K = ceil(10/4) = 3, L = ceil(5/2) = 3: 3 * 0.1 + (3 + 2) * 0.4 = 2.3 s
    assert bp.chain_broadcast_time(5, 2, 10 * MB, 4 * MB, 10 * MB, 0.1) == pytest.approx(2.3)
    assert bp.chain_broadcast_time(0, 2, 10 * MB, 4 * MB, 10 * MB, 0.1) == 0.0
    # star: 10 receivers share 50 MB/s -> 5 MB/s each; 2 receivers are capped by Bw = 10 MB/s
    assert bp.star_broadcast_time(10, 100 * MB, 50 * MB, 10 * MB) == pytest.approx(20.0)
    assert bp.star_broadcast_time(2, 100 * MB, 50 * MB, 10 * MB) == pytest.approx(10.0)
    assert bp.lower_bound(100 * MB, 10 * MB) == pytest.approx(10.0)


def test_plan_broadcast_chains_or_star():
    fleet = peers(*[(f"w{i}", i, True) for i in range(5)])

    # B0 / Bw = 2.5: two chains, seeds by score, as build_chains lays them out
    def chains(uplink_bps: float, n_ch: int | None = None) -> tuple[tuple[str, ...], ...]:
        return bp.plan_broadcast(
            fleet, mode="chain", uplink_bps=uplink_bps, worker_bps=10 * MB, n_ch=n_ch
        ).chains

    assert chains(25 * MB) == (("w4", "w2", "w0"), ("w3", "w1"))
    # n_ch fixed by the caller wins over the bandwidth ratio, capped at the number of peers
    assert len(chains(25 * MB, n_ch=3)) == 3 and len(chains(1.0, n_ch=9)) == 5
    assert len(chains(math.inf)) == 5  # unlimited uplink: every peer is a seed
    # a star keeps the caller's order and ignores scores
    star = bp.plan_broadcast(fleet[::-1], mode="star", uplink_bps=1.0, worker_bps=1.0)
    assert star.mode == "star" and star.chains == (("w4",), ("w3",), ("w2",), ("w1",), ("w0",))
    assert bp.plan_broadcast([], mode="chain", uplink_bps=1.0, worker_bps=1.0).chains == ()
    with pytest.raises(ValueError):
        bp.plan_broadcast(fleet, mode="chains", uplink_bps=1.0, worker_bps=1.0)


def test_broadcast_time_follows_the_plan_it_predicts():
    common = dict(size_bytes=100 * MB, chunk_bytes=4 * MB, worker_bps=10 * MB, hop_delay_s=0.05)
    # B0 / Bw = 2.5 -> 2 chains of 8 workers: the 11.4 s above
    assert bp.broadcast_time(8, mode="chain", uplink_bps=25 * MB, **common) == pytest.approx(11.4)
    # 8 chains fixed: one hop, 25 chunks: 0.05 + 25 * 0.4
    assert bp.broadcast_time(8, mode="chain", uplink_bps=25 * MB, n_ch=8, **common) == pytest.approx(10.05)
    # star: 10 receivers share 50 MB/s
    assert bp.broadcast_time(10, mode="star", uplink_bps=50 * MB, **common) == pytest.approx(20.0)
    assert bp.broadcast_time(0, mode="chain", uplink_bps=25 * MB, **common) == 0.0


@given(
    n=st.integers(1, 500),
    n_ch=st.integers(1, 50),
    size=st.floats(1e3, 1e11),
    chunk=st.floats(1e3, 1e8),
    bw=st.floats(1e3, 1e10),
    d=st.floats(0, 1),
)
def test_chain_time_never_beats_the_lower_bound(n, n_ch, size, chunk, bw, d):
    assert bp.chain_broadcast_time(n, n_ch, size, chunk, bw, d) >= bp.lower_bound(size, bw) * (1 - 1e-12)


# --- chain assembly ---------------------------------------------------------------------------------


def peers(*specs: tuple[str, float, bool]) -> list[PeerInfo]:
    return [PeerInfo(worker_id=w, score=s, inbound=i) for w, s, i in specs]


def test_seeds_are_top_ranked_and_the_rest_round_robin_in_rank_order():
    ps = peers(*[(f"w{i}", 90 - i, True) for i in range(7)])
    plan = bp.build_chains(list(reversed(ps)), 3)
    assert plan.mode == "chain"
    assert plan.chains == (("w0", "w3", "w6"), ("w1", "w4"), ("w2", "w5"))
    assert plan.parent_of("w0") is None and plan.child_of("w0") == "w3"
    assert plan.parent_of("w6") == "w3" and plan.child_of("w6") is None
    assert plan.workers() == ("w0", "w3", "w6", "w1", "w4", "w2", "w5")


def test_ties_are_broken_by_worker_id():
    plan = bp.build_chains(peers(("b", 50, True), ("a", 50, True), ("c", 60, True)), 2)
    assert plan.chains == (("c", "b"), ("a",))


def test_inbound_less_workers_only_at_tails_at_most_one_per_chain():
    ps = peers(
        ("x", 99, False),  # best score, but cannot serve a child: not a seed
        ("a", 80, True),
        ("b", 70, True),
        ("c", 60, True),
        ("y", 50, False),
        ("z", 40, False),
    )
    plan = bp.build_chains(ps, 2)
    # seeds a, b; c to chain 0; the round robin continues at chain 1 with x, then y to chain 0;
    # z finds every chain with an inbound-less tail and gets its own chain from the learner
    assert plan.chains == (("a", "c", "y"), ("b", "x"), ("z",))
    for w in "xyz":
        assert plan.child_of(w) is None


def test_fewer_inbound_capable_workers_than_chains():
    plan = bp.build_chains(peers(("a", 50, True), ("x", 90, False), ("y", 80, False), ("z", 70, False)), 3)
    assert plan.chains == (("a", "x"), ("y",), ("z",))
    assert bp.build_chains(peers(("x", 1, False), ("y", 2, False)), 4).chains == (("y",), ("x",))


def test_more_chains_than_workers_and_empty_fleet():
    plan = bp.build_chains(peers(("a", 1, True), ("b", 2, True)), 5)
    assert plan.chains == (("b",), ("a",))
    assert bp.build_chains([], 3).chains == ()
    with pytest.raises(ValueError):
        bp.build_chains(peers(("a", 1, True)), 0)


def test_star_plan_and_dict_round_trip():
    star = bp.build_star(["a", "b", "c"])
    assert star.mode == "star" and star.chains == (("a",), ("b",), ("c",))
    assert all(star.parent_of(w) is None and star.child_of(w) is None for w in "abc")
    plan = bp.build_chains(peers(*[(f"w{i}", i, True) for i in range(5)]), 2)
    d = json.loads(json.dumps(plan.to_dict()))
    assert d == {"mode": "chain", "chains": [["w4", "w2", "w0"], ["w3", "w1"]]}
    assert ChainPlan.from_dict(d) == plan


def test_plan_validation_and_unknown_workers():
    with pytest.raises(ValueError):
        ChainPlan(chains=(("a", "b"), ("a",)))
    with pytest.raises(ValueError):
        ChainPlan(chains=(("a",), ()))
    with pytest.raises(ValueError):
        ChainPlan(chains=(("a",),), mode="tree")
    with pytest.raises(KeyError):
        ChainPlan(chains=(("a",),)).parent_of("nobody")


# --- recovery ----------------------------------------------------------------------------------------

PLAN = ChainPlan(chains=(("a", "b", "c", "d"), ("e", "f"), ("g",)))


def test_excise_seed_promotes_its_child_to_seed():
    new = PLAN.excise("a")
    assert new.chains == (("b", "c", "d"), ("e", "f"), ("g",))
    assert new.parent_of("b") is None  # now fed by the learner
    assert PLAN.chains[0] == ("a", "b", "c", "d")  # the old plan is unchanged


def test_excise_relay_reattaches_its_tail_to_the_nearest_healthy_parent():
    new = PLAN.excise("b").excise("c")
    assert new.chains[0] == ("a", "d")
    assert new.parent_of("d") == "a" and new.child_of("a") == "d"


def test_excise_tail_and_single_worker_chain():
    new = PLAN.excise("f")
    assert new.chains == (("a", "b", "c", "d"), ("e",), ("g",))
    assert new.child_of("e") is None
    assert PLAN.excise("g").chains == (("a", "b", "c", "d"), ("e", "f"))
    assert PLAN.excise("nobody") is PLAN
    assert bp.build_star(["a", "b"]).excise("a").mode == "star"


def test_demote_moves_a_slow_relays_tail_behind_the_shortest_free_chain_tail():
    new = PLAN.demote("b", open_tails={"f", "g"})
    assert new.chains == (("a",), ("e", "f"), ("g", "c", "d"))  # g's chain is shortest
    assert new.parent_of("c") == "g" and new.child_of("a") is None
    seed = PLAN.demote("a", open_tails={"f"})  # no new learner stream: behind f
    assert seed.chains == (("e", "f", "b", "c", "d"), ("g",))
    assert seed.parent_of("b") == "f"


def test_demote_without_a_free_tail_or_child_is_excise():
    assert PLAN.demote("b").chains == PLAN.excise("b").chains
    assert PLAN.demote("b", open_tails={"d"}).chains == PLAN.excise("b").chains  # its own tail
    assert PLAN.demote("f", open_tails={"d", "g"}).chains == PLAN.excise("f").chains  # a tail
    assert PLAN.demote("nobody", open_tails={"g"}) is PLAN


@st.composite
def fleets(draw):
    n = draw(st.integers(0, 30))
    ids = [f"w{i:02d}" for i in range(n)]
    ps = [PeerInfo(worker_id=w, score=draw(st.floats(0, 100)), inbound=draw(st.booleans())) for w in ids]
    return ps, draw(st.integers(1, 10)), draw(st.permutations(ids))


@settings(max_examples=200)
@given(fleets())
def test_plans_partition_the_fleet_and_keep_inbound_less_workers_at_tails(fleet):
    ps, n_ch, failure_order = fleet
    inbound = {p.worker_id: p.inbound for p in ps}
    plan = bp.build_chains(ps, n_ch)
    assert sorted(plan.workers()) == sorted(inbound)
    n_in = sum(inbound.values())
    n_relay_chains = min(n_ch, n_in)
    assert len(plan.chains) == n_relay_chains + max(0, len(ps) - n_in - n_relay_chains)
    lengths = [len(c) for c in plan.chains[:n_relay_chains]]
    if lengths:
        assert max(lengths) - min(lengths) <= 1  # round robin keeps relay chains balanced
    for step in range(len(failure_order) + 1):
        for w in plan.workers():
            if not inbound[w]:
                assert plan.child_of(w) is None
        if step < len(failure_order):
            before = plan.workers()
            plan = plan.excise(failure_order[step])
            assert plan.workers() == tuple(w for w in before if w != failure_order[step])
    assert plan.chains == ()
