"""Token bucket with a fake clock: delay arithmetic, unlimited rate, pieces, sharing."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2.broadcast.bucket import MIN_BURST, TokenBucket

MB = 1_000_000


class FakeTime:
    """A clock that only moves when a consumer sleeps."""

    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    async def sleep(self, d: float) -> None:
        self.sleeps.append(d)
        self.t += d
        await asyncio.sleep(0)


def bucket(rate, burst=None) -> tuple[TokenBucket, FakeTime]:
    ft = FakeTime()
    return TokenBucket(rate, burst, clock=ft, sleep=ft.sleep), ft


def test_delay_arithmetic():
    b, _ = bucket(10 * MB, 1 * MB)
    assert b.delay_for(1 * MB, now=0) == 0.0  # starts full
    b.take(1 * MB, now=0)
    assert b.delay_for(500_000, now=0) == pytest.approx(0.05)
    assert b.delay_for(500_000, now=0.02) == pytest.approx(0.03)
    assert b.delay_for(500_000, now=0.05) == 0.0
    b.take(500_000, now=0.05)
    assert b.delay_for(1 * MB, now=100) == 0.0  # refill is capped at the burst
    b.take(1 * MB, now=100)
    assert b.delay_for(1000, now=100) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="burst"):
        b.delay_for(2 * MB, now=200)


def test_default_burst_and_validation():
    assert TokenBucket(10 * MB).burst == 500_000  # 50 ms of traffic
    assert TokenBucket(100_000).burst == MIN_BURST
    with pytest.raises(ValueError):
        TokenBucket(0)
    with pytest.raises(ValueError):
        TokenBucket(MB, burst_bytes=0)


def test_unlimited_never_waits():
    b, ft = bucket(None)
    assert b.delay_for(10**12, now=0) == 0.0
    asyncio.run(b.consume(10**12))
    assert ft.sleeps == [] and ft.t == 0.0


def test_2_mb_at_10_mb_per_s():
    b, ft = bucket(10 * MB, 500_000)
    asyncio.run(b.consume(2 * MB))
    assert ft.t == pytest.approx(0.15)  # the first 0.5 MB is the full bucket, the rest at rate
    asyncio.run(b.consume(2 * MB))
    assert ft.t == pytest.approx(0.35)  # from empty: 2 MB / 10 MB/s


def test_shared_bucket_splits_the_rate_and_interleaves():
    b, ft = bucket(10 * MB, 500_000)
    done: list[str] = []

    async def transfer(name: str, n: int) -> None:
        await b.consume(n)
        done.append(name)

    async def main() -> None:
        await asyncio.gather(transfer("big", 3 * MB), transfer("small", 500_000))

    asyncio.run(main())
    assert ft.t == pytest.approx((3.5 * MB - 500_000) / (10 * MB))
    assert done == ["small", "big"]  # the big transfer does not hold the bucket for its whole size


@settings(max_examples=50, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 2 * MB), min_size=1, max_size=8),
    rate=st.floats(1e4, 1e9),
    burst=st.integers(10_000, 2 * MB),
)
def test_total_time_is_excess_over_burst_divided_by_rate(sizes, rate, burst):
    b, ft = bucket(rate, burst)

    async def main() -> None:
        for n in sizes:
            await b.consume(n)

    asyncio.run(main())
    expected = max(0.0, (sum(sizes) - burst) / rate)
    pieces = sum(-(-n // burst) for n in sizes)  # each may end up to a byte short (float rounding)
    assert ft.t == pytest.approx(expected, rel=1e-9, abs=pieces / rate)
