from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from echo2.data.buffer import ReplayBuffer
from echo2.records import Trajectory


def rec(group: str, version: int, reward: float = 0.0) -> Trajectory:
    return Trajectory(
        group_id=group,
        prompt_ids=(1, 2),
        response_ids=(3,),
        behaviour_logprobs=(-0.5,),
        loss_mask=(1,),
        reward=reward,
        version=version,
    )


def group(gid: str, version: int, n: int = 2) -> list[Trajectory]:
    return [rec(gid, version) for _ in range(n)]


def test_hands_out_only_whole_groups_oldest_first():
    buf = ReplayBuffer(staleness=1, group_size=2)
    buf.add([rec("a", 0)])
    assert buf.num_ready_groups() == 0 and buf.take(1) == ([], [])
    buf.add(group("b", 0) + [rec("a", 0)])
    groups, staleness = buf.take(5)
    assert [g[0].group_id for g in groups] == ["a", "b"]
    assert all(len(g) == 2 for g in groups) and staleness == [0, 0, 0, 0]
    assert len(buf) == 0


def test_admission_and_eviction_by_staleness_are_counted():
    buf = ReplayBuffer(staleness=1, group_size=2)
    buf.add(group("old", 0))
    buf.set_learner_version(1)
    buf.add(group("v1", 1))
    assert buf.contents_by_version() == {0: 2, 1: 2}
    buf.set_learner_version(2)  # version 0 is now older than v - S = 1
    assert buf.rejected["stale"] == 2 and buf.contents_by_version() == {1: 2}
    assert buf.add(group("late", 0)) == 0
    assert buf.rejected["stale"] == 4
    groups, staleness = buf.take(1)
    assert groups[0][0].group_id == "v1" and staleness == [1, 1]


def test_duplicates_future_versions_and_overflow_are_rejected():
    buf = ReplayBuffer(staleness=0, group_size=2)
    r = rec("a", 0)
    assert buf.add([r, r]) == 1
    assert buf.add([rec("b", 1)]) == 0
    buf.add([rec("a", 0), rec("a", 0)])
    assert buf.rejected == {"duplicate": 1, "future_version": 1, "group_overflow": 1}


def test_state_dict_round_trip():
    buf = ReplayBuffer(staleness=2, group_size=2)
    buf.add(group("a", 0) + [rec("b", 0)])
    buf.set_learner_version(1)
    other = ReplayBuffer(staleness=2, group_size=2)
    other.load_state_dict(buf.state_dict())
    assert other.contents_by_version() == buf.contents_by_version()
    assert other.learner_version == 1 and other.num_ready_groups() == 1


@given(
    staleness=st.integers(0, 3),
    events=st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40),
)
def test_never_hands_out_a_record_older_than_v_minus_s(staleness, events):
    buf = ReplayBuffer(staleness=staleness, group_size=2)
    v = 0
    offered = 0
    for i, (advance, lag) in enumerate(events):
        if advance:
            v += 1
            buf.set_learner_version(v)
        offered += 2
        buf.add(group(f"g{i}", max(0, v - lag)))
        groups, staleness_seen = buf.take(1)
        assert all(r.version >= v - staleness for g in groups for r in g)
        assert all(0 <= s <= staleness for s in staleness_seen)
        offered -= sum(len(g) for g in groups)
    # every record is either buffered or counted as rejected: nothing vanishes silently
    assert len(buf) + sum(buf.rejected.values()) == offered
