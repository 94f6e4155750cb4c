"""What the scheduler needs from a provider: offers it can start, and start/stop by name.

A provider turns the scheduler's decisions into running or stopped workers. The `local` provider
(fleet/providers/local.py) starts worker processes on this machine; the `skypilot` provider
(fleet/providers/skypilot/provider.py) rents cloud machines, queueing each start and stop for a background thread
that submits SkyPilot requests and polls them. Workers a provider starts register under their
offer's name. The caller (state.py) calls in from the coordinator's thread, outside its lock:
every method returns promptly; a start or stop that takes long (renting a machine) is queued.
"""

from __future__ import annotations

from typing import Protocol

from echo2.fleet.selection import WorkerOffer


class Provider(Protocol):
    def offers(self) -> list[WorkerOffer]:
        """Workers that can be started now."""
        ...

    def running(self) -> list[WorkerOffer]:
        """Workers started (perhaps not registered yet)."""
        ...

    def owns(self, name: str) -> bool:
        """`name` is one of this provider's slots (a worker registering under it is provided)."""
        ...

    def proves(self, name: str, proof: str | None) -> bool:
        """`proof` is the secret the provider put in slot `name`'s environment when it last started
        it (identity.SLOT_SECRET_ENV): only the slot's own worker can register under its name."""
        ...

    def start_slot(self, name: str) -> None:
        """Start an offered slot (or queue its start); it is `running()` from now on."""
        ...

    def stop_slot(self, name: str, *, failed: bool = False) -> None:
        """Stop it; `failed` (the coordinator lost it): the local provider never offers it again,
        the skypilot provider does not offer its type for a while."""
        ...
