"""What the scheduler needs from a provider: offers it can start, and start/stop by name.

A provider turns the scheduler's decisions into running or stopped workers. The `local` provider
(rollout/local_fleet.py) starts worker processes on this machine; a cloud provider would rent
machines. Workers a provider starts register under their offer's name.
"""

from __future__ import annotations

from typing import Protocol

from echo2.control.selection import WorkerOffer


class Provider(Protocol):
    def offers(self) -> list[WorkerOffer]:
        """Workers that can be started now."""
        ...

    def running(self) -> list[WorkerOffer]:
        """Workers started (perhaps not registered yet)."""
        ...

    def owns(self, name: str) -> bool: ...

    def start_slot(self, name: str) -> None: ...

    def stop_slot(self, name: str, *, failed: bool = False) -> None:
        """Stop it; `failed` ones are never offered again."""
        ...
