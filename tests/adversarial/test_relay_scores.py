"""Issue 22 case 5: who relays to whom cannot be bought.

At 97ea5ef ties among new relays went to the lower worker id, so re-registering until the id sorted
first made one worker the victim's parent in 11 of 11 versions; and two workers confirming each
other's invented transfers reached score 99.9 and moved the bandwidth estimate to 80,966 Mbit/s.
These drive the coordinator's broadcast bookkeeping (broadcast/tracker.py) directly, as the
coordinator would, with the reports both sides send.
"""

from __future__ import annotations

import random
import statistics

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.broadcast.blob import make_blob
from echo2.broadcast.plan import NEUTRAL_SCORE
from echo2.broadcast.tracker import BroadcastPolicy, BroadcastState, Peer

KEY = Ed25519PrivateKey.generate()
MB = 1e6
R = 12.5 * MB
"""Every honest link's rate (100 Mbit/s)."""
SIZE = 4_000_000


def fleet(*ids: str) -> dict[str, Peer]:
    return {w: Peer(worker_id=w, relay_url=f"http://{w}:1", registered_at=0.0) for w in ids}


def test_re_registering_for_a_low_id_does_not_make_a_worker_the_victims_parent():
    """The attacker keeps, of 20 registrations per version, the identity that sorts first (what
    won every tie before); the victim's id sorts first among the honest. One chain, all newcomers:
    by chance the attacker precedes the victim in 1 of 9 versions."""
    honest = [f"w{i}" for i in range(7)]
    st = BroadcastState(BroadcastPolicy(mode="chain", uplink_budget_bps=R, worker_bps=R))
    rng = random.Random(0)
    versions, hits = 300, 0
    for v in range(versions):
        attacker = min(f"{rng.getrandbits(32):08x}"[:1] + f"-{rng.getrandbits(32):08x}" for _ in range(20))
        attacker = "0" + attacker  # sorts before every honest id, the victim's included
        live = fleet("a-victim", *honest, attacker)
        st.publish(make_blob(v, bytes([v % 256]) * 64, 16, KEY), live, float(v), keep=2)
        hits += st.plans[v].parent_of("a-victim") == attacker
    chance = versions / 9
    assert hits < 2 * chance, f"the attacker was the victim's parent in {hits} of {versions} versions"


def test_a_newcomer_ranks_below_an_established_relay_however_often_it_registers():
    st = BroadcastState(BroadcastPolicy(mode="chain", uplink_budget_bps=R, worker_bps=R))
    live = fleet("old", "new")
    st.publish(make_blob(0, b"x" * 64, 16, KEY), live, 0.0, keep=2)
    # "old" relayed one transfer both sides confirmed, at a tenth of the rate (score about 50 < 55)
    for w in ("old", "new"):
        st.route(w, 0, live, now=0.0)
    parent = st.plans[0].parent_of("new") or st.plans[0].parent_of("old")
    child = "new" if parent == "old" else "old"
    st.sent(None, 0, parent, 64, 64 / R, now=0.5)  # the parent's own receipt, from the learner
    st.installed(parent, 0, st.snapshots[0].sha256, [(None, 64, 64 / R)], live, now=0.5)
    st.sent(parent, 0, child, 64, 64 / (R / 10), now=1.0)
    st.installed(child, 0, st.snapshots[0].sha256, [(parent, 64, 64 / (R / 10))], live, now=1.0)
    assert st.stats[parent].successes == 1
    for v in range(1, 40):  # the other re-registers under a fresh id for every version
        fresh = f"new{v}"
        live = fleet(parent, fresh)
        st.publish(make_blob(v, b"y" * 64, 16, KEY), live, float(v), keep=2)
        assert st.plans[v].chains[0][0] == parent, "a proven relay stays above every newcomer"


def simulate(*, collude: bool, noise: float, versions: int = 60, seed: int = 1) -> BroadcastState:
    """Six honest workers and two colluders, two chains of four. Honest links run at R (times
    1 +- `noise`); colluding, the pair confirm each other's invented 1 ms transfers whenever one is
    routed to the other (and claim them when not), confirm no honest parent's transfer, and bring
    10 sybils per version that confirm invented transfers from whichever colluder feeds them."""
    rng = random.Random(seed)
    honest = [f"h{i}" for i in range(6)]
    colluders = ("c0", "c1")
    live = fleet(*honest, *colluders)
    st = BroadcastState(BroadcastPolicy(mode="chain", uplink_budget_bps=2 * R, worker_bps=R), seed=seed)
    t = 0.0
    for v in range(versions):
        blob = make_blob(v, bytes([v % 256]) * SIZE, 10**6, KEY)
        st.publish(blob, live, t, keep=2)
        for receiver in sorted(live):
            parent, _ = st.route(receiver, v, live, now=t)
            fake = collude and parent in colluders and receiver in colluders
            honest_secs = SIZE / (R * (1 + rng.uniform(-noise, noise)))  # drawn alike in both runs
            secs = 1e-3 if fake else honest_secs
            if not (collude and receiver in colluders and parent not in colluders):
                st.installed(receiver, v, blob.sha256, [(parent, SIZE, secs)], live, now=t + secs)
            st.sent(parent, v, receiver, SIZE, secs, now=t + secs)
        if collude:  # sybils join late (attached behind open tails) and confirm a colluding parent
            for k in range(10):
                sybil = f"s{v}-{k}"
                now_live = {**live, **fleet(sybil)}
                parent, _ = st.route(sybil, v, now_live, now=t)
                if parent in colluders:
                    st.sent(parent, v, sybil, SIZE, 1e-3, now=t + 1e-3)
                    st.installed(sybil, v, blob.sha256, [(parent, SIZE, 1e-3)], now_live, now=t + 1e-3)
            for a, b in (colluders, colluders[::-1]):  # and unrouted claims of each other
                st.sent(a, v, b, SIZE, 1e-3, now=t + 1e-3)
                st.installed(b, v, blob.sha256, [(a, SIZE, 1e-3)], live, now=t + 1e-3)
        t += 10.0
    return st


