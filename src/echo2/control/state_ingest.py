"""Ingestion and verification for `CoordinatorState` (control/state.py): a pushed batch stored whole
or not at all under the lease's rules, each record checked by the referee (outside the lock: it
decodes and scores), the accepted-records journal written before the acknowledgement, and the
strikes and quarantine that refusals earn a worker.

A mixin: `CoordinatorState` owns the lock and the parts (leases.py, integrity.py) it drives.
"""

from __future__ import annotations

import logging

from echo2.control.errors import InvalidBatch, Quarantined, Refused
from echo2.control.validate import printable
from echo2.records import Trajectory

logger = logging.getLogger("echo2.control.state")


class IngestCalls:
    """`CoordinatorState`'s ingestion half (it sets `lock`, `ingestion`, `referee`, `integrity`,
    `journal`, `buffer`, `registry` and `ready`)."""

    def ingest(self, worker_id: str, lease_id: str, records: list[Trajectory]) -> dict[str, int]:
        """Store a batch whole or not at all. A retried batch is acknowledged, stored once. With a
        referee, each record is first checked against the prompt leased for its group and the
        task's reward (outside the lock: it decodes and scores)."""
        with self.lock:
            self._worker(worker_id)
            self._check_trusted(worker_id)
            lease = self.ingestion.leases.get(lease_id)
            index_of = (
                lease.index_of
                if self.referee is not None and lease is not None and lease.worker_id == worker_id
                else {}
            )
            fresh = [r for r in records if not self.buffer.seen(r.record_id)]
            if index_of and fresh:  # the lease's own rules first: the referee decodes token ids
                try:  # (one outside the vocabulary makes a tokenizer raise) and bounded lengths only
                    self.ingestion.screen(
                        worker_id, lease_id, fresh, published_version=self.published_version
                    )
                except Refused as e:
                    self._strike(worker_id, e.reason)
                    raise
        for record in records:
            if record.group_id in index_of and not self.buffer.seen(record.record_id):
                problem = self.referee.check(record, index_of[record.group_id])
                if problem is not None:
                    self.refuse(worker_id, problem.reason, len(records))
                    raise InvalidBatch(problem.reason, problem.detail)
        with self.lock:
            self._worker(worker_id)
            fresh = [r for r in records if not self.buffer.seen(r.record_id)]
            lease = self.ingestion.leases.get(lease_id)
            try:
                out = self.ingestion.ingest(
                    worker_id, lease_id, records, published_version=self.published_version, now=self.clock()
                )
            except Refused as e:
                self._strike(worker_id, e.reason)
                raise
            if out["accepted"] and self.journal is not None:  # all fresh records were stored
                self.journal(fresh, {r.group_id: lease.index_of[r.group_id] for r in fresh})
            if out["accepted"]:
                self.integrity.stored(worker_id, {r.group_id for r in records})
                self.ready.notify_all()
            return out

    def count_rejected(self, reason: str, n: int) -> None:
        """Records refused before they reached the state (a batch that does not parse)."""
        with self.lock:
            self.ingestion.rejected[reason] += n

    def refuse(self, worker_id: str, reason: str, n: int) -> None:
        """A batch of `n` records refused at the door: counted under `reason`, a strike against
        its worker when an honest one never earns it."""
        with self.lock:
            self.ingestion.rejected[reason] += n
            self._strike(worker_id, reason)

    def flag(self, records: list[Trajectory], reason: str) -> list[str]:
        """The learner refused these records after taking them (their log-probs disagree with its
        own): counted, a strike against each worker that made them; returns those workers."""
        with self.lock:
            self.integrity.flagged[reason] += len(records)
            workers = self.integrity.makers([r.group_id for r in records])
            for worker_id in workers:
                self._strike(worker_id, reason)
            return workers

    def _strike(self, worker_id: str, reason: str) -> None:
        info = self.registry.workers.get(worker_id)
        if info is not None and self.integrity.strike(worker_id, reason):
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
