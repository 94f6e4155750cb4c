"""Lease sizing from a worker's throughput and the lease timeout, and the delivered rate the
coordinator measures a worker by (coordinator/leases.py), with hand-computed numbers; then the façade:
a worker that declares too high a rate is sized, and ranked, by what it delivers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import FakeClock, make_state

from echo2.coordinator.lease_sizing import LEASE_SAFETY, SPELLS, Delivery, lease_deadline, lease_groups
from echo2.records import Trajectory


def groups(mu, *, pool=None, step=128, size=16, timeout=300.0, cap=128):
    return lease_groups(
        throughput=mu,
        pool_throughput=mu if pool is None else pool,
        groups_per_step=step,
        group_size=size,
        lease_timeout=timeout,
        cap=cap,
    )


# ---------------------------------------------------------------------- lease_groups
def test_a_worker_measured_at_zero_gets_one_group_and_one_without_a_figure_the_cap():
    assert groups(0.0) == 1
    assert groups(None, cap=5) == 5


def test_the_timeout_bounds_a_lease():
    # 2 traj/s, groups of 4, 4 s timeout: 0.5 * 4 s * 2/s = 4 trajectories = 1 group (a whole
    # step's 4 groups would take 8 s, twice the timeout)
    assert groups(2.0, step=4, size=4, timeout=4.0, cap=4) == 1
    # 1 traj/s, groups of 16, 300 s: 150 trajectories in half the timeout = 9 groups (9.375)
    assert groups(1.0, size=16, timeout=300.0) == 9


def test_a_worker_slower_than_one_group_per_half_timeout_still_gets_one():
    # the README's pool: 0.0125 traj/s, groups of 4: 0.5 * 300 * 0.0125 = 1.875 trajectories
    assert groups(0.0125, step=2, size=4, timeout=300.0, cap=2) == 1
    # the paper's scale, groups of 16: one group is 1280 s
    assert groups(0.0125, size=16) == 1


def test_a_steps_batch_is_split_across_the_pool_by_throughput():
    # pool 0.1 + 0.2 + 0.3 = 0.6 traj/s, a step of 6 groups, fast enough for the timeout:
    # shares 1, 2, 3 (a pool summed in floating point does not round 2 up to 3)
    pool = 0.1 + 0.2 + 0.3
    got = [groups(mu, pool=pool, step=6, size=1, timeout=1e6, cap=6) for mu in (0.1, 0.2, 0.3)]
    assert got == [1, 2, 3]
    # uneven shares round up: 10 groups over 3 equal workers -> 4 each (3.33)
    assert groups(1.0, pool=3.0, step=10, size=1, timeout=1e6, cap=10) == 4
    # alone (or in a pool summed before it joined), a worker's share is the whole step
    assert groups(5.0, pool=0.0, step=8, size=1, timeout=1e6, cap=8) == 8


def test_the_cap_bounds_a_lease():
    # 100 traj/s, groups of 4, 300 s: 3750 groups would fit; a whole step of 128 is more than
    # the configured cap of 8
    assert groups(100.0, size=4, cap=8) == 8
    assert groups(100.0, size=4) == 128


@given(
    mu=st.floats(1e-3, 1e3),
    share=st.floats(1e-3, 1.0),
    step=st.integers(1, 512),
    size=st.integers(1, 64),
    timeout=st.floats(1.0, 3600.0),
    cap=st.integers(1, 1024),
)
def test_a_lease_of_more_than_one_group_fits_in_half_the_timeout(mu, share, step, size, timeout, cap):
    n = groups(mu, pool=mu / share, step=step, size=size, timeout=timeout, cap=cap)
    assert 1 <= n <= min(cap, step)
    if n > 1:
        assert n * size / mu <= LEASE_SAFETY * timeout * (1 + 1e-9)
    deadline = lease_deadline(groups=n, throughput=mu, group_size=size, lease_timeout=timeout)
    assert deadline >= timeout and n * size / mu <= LEASE_SAFETY * deadline * (1 + 1e-9)


# ---------------------------------------------------------------------- lease_deadline
def test_the_deadline_is_the_timeout_unless_one_lease_takes_longer_than_half_of_it():
    assert lease_deadline(groups=1, throughput=None, group_size=4, lease_timeout=300.0) == 300.0
    assert lease_deadline(groups=9, throughput=1.0, group_size=16, lease_timeout=300.0) == 300.0
    # 0.0125 traj/s, 1 group of 4: 320 s expected, twice that before it is reissued
    assert lease_deadline(groups=1, throughput=0.0125, group_size=4, lease_timeout=300.0) == 640.0
    # exactly half the timeout: the timeout
    assert lease_deadline(groups=1, throughput=2.0, group_size=4, lease_timeout=4.0) == 4.0


# ---------------------------------------------------------------------- Delivery
def test_delivered_rate_is_records_per_second_of_lease_time():
    d = Delivery()
    assert d.rate is None
    d.opened(0.0)
    d.accepted(8)
    d.closed(4.0)
    assert d.rate == 2.0
    d.opened(10.0)  # idle time between leases (6 s) does not count
    d.opened(11.0)  # two leases at once: one spell, 10..15
    d.accepted(4)
    d.closed(13.0)
    d.accepted(4)
    d.closed(15.0)
    assert d.rate == pytest.approx((8 + 8) / (4 + 5))


def test_a_lease_given_back_voids_its_spell_and_an_expired_one_counts():
    d = Delivery()
    d.opened(0.0)
    d.accepted(4)
    d.closed(2.0)
    d.opened(5.0)
    d.accepted(2)
    d.closed(None)  # returned, released or stale: time cut short
    assert d.rate == 2.0
    d.opened(10.0)
    d.closed(40.0)  # expired with nothing delivered
    assert d.rate == pytest.approx(4 / 32)


def test_the_delivered_rate_follows_the_last_spells():
    d = Delivery()
    for i in range(SPELLS):  # 1 traj/s
        d.opened(10.0 * i)
        d.accepted(1)
        d.closed(10.0 * i + 1)
    for i in range(SPELLS, 2 * SPELLS):  # then 3 traj/s
        d.opened(10.0 * i)
        d.accepted(3)
        d.closed(10.0 * i + 1)
    assert d.rate == 3.0


# ---------------------------------------------------------------------- the façade
def records(lease, *, n: int = 2) -> list[Trajectory]:
    return [
        Trajectory(
            group_id=f"g{i}",
            prompt_ids=(1, 2),
            response_ids=(3, 4),
            behaviour_logprobs=(-0.1, -0.1),
            loss_mask=(1, 1),
            reward=1.0,
            version=0,
            record_id=f"{lease.lease_id}-{i}-{k}",
        )
        for i in lease.indices
        for k in range(n)
    ]


def test_a_worker_that_declares_too_much_is_sized_by_what_it_delivers():
    """Declared 100 traj/s, delivers 1: its first lease is sized from the claim (capped by a step),
    every later one, and its standing with the scheduler, from the delivered rate."""
    clock = FakeClock()
    state = make_state(clock, groups_per_lease=8, groups_per_step=8)  # lease timeout 30 s, groups of 2
    state.publisher.publish(0, b"v0", keep=2)
    wid = state.register(
        name="liar", hardware="x", price_per_hour=1.0, inbound=False, throughput=100.0
    ).worker_id
    first = state.intake.lease(wid, version=0, max_groups=8)
    assert len(first.indices) == 8, "0.5 * 30 s * 100/s = 750 groups fit; a step is 8"
    clock.now += 16.0
    state.intake.ingest(wid, first.lease_id, records(first))  # 16 records in 16 s
    info = state.registry.workers[wid]
    assert state.intake.throughput(info, clock.now) == 1.0
    row = next(r for r in state.status()["workers"] if r["worker_id"] == wid)
    assert row["delivered"] == 1.0
    second = state.intake.lease(wid, version=0, max_groups=8)
    assert len(second.indices) == 7, "0.5 * 30 s * 1/s = 15 trajectories = 7 groups of 2"
    assert second.deadline == clock.now + 30.0
    # it then goes quiet on its lease (heartbeating): the lease expires, counted, and it is sized
    # by its lower rate: 16 records in 16 + 30 s
    clock.now += 31.0
    state.heartbeat(wid, version=0, throughput=100.0)
    state.expire()
    assert state.intake.ingestion.expired == 1 and state.intake.ingestion.reissued == 7
    assert state.intake.throughput(info, clock.now) == pytest.approx(16 / 47)
    third = state.intake.lease(wid, version=0, max_groups=8)
    assert len(third.indices) == math.floor(0.5 * 30 * 16 / 47 / 2) == 2


def test_a_lone_workers_share_is_the_whole_step_however_its_rate_moved():
    """Measured at 100 traj/s by an expiry round, then delivering 4: it is the whole pool, so its
    share is the step (8 groups), not 8 * 4/100 -> 1. Before, the round's pool figure was set
    against today's rate, and under load a lone worker's leases split a step by timing
    (tests/e2e/test_workers.py::test_one_worker_with_s0_matches_the_in_process_loop then sampled
    with other seeds than the in-process loop)."""
    clock = FakeClock()
    state = make_state(clock, groups_per_lease=8, groups_per_step=8)  # lease timeout 30 s, groups of 2
    state.publisher.publish(0, b"v0", keep=2)
    wid = state.register(name="w", hardware="x", price_per_hour=1.0, inbound=False, throughput=100.0).worker_id
    state.expire()  # the round measures the pool: 100 traj/s
    assert state.intake.pool_throughput == 100.0
    first = state.intake.lease(wid, version=0, max_groups=8)
    assert len(first.indices) == 8
    clock.now += 4.0
    state.intake.ingest(wid, first.lease_id, records(first))  # 16 records in 4 s: 4 traj/s
    assert state.intake.throughput(state.registry.workers[wid], clock.now) == 4.0
    second = state.intake.lease(wid, version=0, max_groups=8)
    assert len(second.indices) == 8, "its share of a pool of one is the whole step"
    # beside a second worker of the round's 100 traj/s, its share is 8 * 4 / 104 -> 1
    other = state.register(name="o", hardware="x", price_per_hour=1.0, inbound=False, throughput=100.0)
    state.heartbeat(wid, version=0, throughput=100.0)
    state.expire()
    assert state.intake.pool_with(wid, 4.0) == pytest.approx(104.0)
    assert other.worker_id in state.intake.pool_figures


def test_a_slow_workers_single_group_gets_a_deadline_it_can_meet():
    clock = FakeClock()
    state = make_state(clock)  # lease timeout 30 s, groups of 2
    state.publisher.publish(0, b"v0", keep=2)
    wid = state.register(
        name="slow", hardware="x", price_per_hour=1.0, inbound=False, throughput=0.05
    ).worker_id
    lease = state.intake.lease(wid, version=0, max_groups=4)
    assert len(lease.indices) == 1 and lease.deadline == clock.now + 80.0  # 2 / 0.05 = 40 s, doubled
    clock.now += 41.0
    state.heartbeat(wid, version=0, throughput=0.05)
    state.expire()
    assert state.intake.ingestion.leases, "not reissued while it can still finish"
    state.intake.ingest(wid, lease.lease_id, records(lease))
    assert state.intake.ingestion.reissued == 0 and state.intake.ingestion.expired == 0
