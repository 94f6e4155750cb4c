from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2.planning import capacity as cap


def test_mu_min_hand_computed():
    # kappa = 2, T_train = 10 s, T_bcast = 5 s, R = 30: 2 * 30 / (20 - 5) = 4 trajectories/s
    assert cap.mu_min(kappa=2, t_train=10, t_bcast=5, batch=30) == pytest.approx(4.0)
    assert cap.overlap_holds(kappa=2, t_train=10, t_bcast=5, batch=30, mu_pool=4.0)
    assert not cap.overlap_holds(kappa=2, t_train=10, t_bcast=5, batch=30, mu_pool=3.9)


def test_infeasible_when_broadcast_exceeds_kappa_steps():
    assert cap.mu_min(kappa=1, t_train=10, t_bcast=10, batch=30) is None
    assert cap.mu_min(kappa=1, t_train=10, t_bcast=12, batch=30) is None
    assert cap.smallest_feasible_kappa(t_train=10, t_bcast=12) == 2
    assert cap.smallest_feasible_kappa(t_train=10, t_bcast=20) == 3
    assert cap.mu_min(kappa=3, t_train=10, t_bcast=20, batch=30) == pytest.approx(9.0)


def test_target_throughput_is_gamma_times_mu_min():
    # paper model: mu_min = 4 (above); gamma = 1.25 keeps 25% headroom: 5 trajectories/s
    paper = {"staleness": 3, "model": "paper"}
    assert cap.target_throughput(
        kappa=2, t_train=10, t_bcast=5, batch=30, gamma=1.25, **paper
    ) == pytest.approx(5.0)
    assert cap.target_throughput(
        kappa=3, t_train=10, t_bcast=20, batch=30, gamma=1.0, **paper
    ) == pytest.approx(9.0)
    # no pool can hide a broadcast longer than kappa steps: the target is unreachable, not absent
    assert cap.target_throughput(kappa=1, t_train=10, t_bcast=10, batch=30, gamma=1.0, **paper) == math.inf
    assert cap.target_throughput(kappa=1, t_train=10, t_bcast=12, batch=30, gamma=2.0, **paper) == math.inf
    # continuous (the default): R / T_train = 3, fresh enough: 30 / ((3 - 2 + 1) * 10 - 5) = 2
    assert cap.target_throughput(kappa=2, staleness=3, t_train=10, t_bcast=5, batch=30, gamma=1.25) == (
        pytest.approx(3.75)
    )


def test_mu_min_continuous_hand_computed():
    # S = 3, kappa = 2, T_train 10, R 30: the learner's own pace R / T_train = 3 binds while T_bcast
    # is short; with T_bcast = 15 the staleness bound binds: 30 / (2 * 10 - 15) = 6
    kw = {"kappa": 2, "staleness": 3, "t_train": 10.0, "batch": 30.0}
    assert cap.mu_min_continuous(t_bcast=5.0, **kw) == pytest.approx(3.0)
    assert cap.mu_min_continuous(t_bcast=15.0, **kw) == pytest.approx(6.0)
    # no throughput keeps records fresh (2 * 10 <= 25): the paper model's answer (kappa T <= T_bcast: None)
    assert cap.mu_min_continuous(t_bcast=25.0, **kw) is None
    assert cap.required_throughput("paper", t_bcast=5.0, **kw) == pytest.approx(4.0)


@settings(max_examples=200, deadline=None)
@given(
    s=st.integers(1, 8),
    t_train=st.floats(0.5, 50),
    t_bcast=st.floats(0, 100),
    batch=st.floats(1, 500),
    over=st.floats(1.0001, 3),
)
def test_mu_min_continuous_is_where_the_continuous_bubble_vanishes(s, t_train, t_bcast, batch, over):
    kappa = max(1, s - 1)
    timing = {"kappa": kappa, "t_train": t_train, "t_bcast": t_bcast, "batch": batch}
    mu = cap.mu_min_continuous(staleness=s, **timing)
    if mu is None:
        return
    assert cap.bubble_ratio_continuous(staleness=s, mu_pool=mu * over, **timing) == 0.0
    assert cap.bubble_ratio_continuous(staleness=s, mu_pool=mu / over, **timing) > 0.0


def test_staleness_bounds_hand_computed():
    # conservative: 2 + ceil((5 + 30/4) / 10) - 1 = 2 + ceil(1.25) - 1 = 3
    assert cap.staleness_bound(kappa=2, t_train=10, t_bcast=5, batch=30, mu_pool=4) == 3
    # overlap-tightened: 2 + ceil(0.5 * 5 / 10) = 3; kappa = 1 gives exactly 1
    assert cap.staleness_bound_overlap(kappa=2, t_train=10, t_bcast=5) == 3
    assert cap.staleness_bound_overlap(kappa=1, t_train=10, t_bcast=50) == 1
    assert cap.staleness_bound_overlap(kappa=4, t_train=10, t_bcast=25) == 4 + 2  # ceil(0.75 * 2.5)


def test_bubble_ratio_hand_computed():
    assert cap.bubble_ratio(kappa=2, t_train=10, t_bcast=5, batch=30, mu_pool=4) == 0.0
    # mu = 2: cycle = max(20, 5 + 30) = 35, idle 15
    assert cap.bubble_ratio(kappa=2, t_train=10, t_bcast=5, batch=30, mu_pool=2) == pytest.approx(15 / 35)
    assert cap.bubble_ratio(kappa=2, t_train=10, t_bcast=5, batch=30, mu_pool=0) == 1.0


def test_continuous_bubble_ratio_hand_computed():
    common = dict(kappa=2, t_train=10, t_bcast=5, batch=30)
    # mu = 2.5: a step takes max(10, 30/2.5) = 12 s; bound 2 + ceil((5 + 12) / 12) - 1 = 3 <= S = 3,
    # so throughput alone: 1 - 2.5*10/30
    assert cap.bubble_ratio_continuous(staleness=3, mu_pool=2.5, **common) == pytest.approx(1 / 6)
    # the paper's cycle model charges the broadcast: max(20, 5 + 24) = 29, idle 9
    assert cap.bubble_ratio(mu_pool=2.5, **common) == pytest.approx(9 / 29)
    # enough throughput: no bubble in either model
    assert cap.bubble_ratio_continuous(staleness=3, mu_pool=4, **common) == 0.0
    # S = 2 < bound 3: records would go stale, so the conservative cycle model applies
    assert cap.bubble_ratio_continuous(staleness=2, mu_pool=2.5, **common) == pytest.approx(9 / 29)
    assert cap.bubble_ratio_continuous(staleness=3, mu_pool=0, **common) == 1.0
    # starved learner (mu = 1.5, R/mu = 20 s per step): bound 2 + ceil((5 + 20) / 20) - 1 = 3 <= 3,
    # although with T_train = 10 s in the bound it would be 2 + ceil(2.5) - 1 = 4
    assert cap.bubble_ratio_continuous(staleness=3, mu_pool=1.5, **common) == pytest.approx(0.5)
