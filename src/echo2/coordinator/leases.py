"""Leases and ingestion: which prompts each worker generates, and the checked hand-off of its
records to the replay buffer.

Pure bookkeeping with the caller's clock and the caller's lease ids: no lock (the intake, intake.py,
holds the state's), no I/O. Owns the open leases, the prompt cursor, the reissue queue and the
ingestion counters. A lease's prompts go back to the queue when it expires, is returned, turns out
stale or its worker is lost. Ingestion is all-or-nothing: a push carries whole groups (all `group_size`
records of each of its groups), so a group is admitted whole from one lease and a lease given back
or expired leaves no partial group behind to hold its prompt hostage; a batch with one bad record
is refused whole with a reason (errors.py) and changes nothing but the refusal counter (and, when stale, the
reissue queue). Does not know whether a worker is registered: the intake checks that first.

How big a lease is and when it is due are pure functions of the worker's throughput
(lease_sizing.py); the reissue queue hands out the lowest prompt index first (prompt_queue.py).
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from collections.abc import Callable, KeysView
from dataclasses import dataclass, field

from echo2.coordinator.lease_sizing import Delivery
from echo2.coordinator.prompt_queue import PromptQueue
from echo2.data.buffer import ReplayBuffer
from echo2.records import Trajectory
from echo2.wire.errors import InvalidBatch, LeaseExpired, Reason, Refused, Stale
from echo2.wire.validate import DEFAULT_REWARD_RANGE, token_problem

logger = logging.getLogger(__name__)


SEED_KEY = "lease_seed"
"""Record metadata key of the lease's sampling seed (rollout/sampling.py: `SEED_KEY`)."""


