"""The learner's broadcast bookkeeping (broadcast/tracker.py): plans, routes, failures, T_bcast and
eviction, driven with explicit times and no network."""

from __future__ import annotations

import hashlib

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.broadcast.blob import make_blob
from echo2.broadcast.chunks import verify_chunk, verify_manifest
from echo2.broadcast.tracker import BroadcastPolicy, BroadcastState, Peer, WrongSnapshot

KEY = Ed25519PrivateKey.generate()
BW = 1e6


def peers(*ids: str, relay: bool = True, at: float = 0.0) -> dict[str, Peer]:
    return {w: Peer(worker_id=w, relay_url=f"http://{w}:1" if relay else None, registered_at=at) for w in ids}


class IdOrder(BroadcastState):
    """Ties broken by worker id, so these tests can name who is planned where."""

    def tie_seed(self, version: int) -> None:
        return None


def state(mode: str = "chain", chains: int = 2) -> BroadcastState:
    return IdOrder(BroadcastPolicy(mode=mode, chunk_size=10, uplink_budget_bps=chains * BW, worker_bps=BW))


def publish(st: BroadcastState, version: int, live: dict[str, Peer], now: float = 0.0, keep: int = 2):
    blob = make_blob(version, bytes([version]) * 35, 10, KEY)
    st.publish(blob, live, now, keep=keep)
    return blob


def test_blob_is_chunked_and_signed_without_copying():
    blob = make_blob(3, b"x" * 35, 10, KEY)
    verify_manifest(blob.manifest, KEY.public_key())
    assert [len(c) for c in blob.chunks] == [10, 10, 10, 5]
    assert all(verify_chunk(blob.manifest, i, c) for i, c in enumerate(blob.chunks))
    assert blob.sha256 == hashlib.sha256(b"x" * 35).hexdigest()


def test_chain_and_star_plans():
    live = peers(*"abcdef")
    st = state("chain", chains=2)
    publish(st, 0, live)
    assert sorted(len(c) for c in st.plans[0].chains) == [3, 3]
    st = state("star")
    publish(st, 0, live)
    assert st.plans[0].chains == tuple((w,) for w in "abcdef")
    assert st.route("c", 0, live) == (None, None)


def test_workers_without_a_relay_are_only_tails():
    live = peers("a", "b") | peers("x", "y", relay=False)
    st = state(chains=2)
    publish(st, 0, live)
    for chain in st.plans[0].chains:
        assert all(live[w].relay_url for w in chain[:-1]), "nobody streams from a worker without a relay"


def test_late_joiner_is_appended_to_the_shortest_open_chain():
    live = peers("a", "b", "c")
    st = state(chains=2)
    publish(st, 0, live)
    live |= peers("z", at=5.0)
    parent, url = st.route("z", 0, live)
    assert parent is not None and url == f"http://{parent}:1"
    chain = next(c for c in st.plans[0].chains if "z" in c)
    assert chain[-1] == "z" and len(chain) == 2


def test_failure_excises_the_parent_and_reattaches_upstream():
    live = peers(*"abcd")
    st = state(chains=1)
    publish(st, 0, live)
    a, b, c, _ = st.plans[0].chains[0]
    assert st.route(c, 0, live) == (b, f"http://{b}:1")
    assert st.failure(c, 0, b, "stalled", live, now=1.0) == (a, f"http://{a}:1")
    assert b not in st.plans[0].workers() and st.stats[b].failures == 1
    assert st.failures == {"stalled": 1}
    # a second report about the same (old) parent only re-routes: no double penalty
    assert st.failure(c, 0, b, "stalled", live, now=1.0) == (a, f"http://{a}:1")
    assert st.stats[b].failures == 1
    # the excised worker still receives, as a tail that gets no child for this version
    st.route(b, 0, live)
    live |= peers("late")
    st.route("late", 0, live)
    assert st.plans[0].parent_of("late") != b


def test_lost_parent_is_routed_around():
    live = peers(*"abc")
    st = state(chains=1)
    publish(st, 0, live)
    a, b, c = st.plans[0].chains[0]
    del live[b]  # lost to heartbeats
    assert st.route(c, 0, live)[0] == a


