"""What the scheduler needs from a provider: offers it can start, and start/stop by name.

A provider turns the scheduler's decisions into running or stopped workers. The `local` provider
(rollout/local_fleet.py) starts worker processes on this machine; a cloud provider would rent
machines. Workers a provider starts register under their offer's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True, kw_only=True)
class Offer:
    """A worker the provider can start: its name, its expected throughput (trajectories/s) and its
    price (USD/hour)."""

    name: str
    throughput: float
    price: float

    @property
    def rho(self) -> float:
        return self.price / self.throughput if self.throughput > 0 else float("inf")


class Provider(Protocol):
    def offers(self) -> list[Offer]:
        """Workers that can be started now."""
        ...

    def running(self) -> list[Offer]:
        """Workers started (perhaps not registered yet)."""
        ...

    def owns(self, name: str) -> bool: ...

    def start_slot(self, name: str) -> None: ...

    def stop_slot(self, name: str, *, failed: bool = False) -> None:
        """Stop it; `failed` ones are never offered again."""
        ...
