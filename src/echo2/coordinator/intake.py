"""The coordinator's intake: leases out prompts and takes in the records generated for them, under
the state's one lock (shared.py).

Owns the lease book and the buffer hand-off (leases.py: `Leases`, pure), the strikes and quarantine
(integrity.py), the referee that checks each record against its task, the accepted-records journal,
and the lease sizing figures (the active pool's throughput). A push (`ingest`) reads as three steps:
check (the door's rules over the batch alone, no lock), referee (the task re-scores each record
against the prompt leased for its group, outside the lock: it is a push's costly part, and
heartbeats and the learner wait on the lock), commit (under one acquisition of the lock, one lease
check: what may have changed meanwhile, a lease expired or a learner step, is refused there; then
the batch is journaled and stored whole). A refusal earns its worker a strike. A push is
acknowledged only once its journal line is written; a journal write that fails raises (the client
gets a 500 and retries) and nothing is stored, so the retry is not taken for a duplicate. Knows no
HTTP and no snapshot broadcast.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from echo2.config import CoordinatorConfig
from echo2.coordinator.integrity import RETURNED_UNPUSHED, Integrity
from echo2.coordinator.lease_sizing import lease_deadline, lease_groups
from echo2.coordinator.leases import Lease, Leases, Work
from echo2.coordinator.registry import Registry, WorkerInfo, WorkerStatus
from echo2.coordinator.shared import Shared
from echo2.records import Trajectory
from echo2.wire.errors import InvalidBatch, LeaseLimit, Quarantined, Reason, Refused
from echo2.wire.validate import Referee, batch_problem, printable, token_problem

logger = logging.getLogger(__name__)

Journal = Callable[[list[Trajectory], dict[str, int]], None]
"""Called under the lock with the records of every accepted batch and the prompt index of each of
their groups, before they are stored (coordinator/journal.py: the log a resumed learner replays); one
that raises leaves the batch unstored and unacknowledged."""


class Intake:
    def __init__(
        self,
        shared: Shared,
        registry: Registry,
        section: CoordinatorConfig,
        *,
        work: Work,
        ids: Callable[[], str],
        referee: Referee | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.shared = shared
        self.registry = registry
        self.buffer = work.buffer
        self.ingestion = Leases(work, lease_timeout=section.lease_timeout)
        """Open leases, the prompt cursor, the reissue queue and the ingestion counters."""
        self.integrity = Integrity(quarantine_after=section.quarantine_after)
        """Strikes, quarantine, and which worker made each group (coordinator/integrity.py)."""
        self.ids = ids
        """Makes lease ids."""
        self.referee = referee
        """Checks each record against the task (the leased prompt, the reward); None: no check."""
        self.journal = journal
        self.max_leases_per_worker = section.max_leases_per_worker
        self.max_groups_per_lease = section.groups_per_lease or work.groups_per_step
        """Cap on a lease's groups (`coordinator.groups_per_lease`, default a step's batch); below
        it each lease is sized from its worker's throughput (leases.py: `lease_groups`)."""
        self.groups_per_step = work.groups_per_step
        """A step's batch in groups, split across the active workers by their throughput."""
        self.pool_throughput = 0.0
        """Trajectories/s of the active workers (not in standby), as of the last expiry round."""
        self.pool_figures: dict[str, float] = {}
        """Each active worker's part of `pool_throughput`, as of the same round."""

    # ------------------------------------------------------------------ throughput (under the lock)
    def throughput(self, info: WorkerInfo, now: float) -> float | None:
        """Trajectories/s the coordinator believes of `info` (`Registry.throughput`): delivered on
        its leases once measured, else its own figure; None: none yet. Called under the lock."""
        return self.registry.throughput(info, now, delivered=self.ingestion.delivered(info.worker_id))

    def measure_pool(self, now: float) -> None:
        """Sum the active workers' throughput (called under the lock, by each expiry round)."""
        self.pool_figures = {
            w.worker_id: self.throughput(w, now) or 0.0
            for w in self.registry.workers.values()
            if w.status is WorkerStatus.ACTIVE and not w.standby
        }
        self.pool_throughput = sum(self.pool_figures.values())

    def pool_with(self, worker_id: str, throughput: float | None) -> float:
        """The pool's throughput with `worker_id` counted at its figure now: a worker's share of a
        step is its rate over a pool it is part of, so a lone worker's share is the whole step however
        its rate moved since the last expiry round (it was the round's figure against today's, and a
        lone worker slowed by half got leases of half a step: a timing-dependent partition)."""
        return self.pool_throughput - self.pool_figures.get(worker_id, 0.0) + (throughput or 0.0)

    def forget(self, worker_id: str) -> None:
        """The worker's registration is forgotten (called under the lock)."""
        self.integrity.forget(worker_id)
        self.ingestion.forget(worker_id)

    # ------------------------------------------------------------------ leases
    def lease(self, worker_id: str, *, version: int, max_groups: int) -> Lease | None:
        """Prompts to generate, or None: nothing published yet, or the worker's installed version is
        already too old to be admitted (it should install the newest snapshot first). At most
        `max_groups` and `max_groups_per_lease` groups, sized from the worker's throughput so that
        the lease is done well inside its deadline (leases.py: `lease_groups`, `lease_deadline`)."""
        with self.shared.lock:
            now = self.shared.clock()
            info = self.registry.get(worker_id, now)
            self._check_trusted(worker_id)
            if self.shared.published_version < 0 or self.shared.closed:
                return None
            self.shared.check_version(version)
            if not self.ingestion.admits(version) or info.standby:
                return None
            held = sum(1 for lease in self.ingestion.leases.values() if lease.worker_id == worker_id)
            if held >= self.max_leases_per_worker:
                raise LeaseLimit(
                    f"worker already holds {held} open leases (at most {self.max_leases_per_worker})"
                )
            mu = self.throughput(info, now)
            limits, timeout = self.ingestion.limits, self.ingestion.lease_timeout
            groups = lease_groups(
                throughput=mu,
                pool_throughput=self.pool_with(worker_id, mu),
                groups_per_step=self.groups_per_step,
                group_size=limits.group_size,
                lease_timeout=timeout,
                cap=min(max_groups, self.max_groups_per_lease),
            )
            deadline_s = lease_deadline(
                groups=groups, throughput=mu, group_size=limits.group_size, lease_timeout=timeout
            )
            return self.ingestion.issue(
                self.ids(), worker_id, max_groups=groups, now=now, deadline_s=deadline_s, version=version
            )

    def return_lease(self, worker_id: str, lease_id: str) -> None:
        """The worker gives its lease back (one it does not hold: nothing happens). One no push ever
        reached (stored or refused: an honest worker whose push was refused gives its lease back)
        counts against the worker: past `max_leases_per_worker` of them since its last stored push,
        each is a strike (integrity.py: `returned`)."""
        with self.shared.lock:
            self.registry.get(worker_id, self.shared.clock())
            lease = self.ingestion.leases.get(lease_id)
            if lease is None or lease.worker_id != worker_id:
                return
            self.ingestion.put_back(lease)
            if not lease.pushed and self.integrity.returned(worker_id, allowance=self.max_leases_per_worker):
                self._strike(worker_id, RETURNED_UNPUSHED)

    # ------------------------------------------------------------------ ingestion
    def ingest(self, worker_id: str, lease_id: str, records: list[Trajectory]) -> dict[str, int]:
        """Store a pushed batch whole or not at all: check, referee outside the lock, commit under
        the lock. A retried batch is acknowledged, stored once; a refusal is counted (most earn
        their worker a strike) and raised."""
        self._check(worker_id, records)
        refereed = self._referee(worker_id, lease_id, records)
        with self.shared.lock:
            return self._commit(worker_id, lease_id, records, refereed)

    def _check(self, worker_id: str, records: list[Trajectory]) -> None:
        """The door's rules over the batch alone (wire/validate.py: no id twice, numbers in range,
        masks of 0/1): pure, no lock."""
        problem = batch_problem(records, reward_range=self.ingestion.limits.reward_range)
        if problem is not None:  # refused whole: nothing stored, only the refusal counted
            self.refuse(worker_id, problem.reason, len(records))
            raise InvalidBatch(problem.reason, problem.detail)

    def _referee(self, worker_id: str, lease_id: str, records: list[Trajectory]) -> Lease | None:
        """Re-score the batch against its task without the lock (the referee is a push's costly
        part, and heartbeats wait on the lock): the lease it was checked against, or None when
        nothing was checked (no referee; a lease this worker does not hold, a group outside it, or
        tokens a tokenizer cannot decode, which the commit's lease check refuses)."""
        if self.referee is None:
            return None
        lease = self.ingestion.leases.get(lease_id)  # one dict read; a lease's index map never changes
        lim = self.ingestion.limits
        if (
            lease is None
            or lease.worker_id != worker_id
            or any(r.group_id not in lease.index_of for r in records)
            or any(token_problem(r, lim) is not None for r in records)
        ):
            return None
        for record in records:
            problem = self.referee.check(record, lease.index_of[record.group_id])
            if problem is not None:
                self.refuse(worker_id, problem.reason, len(records))
                raise InvalidBatch(problem.reason, problem.detail)
        return lease

    def _commit(
        self, worker_id: str, lease_id: str, records: list[Trajectory], refereed: Lease | None
    ) -> dict[str, int]:
        """Under the lock, one lease check: what changed since the batch was checked (a quarantine,
        the lease expired, the learner moved on) is refused here; then journaled, then stored."""
        now = self.shared.clock()
        self.registry.get(worker_id, now)
        self._check_trusted(worker_id)
        fresh = [r for r in records if not self.buffer.seen(r.record_id)]
        if not fresh:
            return {"accepted": 0, "duplicates": len(records)}
        if (held := self.ingestion.leases.get(lease_id)) is not None and held.worker_id == worker_id:
            held.pushed = True  # refused or not: the worker did not just hold it (`return_lease`)
        try:
            lease = self.ingestion.screen(
                worker_id, lease_id, fresh, published_version=self.shared.published_version
            )
            bad = self.integrity.bad_installs.get(worker_id, ())
            if bad and (wrong := next((r for r in fresh if r.version in bad), None)) is not None:
                self.ingestion.rejected[Reason.WRONG_SNAPSHOT] += len(fresh)
                raise InvalidBatch(
                    Reason.WRONG_SNAPSHOT,
                    f"record {printable(wrong.record_id, 64)}: this worker's install report of "
                    f"version {wrong.version} was refused (not the snapshot the learner published)",
                )
        except Refused as e:
            self._strike(worker_id, e.reason)
            raise
        # a lease id names one lease, and what passed its check is what `_referee` checks
        assert self.referee is None or lease is refereed, "a screened batch was refereed against its lease"
        if self.journal is not None:  # durable first: a failed write raises (500), nothing stored
            self.journal(fresh, {r.group_id: lease.index_of[r.group_id] for r in fresh})
        stored = self.ingestion.store(worker_id, lease, fresh, now=now)
        self.integrity.stored(worker_id, {r.group_id for r in records})
        self.shared.ready.notify_all()
        return {"accepted": stored, "duplicates": len(records) - len(fresh)}

    def count_rejected(self, reason: str, n: int) -> None:
        """Records refused before they reached the state (a batch that does not parse)."""
        with self.shared.lock:
            self.ingestion.rejected[reason] += n

    def refuse(self, worker_id: str, reason: str, n: int) -> None:
        """A batch of `n` records refused at the door: counted under `reason`, a strike against
        its worker when an honest one never earns it."""
        with self.shared.lock:
            self._refuse(worker_id, reason, n)

    def _refuse(self, worker_id: str, reason: str, n: int) -> None:
        self.ingestion.rejected[reason] += n
        self._strike(worker_id, reason)

    def flag(self, records: list[Trajectory], reason: str) -> list[str]:
        """The learner refused these records after taking them (their log-probs disagree with its
        own): counted, a strike against each worker that made them; returns those workers."""
        with self.shared.lock:
            self.integrity.flagged[reason] += len(records)
            workers = self.integrity.makers([r.group_id for r in records])
            for worker_id in workers:
                self._strike(worker_id, reason)
            return workers

    def install_refused(self, worker_id: str, version: int) -> None:
        """The publisher refused `worker_id`'s install report of `version` (wrong_snapshot): the
        worker runs weights the learner did not publish (its pinned key was swapped, or it lies).
        A strike, and its records of that version are refused from now on."""
        with self.shared.lock:
            self.integrity.install_refused(worker_id, version)
            self._strike(worker_id, Reason.WRONG_SNAPSHOT)

    def banned(self, credential_digest: bytes) -> bool:
        """Whether this credential belongs to a worker that was quarantined (a read of a set)."""
        return credential_digest in self.integrity.banned

    def _strike(self, worker_id: str, reason: str) -> None:
        info = self.registry.workers.get(worker_id)
        if info is not None and self.integrity.strike(worker_id, reason, credential=info.secret_digest):
            self.ingestion.put_back_all(worker_id)
            logger.warning(
                "worker quarantined: %s (%s) after %d refusals (last: %s)",
                printable(info.name),
                worker_id,
                self.integrity.strikes[worker_id],
                reason,
            )

    def _check_trusted(self, worker_id: str) -> None:
        if worker_id in self.integrity.quarantined:
            raise Quarantined(f"worker {worker_id!r} is quarantined: its records kept failing verification")

    # ------------------------------------------------------------------ learner side
    def take_groups(self, num_groups: int, *, timeout: float) -> tuple[list[list[Trajectory]], list[int]]:
        """Block until `num_groups` admissible groups are buffered (or timeout), then take them."""
        with self.shared.lock:
            self.shared.ready.wait_for(
                lambda: self.buffer.num_ready_groups() >= num_groups or self.shared.closed, timeout=timeout
            )
            if self.buffer.num_ready_groups() < num_groups:
                return [], []
            groups, staleness = self.buffer.take(num_groups)
            self.ingestion.taken(groups)
            return groups, staleness

    def set_learner_version(self, version: int) -> None:
        with self.shared.lock:
            self.ingestion.requeue_evicted(self.buffer.set_learner_version(version))

    # ------------------------------------------------------------------ reporting
    def status(self, rows: list[dict]) -> dict:
        """The intake's part of GET /status; marks the registry's `rows` (called under the lock)."""
        for row in rows:
            if row["worker_id"] in self.integrity.quarantined:
                row["state"] = "quarantined"
            row["delivered"] = self.ingestion.delivered(row["worker_id"])
        return {
            "learner_version": self.buffer.learner_version,
            **self.integrity.status(),
            "buffer_by_version": {str(k): v for k, v in self.buffer.contents_by_version().items()},
            **self.ingestion.status(),
        }
