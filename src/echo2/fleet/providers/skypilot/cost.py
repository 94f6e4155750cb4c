"""The bill of the clusters a provider runs: their price per hour integrated over time. Pure: the
caller's clock."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CostMeter:
    """The bill: the price per hour of what is running, integrated over time (USD)."""

    usd: float = 0.0
    _last: float | None = None
    _rate: float = 0.0

    def observe(self, now: float, price_per_hour: float) -> None:
        """From `now` on, `price_per_hour` is billing (the rate before it is charged until now)."""
        if self._last is not None and now > self._last:
            self.usd += self._rate * (now - self._last) / 3600
        self._last, self._rate = now, price_per_hour

    @property
    def price_per_hour(self) -> float:
        return self._rate
