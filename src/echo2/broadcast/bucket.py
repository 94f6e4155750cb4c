"""Token-bucket rate limiter that caps the bytes/s of one link (learner uplink B0 or worker Bw).

Caps the learner's uplink and each of its streams (coordinator/server.py) and each worker's relay
upload and snapshot download (relay.py, rollout/broadcast_client.py); the benchmarks' in-process bandwidth caps are
these buckets too. One instance may be shared by several concurrent transfers: they then share its
rate. The bucket starts full; its
burst (default: 50 ms of traffic, at least 64 KiB) bounds how far a transfer can run ahead of
the rate. `delay_for` and `take` are plain arithmetic on the injected clock, so the behaviour is
unit-testable without sleeping.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

MIN_BURST = 64 * 1024


class TokenBucket:
    def __init__(
        self,
        rate_bytes_per_s: float | None,
        burst_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """`rate_bytes_per_s` None means unlimited."""
        if rate_bytes_per_s is not None and rate_bytes_per_s <= 0:
            raise ValueError("rate_bytes_per_s must be positive (or None for unlimited)")
        if burst_bytes is not None and burst_bytes <= 0:
            raise ValueError("burst_bytes must be positive")
        self.rate = rate_bytes_per_s
        self.burst = float(burst_bytes or max(MIN_BURST, (rate_bytes_per_s or 0) * 0.05))
        self._clock = clock
        self._sleep = sleep
        self._tokens = self.burst
        self._last = clock()
        self._lock = asyncio.Lock()

    def _available(self, now: float) -> float:
        assert self.rate is not None
        return min(self.burst, self._tokens + max(0.0, now - self._last) * self.rate)

    def delay_for(self, n: float, now: float) -> float:
        """Seconds from `now` until `n` (<= burst) bytes of budget are available; 0 if they are."""
        if self.rate is None:
            return 0.0
        if n > self.burst:
            raise ValueError(f"{n} bytes exceed the burst of {self.burst:.0f}; consume them in pieces")
        deficit = n - self._available(now)
        return deficit / self.rate if deficit >= 1.0 else 0.0  # under a byte: float rounding

    def take(self, n: float, now: float) -> None:
        """Spend `n` bytes of budget at `now` (after `delay_for(n, now)` returned 0)."""
        if self.rate is None:
            return
        self._tokens = self._available(now) - n
        self._last = max(self._last, now)

    async def consume(self, n: int) -> None:
        """Wait until `n` bytes may be sent, then spend them. A request larger than the burst is
        taken in burst-sized pieces, releasing the lock between pieces so that concurrent
        transfers sharing the bucket interleave fairly (asyncio.Lock wakes waiters in order)."""
        if self.rate is None:
            return
        left = float(n)
        while left > 0:
            piece = min(left, self.burst)
            async with self._lock:
                while (delay := self.delay_for(piece, self._clock())) > 0:
                    await self._sleep(delay)
                self.take(piece, self._clock())
            left -= piece
