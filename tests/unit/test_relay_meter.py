"""The receiver's judgement of a relay's rate (broadcast/meter.py `RelayMeter`): a sliding window of one
progress timeout of reading, against the stall floor and the coordinator's relay floor. The
simulator models the same delay (sim/dissemination.py)."""

from __future__ import annotations

import pytest

from echo2.broadcast.meter import ParentFailed, RelayMeter


def feed(meter: RelayMeter, rate: float, seconds: float, piece_s: float = 0.1) -> float:
    """Pieces of `piece_s` at `rate` bytes/s for `seconds`; the time into them at which it tripped."""
    t = 0.0
    while t < seconds - 1e-9:
        meter.add(int(rate * piece_s), piece_s)
        t += piece_s
    return t


def test_a_relay_that_halves_is_caught_half_a_window_later():
    """From R0 = 100 to R1 = 50 B/s against a floor of 75: W (R0 - F) / (R0 - R1) = 5 s for W = 10."""
    m = RelayMeter(stall_bps=1.0, slow_bps=75.0, window_s=10.0)
    feed(m, 100.0, 30.0)  # healthy: nothing raised
    t = 0.0
    with pytest.raises(ParentFailed) as e:
        while True:
            m.add(5, 0.1)
            t += 0.1
    assert e.value.reason == "slow" and 5.0 - 1e-6 <= t <= 5.2


def test_a_relay_slow_from_the_start_is_judged_after_one_window():
    m = RelayMeter(stall_bps=1.0, slow_bps=75.0, window_s=10.0)
    t = 0.0
    with pytest.raises(ParentFailed) as e:
        while True:
            m.add(1, 0.1)
            t += 0.1
    assert e.value.reason == "slow" and t == pytest.approx(10.0, abs=0.11)


def test_below_the_stall_floor_is_stalled_and_no_floor_never_trips():
    m = RelayMeter(stall_bps=50.0, slow_bps=75.0, window_s=1.0)
    with pytest.raises(ParentFailed) as e:
        feed(m, 10.0, 5.0)
    assert e.value.reason == "stalled"
    feed(RelayMeter(stall_bps=0.0, slow_bps=0.0, window_s=1.0), 1.0, 5.0)  # no floor: nothing raised