@dataclass(slots=True, kw_only=True)
class Lease:
    lease_id: str
    worker_id: str
    indices: tuple[int, ...]
    index_of: dict[str, int]
    """Each leased group's prompt index (the referee, the journal and the buffer hand-off read it)."""
    deadline: float
    version: int = -1
    """The version the worker asked with (its installed one): its records may not claim an older
    one, which would widen the learner's log-prob bounds (learning/verify.py: `StepCheck`)."""
    sampling_seed: int = 0
    """Seeds the lease's sampling noise (rollout/sampling.py): the coordinator's `Leases.noise_seed`,
    sent in the lease reply and written into every record accepted on this lease (`screen`),
    whatever the worker sent."""
    done_groups: set[str] = field(default_factory=set)
    pushed: bool = False
    """A push on it reached the intake, stored or refused: given back, it is not `unpushed`."""

    @property
    def group_ids(self) -> KeysView[str]:
        """The leased groups' ids."""
        return self.index_of.keys()


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    vocab_size: int
    max_prompt_tokens: int
    max_new_tokens: int
    group_size: int
    reward_range: tuple[float, float] = DEFAULT_REWARD_RANGE
    """The task's declared rewards (validate.reward_range); others are refused at the door."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Work:
    """What the coordinator hands out and takes back, as the run's task and learner define it: the
    buffer records go to, the door's limits, the group id of each prompt index, a step's batch."""

    buffer: ReplayBuffer
    limits: Limits
    group_id_of: Callable[[int], str]
    groups_per_step: int = 1024
    """A step's batch in groups (`rollout.prompts_per_step`), split across the active workers by
    their throughput (`lease_groups`)."""


class Leases:
    def __init__(self, work: Work, *, lease_timeout: float) -> None:
        self.buffer = work.buffer
        self.limits = work.limits
        self.group_id_of = work.group_id_of
        self.lease_timeout = lease_timeout
        self.leases: dict[str, Lease] = {}
        self.next_index = 0
        self.reissue = PromptQueue()
        self.rejected: Counter[str] = Counter()
        """Records refused at ingestion, by reason."""
        self.accepted = 0
        self.reissued = 0
        """Prompts put back in the queue (expired, returned or stale leases, lost workers)."""
        self.expired = 0
        """Leases put back because they outlived their deadline (a healthy worker's never do)."""
        self.buffered: dict[str, int] = {}
        """Prompt index of every complete group in the buffer, until the learner takes it (or it is
        evicted as stale and its prompt goes back to the queue)."""
        self.delivery: dict[str, Delivery] = {}
        """What each worker that held a lease delivered (forgotten with the worker)."""
        self.noise_seed = secrets.randbits(63)
        """Every lease's sampling seed. The noise of sample j of a group is keyed by this seed and
        the group's id (rollout/sampling.py), so it is spent when the group is first leased: a
        worker that has its push refused (stale, over-full) or gives the lease back and leases the
        prompt again gets the same noise, and under the same weights the same response. A seed per
        lease let it re-draw a prompt's samples at will, at no cost (issue 41 item 3)."""

    # ------------------------------------------------------------------ leases
    def admits(self, version: int) -> bool:
        """Records generated with `version` would be admitted now (-1: nothing installed yet)."""
        return version >= max(0, self.buffer.min_version())

    def issue(
        self,
        lease_id: str,
        worker_id: str,
        *,
        max_groups: int,
        now: float,
        deadline_s: float | None = None,
        version: int = -1,
    ) -> Lease:
        """Reissued prompts first, then new ones; due in `deadline_s` (default: the lease timeout)."""
        assert lease_id not in self.leases, f"lease id {lease_id!r} issued twice"
        indices = []
        while len(indices) < max_groups and self.reissue:
            indices.append(self.reissue.popleft())
        while len(indices) < max_groups:
            indices.append(self.next_index)
            self.next_index += 1
        lease = Lease(
            lease_id=lease_id,
            worker_id=worker_id,
            indices=tuple(indices),
            index_of={self.group_id_of(i): i for i in indices},
            deadline=now + (self.lease_timeout if deadline_s is None else deadline_s),
            version=version,
            sampling_seed=self.noise_seed,
        )
        self.leases[lease_id] = lease
        self.delivery.setdefault(worker_id, Delivery()).opened(now)
        return lease

    def delivered(self, worker_id: str) -> float | None:
        """Trajectories/s the worker delivered (`Delivery`), or None while not measured."""
        d = self.delivery.get(worker_id)
        return d.rate if d is not None else None

    def forget(self, worker_id: str) -> None:
        """The worker's registration is forgotten: so is what it delivered."""
        self.delivery.pop(worker_id, None)

    def _close(self, lease: Lease, now: float | None) -> None:
        """Forget `lease`, closed at `now` (None: given back; see `Delivery`)."""
        del self.leases[lease.lease_id]
        d = self.delivery.get(lease.worker_id)
        if d is not None:  # None: the worker was forgotten
            d.closed(now)

    def give_back(self, worker_id: str, lease_id: str) -> None:
        """The worker returns its lease (a lease it does not hold: nothing happens)."""
        lease = self.leases.get(lease_id)
        if lease is not None and lease.worker_id == worker_id:
            self.put_back(lease)

    def put_back(self, lease: Lease, *, expired_at: float | None = None) -> None:
        """Close `lease`; its prompts whose groups are not complete go back to the queue. Only a
        lease that expired (at `expired_at`) counts for its worker's delivered rate (`Delivery`)."""
        self._close(lease, expired_at)
        self.expired += expired_at is not None
        todo = [i for i in lease.indices if self.group_id_of(i) not in lease.done_groups]
        self.reissue.extend(todo)
        self.reissued += len(todo)
        logger.info("lease %s of %s reissued (%d groups)", lease.lease_id, lease.worker_id, len(todo))

    def requeue_evicted(self, group_ids: list[str]) -> None:
        """Groups the buffer evicted as stale: their prompts go back to the queue, so a prompt is
        never lost to staleness (it is generated again under a newer version)."""
        todo = [self.buffered.pop(gid) for gid in group_ids if gid in self.buffered]
        self.reissue.extend(todo)
        self.reissued += len(todo)

    def taken(self, groups: list[list[Trajectory]]) -> None:
        """The learner took these groups: their prompts are done."""
        for group in groups:
            self.buffered.pop(group[0].group_id, None)

    def put_back_all(self, worker_id: str) -> None:
        for lease in [le for le in self.leases.values() if le.worker_id == worker_id]:
            self.put_back(lease)

    def expire(self, now: float, lost: Callable[[str], bool]) -> None:
        """Put back leases past their deadline and those of lost workers."""
        for lease in list(self.leases.values()):
            if lost(lease.worker_id):
                self.put_back(lease)
            elif now > lease.deadline:
                self.put_back(lease, expired_at=now)

    def pending(self) -> list[int]:
        """Prompts not consumed yet: queued, handed out, or generated and still in the buffer (a
        checkpoint does not hold the buffer, so a resumed run generates them again)."""
        leased = [i for lease in self.leases.values() for i in lease.indices]
        return list(self.reissue) + leased + list(self.buffered.values())

    # ------------------------------------------------------------------ ingestion
    def ingest(
        self,
        worker_id: str,
        lease_id: str,
        records: list[Trajectory],
        *,
        published_version: int,
        now: float | None = None,
    ) -> dict[str, int]:
        """Store a batch whole or not at all (`screen`, then `store`). A retried batch is
        acknowledged, stored once. `now` times the worker's delivered rate (None: a completed lease
        does not count for it)."""
        fresh = [r for r in records if not self.buffer.seen(r.record_id)]
        if not fresh:
            return {"accepted": 0, "duplicates": len(records)}
        lease = self.screen(worker_id, lease_id, fresh, published_version=published_version)
        return {
            "accepted": self.store(worker_id, lease, fresh, now=now),
            "duplicates": len(records) - len(fresh),
        }

    def store(self, worker_id: str, lease: Lease, fresh: list[Trajectory], *, now: float | None) -> int:
        """Hand a screened batch's fresh records to the buffer; returns how many were stored."""
        stored = self.buffer.add(fresh)
        assert stored == len(fresh), "validated records are all admitted"
        for gid in Counter(r.group_id for r in fresh):
            if self.buffer.group_count(gid) == self.limits.group_size:
                lease.done_groups.add(gid)
                self.buffered[gid] = lease.index_of[gid]
        if (d := self.delivery.get(worker_id)) is not None:  # None: the worker was forgotten
            d.accepted(stored)
        if lease.done_groups == lease.group_ids:
            self._close(lease, now)
        self.accepted += stored
        return stored

    def screen(
        self, worker_id: str, lease_id: str, fresh: list[Trajectory], *, published_version: int
    ) -> Lease:
        """`check` the batch's fresh records and return their lease, its sampling seed written into
        each; a refusal is counted (and a stale lease's prompts are put back) before it is raised."""
        try:
            lease = self.check(worker_id, lease_id, fresh, published_version=published_version)
        except Refused as e:
            self.rejected[e.reason] += len(fresh)
            lease = self.leases.get(lease_id)
            if isinstance(e, Stale) and lease is not None and lease.worker_id == worker_id:
                self.put_back(lease)  # regenerate these prompts under a newer version
            raise
        for r in fresh:  # the lease's seed, never the worker's: before the journal and the buffer
            r.metadata[SEED_KEY] = lease.sampling_seed
        return lease

    def check(
        self, worker_id: str, lease_id: str, records: list[Trajectory], *, published_version: int
    ) -> Lease:
        """The batch's lease, or the first rule the batch breaks, as a refusal (docs/protocol.md
        lists them in this order). The one lease check of a push."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.worker_id != worker_id:
            raise LeaseExpired(f"lease {lease_id!r} is not held by this worker")
        lim = self.limits
        floor = self.buffer.min_version()
        if len({r.record_id for r in records}) < len(records):
            raise InvalidBatch(Reason.DUPLICATE_ID, "a record id appears twice in the batch")
        for r in records:
            where = f"record {r.record_id}"
            if r.group_id not in lease.group_ids:
                raise InvalidBatch(
                    Reason.WRONG_GROUP, f"{where}: group {r.group_id} is not in lease {lease_id}"
                )
            if r.version > published_version:
                raise InvalidBatch(
                    Reason.FUTURE_VERSION, f"{where}: version {r.version} > published {published_version}"
                )
            if r.version < floor:
                raise Stale(f"{where}: version {r.version} < learner version - S = {floor}")
            if r.version < lease.version:
                raise InvalidBatch(
                    Reason.WRONG_VERSION, f"{where}: version {r.version} < {lease.version}, the lease's"
                )
            if (problem := token_problem(r, lim)) is not None:
                raise InvalidBatch(problem.reason, problem.detail)
        for gid, n in Counter(r.group_id for r in records).items():
            have = self.buffer.group_count(gid) + n
            if have > lim.group_size:
                raise InvalidBatch(Reason.GROUP_OVERFLOW, f"group {gid}: more than {lim.group_size} records")
            if have < lim.group_size:  # a group is admitted whole, from one push of one lease
                raise InvalidBatch(
                    Reason.PARTIAL_GROUP,
                    f"group {gid}: {n} of its {lim.group_size} records (a push carries whole groups)",
                )
        return lease

    def status(self) -> dict:
        """The ingestion figures GET /status shows."""
        return {
            "accepted": self.accepted,
            "rejected": dict(self.rejected),
            "buffer_rejected": dict(self.buffer.rejected),
            "leases_open": len(self.leases),
            "reissue_queue": len(self.reissue),
            "reissued": self.reissued,
            "leases_expired": self.expired,
        }