def records(st: BroadcastState) -> dict[str, float]:
    """Each relay's score as of its last transfer: its record, without the idle decay (which only
    says how long ago the plan last gave it a child)."""
    ref = st.reference_bps()
    return {w: s.score(s.last_update, ref) for w, s in st.stats.items()}


def test_colluders_inventing_transfers_cannot_outrank_an_honest_relay():
    """A colluder that never confirms an honest parent's transfer has no credited receipt, so
    nothing it forwards is credited: it keeps a newcomer's score (what the plan gives it)."""
    scores = records(simulate(collude=True, noise=0.0))
    honest = [v for w, v in scores.items() if w.startswith("h")]
    colluding = [scores.get(w, NEUTRAL_SCORE) for w in ("c0", "c1")]
    assert honest
    assert max(colluding) <= min(honest), scores
    scores = records(simulate(collude=True, noise=0.05))
    assert max(scores.get(w, NEUTRAL_SCORE) for w in ("c0", "c1")) <= max(
        v for w, v in scores.items() if w.startswith("h")
    ), scores


def test_colluders_move_the_bandwidth_estimate_by_at_most_10_percent():
    for noise in (0.0, 0.05):  # at +-20% link noise a 20-sample median wanders about as much itself
        honest, attacked = simulate(collude=False, noise=noise), simulate(collude=True, noise=noise)
        for figure in ("bw_hat", "reference_bps"):
            base, moved = getattr(honest, figure)(), getattr(attacked, figure)()
            assert abs(moved - base) <= 0.10 * base, (noise, figure, base / MB, moved / MB)


# ---------------------------------------------------------------------------- the issue's pair
def pair(
    *, collude: bool, noise: float, versions: int = 60, seed: int = 1, sybils: int = 0
) -> BroadcastState:
    """The issue's attack: colluders c0 and c1 beside one honest relay h0, one chain (B0 = Bw), so
    each version's plan routes the pair to each other unless h0 sits between them. Whenever one is
    routed to the other, both report (install report and sender's account) an invented transfer of
    1,000 snapshots' bytes in 1 ms; unrouted, they claim one anyway. Every other transfer (their
    own from or to h0 included) is reported as it happened, at R (times 1 +- `noise`). At 97ea5ef
    the invented transfers went into the peers' rate as claimed (4e9 B/s after the ledger's bound
    to the snapshot's size), so half its samples were theirs: its median went from 100 to about
    16,000 Mbit/s and the honest relay's Speed against it fell to about 36. With `sybils`, that
    many fresh identities of theirs join late in every version (each attached behind the chain's
    tail, so mostly behind one another) and confirm an invented transfer from a colluding parent
    (an honest parent's, as it happened)."""
    rng = random.Random(seed)
    colluders = ("c0", "c1")
    live = fleet("h0", *colluders)
    st = BroadcastState(BroadcastPolicy(mode="chain", uplink_budget_bps=R, worker_bps=R), seed=seed)
    t, st.invented = 0.0, 0
    for v in range(versions):
        blob = make_blob(v, bytes([v % 256]) * SIZE, 10**6, KEY)
        st.publish(blob, live, t, keep=2)
        for receiver in sorted(live):
            parent, _ = st.route(receiver, v, live, now=t)
            honest_secs = SIZE / (R * (1 + rng.uniform(-noise, noise)))  # drawn alike in both runs
            if collude and parent in colluders and receiver in colluders:
                st.invented += 1
                nbytes, secs = 1000 * SIZE, 1e-3
            else:
                nbytes, secs = SIZE, honest_secs
            st.installed(receiver, v, blob.sha256, [(parent, nbytes, secs)], live, now=t + secs)
            st.sent(parent, v, receiver, nbytes, secs, now=t + secs)
        if collude:
            for a, b in (colluders, colluders[::-1]):  # unrouted claims of each other (refused)
                st.sent(a, v, b, 1000 * SIZE, 1e-3, now=t + 1e-3)
                st.installed(b, v, blob.sha256, [(a, 1000 * SIZE, 1e-3)], live, now=t + 1e-3)
            now_live = dict(live)
            for k in range(sybils):
                sybil = f"s{v}-{k}"
                now_live |= fleet(sybil)
                parent, _ = st.route(sybil, v, now_live, now=t)
                honest_secs = SIZE / (R * (1 + rng.uniform(-noise, noise)))
                if parent is not None and parent != "h0":
                    st.invented += 1
                    nbytes, secs = 1000 * SIZE, 1e-3
                else:
                    nbytes, secs = SIZE, honest_secs
                st.installed(sybil, v, blob.sha256, [(parent, nbytes, secs)], now_live, now=t + secs)
                st.sent(parent, v, sybil, nbytes, secs, now=t + secs)
        t += 10.0
    return st


