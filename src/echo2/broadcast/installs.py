"""Which version each live worker runs since when, and T_bcast: the time from a version's
publication until a fraction q of the live workers run it (or something newer).

Pure bookkeeping with the caller's clock, no I/O and no lock (the publisher, publisher.py, holds
the state's): `BroadcastState` (broadcast.py) notes publications and installs here and passes the
live workers (`Peer`). A receiver reports the exact moment it runs a version; heartbeats also count
(a version reported there is installed), as an upper bound for workers that do not report. Each
worker counts from the publication, or from its registration if it joined later; a lost worker's
installs are forgotten. Install times are kept for the last `HISTORY` versions, T_bcast for all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

QUANTILES = (0.9, 1.0)
"""T_bcast is reported at q = 0.9 (about 1 / gamma of the workers, the paper's measure) and q = 1."""
HISTORY = 64
"""Versions whose install times are kept (T_bcast values themselves are kept for every version)."""


class Live(Protocol):
    """A live worker (broadcast.py: `Peer`)."""

    @property
    def registered_at(self) -> float: ...


class Installs:
    def __init__(self) -> None:
        self.published_at: dict[int, float] = {}
        self.installed_at: dict[int, dict[str, float]] = {}
        self.noted: dict[str, int] = {}
        """Per worker, the newest version it was noted running (a heartbeat repeating it is O(1))."""
        self.t_bcast: dict[float, dict[int, float]] = {q: {} for q in QUANTILES}
        """q -> version -> seconds until a fraction q of the live workers ran the version."""

    def published(self, version: int, now: float) -> None:
        self.published_at[version] = now
        for old in sorted(self.published_at)[:-HISTORY]:
            del self.published_at[old]
            self.installed_at.pop(old, None)

    def runs(self, worker_id: str, version: int) -> bool:
        """The worker was noted running `version` or a newer one."""
        return self.noted.get(worker_id, -1) >= version

    def note(self, worker_id: str, version: int, now: float) -> list[int] | None:
        """The worker runs `version`: it counts as having every published version up to it, which
        are returned. None (and O(1)) when that was already known, as on every heartbeat between
        installs."""
        if self.runs(worker_id, version):
            return None
        self.noted[worker_id] = version
        counted = [v for v in self.published_at if v <= version]
        for v in counted:
            self.installed_at.setdefault(v, {}).setdefault(worker_id, now)
        return counted

    def forget(self, worker_id: str) -> None:
        """A worker was lost: T_bcast counts live workers only."""
        self.noted.pop(worker_id, None)
        for got in self.installed_at.values():
            got.pop(worker_id, None)

    def update(self, peers: Mapping[str, Live]) -> None:
        """Record T_bcast(q) for versions where a fraction q of the live workers now run them. A
        version's T_bcast(q) is recorded once; until then, the installs counted (an upper bound of
        the live ones) decide in O(1) whether the exact count is worth making."""
        if not peers:
            return
        for v, t0 in self.published_at.items():
            pending = [q for q in QUANTILES if v not in self.t_bcast[q]]
            if not pending:
                continue
            got = self.installed_at.get(v, {})
            if len(got) < math.ceil(min(pending) * len(peers) - 1e-9):
                continue
            delays = sorted(at - max(t0, peers[w].registered_at) for w, at in got.items() if w in peers)
            for q in pending:
                need = math.ceil(q * len(peers) - 1e-9)
                if len(delays) >= need:
                    self.t_bcast[q][v] = delays[need - 1]

    def status(self) -> dict:
        recent = sorted(self.published_at)[-10:]
        return {
            "t_bcast_by_version": {
                str(v): {f"q{q:g}": self.t_bcast[q].get(v) for q in QUANTILES} for v in recent
            },
            "installed_by_version": {str(v): len(self.installed_at.get(v, {})) for v in recent},
        }