def test_repeated_failures_drop_a_worker_from_the_relay_role():
    live = peers(*"abcd")
    st = state(chains=1)
    for t in range(4):
        st._stats("a").record_failure(now=float(t))
    publish(st, 0, live, now=5.0)
    assert st.plans[0].chains[0][-1] == "a", "demoted: only a tail"
    st = state(chains=1)
    st._stats("a").record_failure(now=0.0)
    publish(st, 0, live, now=1.0)
    assert st.plans[0].chains[0][0] != "a", "a lower score moves it away from the seed"


def test_bw_hat_follows_transfers_both_sides_reported():
    live = peers(*"abcdef")
    st = state(chains=2)
    blob = make_blob(0, bytes(4_000_000), 10**6, KEY)
    st.publish(blob, live, 0.0, keep=2)
    for w in "ab":
        assert st.route(w, 0, live, now=0.0)[0] is None  # seeds: fed by the learner
        st.installed(w, 0, blob.sha256, [(None, 4_000_000, 1.0)], live, now=1.0)
    assert st.bw_hat() == BW, "the receiver's word alone counts for nothing"
    for w in "ab":
        st.sent(None, 0, w, 4_000_000, 1.0, now=1.0)  # the coordinator's own account
    assert st.bw_hat() == 4e6
    publish(st, 1, live)
    assert len(st.plans[1].chains) == 1, "B0 = 2 MB/s < Bw_hat: one chain"


def test_t_bcast_quantiles_count_live_workers_from_publication_or_registration():
    live = peers(*"abcdefghij")
    st = state(chains=2)
    blob = publish(st, 0, live, now=100.0)
    for i, w in enumerate("abcdefghi"):
        st.installed(w, 0, blob.sha256, [], live, now=101.0 + i)
    assert st.installs.t_bcast[0.9] == {0: 9.0} and st.installs.t_bcast[1.0] == {}
    del live["j"]  # lost before installing: every live worker now runs version 0
    st.installs.update(live)
    assert st.installs.t_bcast[1.0] == {0: 9.0}
    # a worker that registered after the publication counts from its registration
    live = peers("a") | peers("late", at=200.0)
    st = state()
    blob = publish(st, 5, live, now=100.0)
    st.installed("a", 5, blob.sha256, [], live, now=101.0)
    st.note_version("late", 5, now=203.0)  # from a heartbeat
    st.installs.update(live)
    assert st.installs.t_bcast[1.0] == {5: 3.0}


def test_a_newer_install_counts_for_older_versions():
    live = peers("a")
    st = state()
    publish(st, 0, live, now=0.0)
    blob = publish(st, 1, live, now=1.0)
    st.installed("a", 1, blob.sha256, [], live, now=2.0)
    assert st.installs.t_bcast[1.0] == {0: 2.0, 1: 1.0}


def test_wrong_snapshot_is_refused():
    live = peers("a")
    st = state()
    publish(st, 0, live)
    with pytest.raises(WrongSnapshot):
        st.installed("a", 0, "0" * 64, [], live, now=1.0)
    assert st.installs.installed_at == {}


def test_old_versions_are_kept_while_a_live_worker_receives_them():
    live = peers("a", "b")
    st = state()
    publish(st, 0, live, keep=2)
    st.route("a", 0, live)
    publish(st, 1, live, keep=2)
    publish(st, 2, live, keep=2)
    assert sorted(st.snapshots) == [0, 1, 2], "a still receives version 0"
    st.note_version("a", 1, now=1.0)  # it moved on
    st.evict(2, live)
    assert sorted(st.snapshots) == [1, 2]


def test_a_parent_that_no_longer_holds_the_version_is_rerouted_without_penalty():
    live = peers(*"abc")
    st = state(chains=1)
    publish(st, 0, live)
    a, b, c = st.plans[0].chains[0]
    assert st.failure(c, 0, b, "gone", live, now=1.0) == (a, f"http://{a}:1")
    assert b not in st.plans[0].workers(), "it cannot serve this version any more"
    assert b not in st.stats or st.stats[b].failures == 0, "but it did nothing wrong"
    assert st.failures == {"gone": 1}


