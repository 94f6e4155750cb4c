"""Replay buffer indexed by policy version, with bounded-staleness admission.

Owns which trajectories the learner may consume: at learner version v only records with
`version >= v - S` are admitted or handed out; older ones are dropped and counted by reason. It hands
out whole groups (all `group_size` samples of one prompt), oldest first, and reports the staleness
of every record it hands out. Pure bookkeeping: no tensors, no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

from echo2.records import Trajectory


class ReplayBuffer:
    def __init__(self, *, staleness: int, group_size: int) -> None:
        assert staleness >= 0 and group_size >= 1
        self.staleness = staleness
        self.group_size = group_size
        self.learner_version = 0
        self.rejected: Counter[str] = Counter()
        """Records dropped, by reason ("stale", "duplicate", "future_version", "group_overflow")."""
        self._groups: OrderedDict[str, list[Trajectory]] = OrderedDict()  # insertion = age order
        self._seen: set[str] = set()

    # ------------------------------------------------------------------ admission
    def min_version(self) -> int:
        return self.learner_version - self.staleness

    def add(self, records: Iterable[Trajectory]) -> int:
        """Admit records; returns how many were stored. Rejections are counted, never silent."""
        stored = 0
        for rec in records:
            reason = self._reject_reason(rec)
            if reason:
                self.rejected[reason] += 1
                continue
            self._groups.setdefault(rec.group_id, []).append(rec)
            self._seen.add(rec.record_id)
            stored += 1
        return stored

    def _reject_reason(self, rec: Trajectory) -> str | None:
        if rec.record_id in self._seen:
            return "duplicate"
        if rec.version < self.min_version():
            return "stale"
        if rec.version > self.learner_version:
            return "future_version"
        if len(self._groups.get(rec.group_id, ())) >= self.group_size:
            return "group_overflow"
        return None

    def seen(self, record_id: str) -> bool:
        """Whether this record was ever stored (it may since have been handed out)."""
        return record_id in self._seen

    def group_count(self, group_id: str) -> int:
        return len(self._groups.get(group_id, ()))

    def set_learner_version(self, version: int) -> list[str]:
        """Advance the learner version and evict every group holding a record now too old; returns
        the evicted group ids (so their prompts can be generated again)."""
        assert version >= self.learner_version, "learner version never goes back"
        self.learner_version = version
        floor = self.min_version()
        evicted = [g for g, recs in self._groups.items() if min(r.version for r in recs) < floor]
        for gid in evicted:
            self.rejected["stale"] += len(self._groups.pop(gid))
        return evicted

    # ------------------------------------------------------------------ hand-out
    def num_ready_groups(self) -> int:
        return sum(1 for recs in self._groups.values() if len(recs) == self.group_size)

    def take(self, num_groups: int) -> tuple[list[list[Trajectory]], list[int]]:
        """Remove and return up to `num_groups` complete groups (oldest first) and the staleness
        (learner version - record version) of every record handed out, in order."""
        ready = [g for g, recs in self._groups.items() if len(recs) == self.group_size][:num_groups]
        groups = [self._groups.pop(g) for g in ready]
        staleness = [self.learner_version - r.version for grp in groups for r in grp]
        assert all(0 <= s <= self.staleness for s in staleness)
        return groups, staleness

    def contents_by_version(self) -> dict[int, int]:
        """Number of buffered records per generating version."""
        return dict(sorted(Counter(r.version for recs in self._groups.values() for r in recs).items()))

    def __len__(self) -> int:
        return sum(len(recs) for recs in self._groups.values())

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        return {
            "learner_version": self.learner_version,
            "rejected": dict(self.rejected),
            "groups": [[r.to_dict() for r in recs] for recs in self._groups.values()],
            "seen": sorted(self._seen),
        }

    def load_state_dict(self, state: dict) -> None:
        self.learner_version = int(state["learner_version"])
        self.rejected = Counter(state["rejected"])
        self._groups = OrderedDict()
        for recs in state["groups"]:
            trajs = [Trajectory.from_dict(d) for d in recs]
            self._groups[trajs[0].group_id] = trajs
        self._seen = set(state["seen"])
