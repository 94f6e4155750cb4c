from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2.control.selection import WorkerOffer, exact, greedy

POOL = [
    WorkerOffer(name="cheap-slow", count=4, throughput=1.0, price=0.30),  # rho 0.30
    WorkerOffer(name="fast", count=2, throughput=3.0, price=0.75),  # rho 0.25
]


def test_greedy_activates_by_unit_cost():
    sel = greedy(POOL, target=4.0)
    assert sel.active == {"fast": 2, "cheap-slow": 0}
    assert sel.throughput == 6.0 and sel.cost_per_hour == pytest.approx(1.5) and sel.feasible


def test_exact_beats_greedy_when_rounding_hurts():
    # target 4: greedy takes both fast (6.0/s, $1.50); exact takes one fast + one slow (4.0/s, $1.05)
    sel = exact(POOL, target=4.0)
    assert sel.active == {"cheap-slow": 1, "fast": 1}
    assert sel.cost_per_hour == pytest.approx(1.05) and sel.throughput == 4.0


def test_infeasible_pool_activates_everything():
    for policy in (greedy, exact):
        sel = policy(POOL, target=100.0)
        assert not sel.feasible and sel.active == {"cheap-slow": 4, "fast": 2}


worker_types = st.lists(
    st.builds(
        lambda i, count, mu, price: WorkerOffer(name=f"t{i}", count=count, throughput=mu, price=price),
        st.integers(0, 10**6),
        st.integers(1, 6),
        st.floats(0.1, 20, allow_nan=False),
        st.floats(0.05, 5, allow_nan=False),
    ),
    min_size=1,
    max_size=5,
    unique_by=lambda t: t.name,
)


@settings(max_examples=150, deadline=None)
@given(pool=worker_types, share=st.floats(0.01, 1.2))
def test_exact_meets_the_target_and_never_costs_more_than_greedy(pool, share):
    target = share * sum(t.throughput * t.count for t in pool)
    ex, gr = exact(pool, target), greedy(pool, target)
    assert all(0 <= ex.active[t.name] <= t.count for t in pool)
    if sum(t.throughput * t.count for t in pool) >= target:
        assert ex.feasible and ex.throughput >= target * (1 - 1e-9)
        assert ex.cost_per_hour <= gr.cost_per_hour + 1e-9
    else:
        assert not ex.feasible and not gr.feasible