def deliver(
    st: BroadcastState, version: int, live: dict[str, Peer], blob, *, at: float, seconds: float
) -> None:
    """Every worker routes at `at` and receives the whole blob in `seconds`, both sides reporting."""
    for w in live:
        st.route(w, version, live, now=at)
    for w in live:
        parent = st.plans[version].parent_of(w)
        st.installed(w, version, blob.sha256, [(parent, len(blob.data), seconds)], live, now=at + seconds)
        st.sent(parent, version, w, len(blob.data), seconds, now=at + seconds)


def test_a_slow_relay_is_demoted_its_tail_moved_and_it_sits_out_the_next_plan_as_a_tail():
    live = peers(*"abcdef")
    st = state(chains=2)
    blob0 = make_blob(0, bytes(4_000_000), 10**6, KEY)
    st.publish(blob0, live, 0.0, keep=3)
    assert st.plans[0].chains == (("a", "c", "e"), ("b", "d", "f"))  # all newcomers: by id
    assert st.relay_floor("c", 0, "a") is None, "no relay rate measured yet: no floor"
    deliver(st, 0, live, blob0, at=0.0, seconds=4.0)  # every link at 1 MB/s
    assert list(st.credits.relay_rates) == [1e6] * 4 and st.peer_bps() == 1e6
    assert st.relay_floor("c", 0, "a") == pytest.approx(0.75e6)  # 3/4 of the peers' rate
    assert st.relay_floor("a", 0, None) is None, "the learner has no floor"

    blob1 = make_blob(1, bytes(4_000_000), 10**6, KEY)
    st.publish(blob1, live, 10.0, keep=3)
    x = st.plans[1].chains[0][0]  # a seed with a child, then its child and the other chain
    y = st.plans[1].child_of(x)
    other = st.plans[1].chains[1]
    assert y is not None and st.route(y, 1, live, now=10.0)[0] == x
    assert st.relay_floor(y, 1, x) == pytest.approx(0.75e6)
    # y measures x below the floor and reports it slow: x leaves the plan, y and its tail go
    # behind the other chain's tail (x still takes the learner's stream; no new one is opened)
    parent, url = st.failure(y, 1, x, "slow", live, now=15.0)
    assert (parent, url) == (other[-1], f"http://{other[-1]}:1")
    assert x not in st.plans[1].workers() and st.plans[1].chains[0][: len(other)] == other
    assert st.stats[x].failures == 1 and st.stats[x].demoted and st.failures["slow"] == 1
    assert st.relay_floor(y, 1, parent) is None, "one demotion per receiver and version"
    # a second slow report from y only re-routes it: its new parent is not penalized
    assert st.failure(y, 1, parent, "slow", live, now=16.0) == (parent, url)
    assert parent not in st.stats or st.stats[parent].failures == 0
    assert st.plans[1].parent_of(y) == parent
    # x, still receiving, gets no child for this version (a late joiner goes elsewhere)
    live |= peers("late", at=20.0)
    assert st.route("late", 1, live, now=20.0)[0] != x

    # the next plan: x is only a tail; the plan after it, x may relay again (ranked by its score)
    st.publish(make_blob(2, bytes(10), 10, KEY), live, 30.0, keep=3)
    assert x in st.plans[2].workers() and st.plans[2].child_of(x) is None
    assert not st.stats[x].demoted and st._can_relay(x, live)
    assert st.status({}, now=30.0)["demoted"] == []


def test_no_relay_floor_in_star_mode_or_when_demotion_is_off():
    live = peers(*"abcd")
    for policy in (
        BroadcastPolicy(mode="star", chunk_size=10, worker_bps=BW),
        BroadcastPolicy(
            mode="chain", chunk_size=10, uplink_budget_bps=BW, worker_bps=BW, slow_relay_fraction=0
        ),
    ):
        st = BroadcastState(policy)
        blob = make_blob(0, bytes(4_000_000), 10**6, KEY)
        st.publish(blob, live, 0.0, keep=2)
        deliver(st, 0, live, blob, at=0.0, seconds=4.0)
        w = next(w for w in live if st.plans[0].parent_of(w) is not None) if policy.mode == "chain" else "a"
        assert st.relay_floor(w, 0, "b") is None
