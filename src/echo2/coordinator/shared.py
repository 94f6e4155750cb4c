"""The one lock of the coordinator's state and the facts every part reads under it.

`CoordinatorState` (state.py) makes one `Shared` and hands it to each of its parts (intake.py,
publisher.py), so that they take the same lock, wait on the same condition and read the same clock,
published version and end of run without knowing each other. Knows no HTTP and no part.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from echo2.wire.errors import Invalid, Reason


class Shared:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.lock = threading.RLock()
        self.ready = threading.Condition(self.lock)
        """Notified when groups arrive, a version is published or the run closes."""
        self.published_version = -1
        """The newest version the learner published (-1: none yet); written by the publisher."""
        self.closed = False
        """The run is over: no more leases, the learner's waits end."""

    def check_version(self, version: int) -> None:
        """A worker cannot run a version that was never published."""
        if version > self.published_version:
            raise Invalid(Reason.FUTURE_VERSION, f"version {version} > published {self.published_version}")