def test_the_pair_is_routed_to_each_other_so_their_claims_are_credited():
    """The attack is not refused at the door: in many versions the plan routes one colluder to
    the other, and those invented transfers are credited (only their weight is bounded)."""
    st = pair(collude=True, noise=0.0)
    assert st.invented >= 60 // 4, st.invented
    assert st.ledger.outcomes["credited"] == 60 * 3 and not st.ledger.outcomes["disputed"], st.ledger.outcomes


@pytest.mark.parametrize("noise", [0.0, 0.05, 0.2])
def test_the_pair_inventing_transfers_cannot_outrank_the_honest_relay(noise: float):
    """Was a strict xfail at +-5% noise (colluder 99.58, h0 99.38: the pair's samples, clipped to
    2x, lifted the peers' rate so h0's Speed fell below 100 while the colluder's was capped at
    100). Now a relay is credited at most at the rate of its own credited receipt, so the pair's
    samples are copies of the learner's or h0's, and Speed is 100 for a median rate at the
    peers' lower quartile: the pair ties h0 at best."""
    scores = records(pair(collude=True, noise=noise))
    colluding = [scores[w] for w in ("c0", "c1") if w in scores]
    assert "h0" in scores and colluding, scores
    assert max(colluding) <= scores["h0"], scores


@pytest.mark.parametrize("noise", [0.0, 0.05, 0.2])
def test_the_pair_moves_the_peers_rate_and_bw_hat_by_at_most_10_percent(noise: float):
    honest, attacked = pair(collude=False, noise=noise), pair(collude=True, noise=noise)
    for figure in ("bw_hat", "reference_bps"):
        base, moved = getattr(honest, figure)(), getattr(attacked, figure)()
        assert abs(moved - base) <= 0.10 * base, (noise, figure, base * 8 / MB, moved * 8 / MB)


def mbps(bytes_per_s: float) -> float:
    return round(bytes_per_s * 8 / 1e6, 1)


def test_the_issues_colluding_pair_reaches_no_top_score_and_no_huge_rate():
    """The attack as issue 22 reports it: two colluders confirm each other's invented transfers
    (1,000 snapshots' bytes in 1 ms, sender's account and install report alike) beside an honest
    relay, at +-5% link noise, with 4 fresh identities of theirs per version doing the same behind
    them. Seen in the issue at 97ea5ef: the pair at score 99.9, the peers' rate at 81,824 and Bw_hat
    at 80,966 Mbit/s (honest links: 100). Here: no colluding identity above the honest relay; the
    peers' rate, the Speed reference and Bw_hat within 10% of the run without the attack."""
    honest, attacked = pair(collude=False, noise=0.05), pair(collude=True, noise=0.05, sybils=4)
    all_scores = records(attacked)
    scores = {w: round(v, 2) for w, v in sorted(all_scores.items()) if not w.startswith("s")}
    scores["sybils_max"] = round(max((v for w, v in all_scores.items() if w.startswith("s")), default=0.0), 2)
    seen = {
        "scores": scores,
        "invented": attacked.invented,
        "peer_rate_mbps": (
            mbps(statistics.median(honest.credits.relay_rates)),
            mbps(statistics.median(attacked.credits.relay_rates)),
        ),
        "bw_hat_mbps": (mbps(honest.bw_hat()), mbps(attacked.bw_hat())),
        "speed_reference_mbps": (mbps(honest.reference_bps()), mbps(attacked.reference_bps())),
    }
    print(seen)
    assert attacked.invented >= 15, seen  # the plan did route the pair to each other
    colluding = [scores.get(w, NEUTRAL_SCORE) for w in ("c0", "c1")] + [scores["sybils_max"]]
    assert "h0" in scores and max(colluding) <= scores["h0"], seen
    for base, moved in (seen["peer_rate_mbps"], seen["bw_hat_mbps"], seen["speed_reference_mbps"]):
        assert abs(moved - base) <= 0.10 * base, seen
