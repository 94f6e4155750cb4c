"""Issue 22, case 2 (second half): a push is acknowledged only once it is durable in the journal.

What was seen at commit 97ea5ef: the push answered 500 after its records were stored and the
journal write failed; the client's retry got `{"accepted": 0, "duplicates": 4}` and counted the
batch as delivered; after SIGKILL and resume the 4 records were gone. Here the journal's disk fills
up half-way through the line: the push must store nothing and answer 5xx, its retry must be stored
as new records, and a journal read back as a SIGKILLed learner's (never closed) holds them once."""

from __future__ import annotations

import errno
import logging

from hostile import Door, HostileWorker

from echo2.coordinator import journal
from echo2.coordinator.leases import Leases, Work
from echo2.data.buffer import ReplayBuffer


class FullDisk:
    """A journal file whose next write stores half the line, then fails as a full disk does."""

    def __init__(self, file) -> None:
        self.file, self.failures = file, 1

    def write(self, data) -> int:
        if self.failures:
            self.failures -= 1
            self.file.write(bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.file.write(data)

    def __getattr__(self, name: str):
        return getattr(self.file, name)


class FullDiskOnce(journal.Journal):
    """The learner's journal, on a disk that fills up once (after its start line)."""

    def __init__(self, path, *, epoch: str) -> None:
        super().__init__(path, epoch=epoch)
        self._file = FullDisk(self._file)


def test_a_failed_journal_write_stores_nothing_and_the_retry_is_not_a_duplicate(
    door: Door, mallory: HostileWorker, tmp_path, caplog
):
    path = tmp_path / journal.NAME
    log = FullDiskOnce(path, epoch="e1")
    intake = door.state.intake
    intake.journal = log.accepted
    lease_id, records = door.honest_lease(mallory)
    good = path.read_bytes()

    before = door.snapshot()
    status, body = mallory.push(lease_id, records)
    assert status >= 500, (status, body)
    assert path.read_bytes() == good, "the half-written line is cut back"
    after = door.snapshot()
    assert after == before, "nothing was stored or counted"

    status, body = mallory.push(lease_id, records)  # the client's retry
    assert status == 200 and body == {"accepted": len(records), "duplicates": 0}, body
    status, body = mallory.push(lease_id, records)  # and one more: now it is a duplicate
    assert status == 200 and body == {"accepted": 0, "duplicates": len(records)}, body

    # SIGKILL: the journal is never closed; a resumed learner reads it back
    caplog.set_level(logging.WARNING, logger="echo2.coordinator.journal")
    caplog.clear()  # the 500's own log line
    batches = list(journal.accepted_since(path, 0))
    assert [[r.record_id for r in batch] for batch, _ in batches] == [[r["record_id"] for r in records]]
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    ingestion = Leases(
        Work(
            buffer=ReplayBuffer(staleness=intake.buffer.staleness, group_size=intake.buffer.group_size),
            limits=intake.ingestion.limits,
            group_id_of=intake.ingestion.group_id_of,
        ),
        lease_timeout=30.0,
    )
    held = journal.replay(ingestion, iter(batches))
    assert held == [] and ingestion.buffer._seen == {r["record_id"] for r in records}, "0 lost"
    reopened = journal.Journal(path, epoch="e2")  # the restarted learner appends after them
    reopened.close()
    assert not caplog.records and len(list(journal.accepted_since(path, 0))) == 1


def test_a_line_that_fails_to_encode_is_not_written_and_takes_no_sequence_number(tmp_path, caplog):
    """Whatever raises while a line is made leaves the journal as it was: the next line follows
    the last one written, with no gap at resume."""
    from echo2.records import Trajectory

    def rec(rid: str, note) -> Trajectory:
        return Trajectory(
            group_id="g0",
            prompt_ids=(5,),
            response_ids=(7,),
            behaviour_logprobs=(-0.1,),
            loss_mask=(1,),
            reward=1.0,
            version=0,
            record_id=rid,
            metadata={"note": note},
        )

    path = tmp_path / journal.NAME
    log = journal.Journal(path, epoch="e1")
    size = path.stat().st_size
    try:
        log.accepted([rec("a", "\ud800")], {"g0": 0})  # cannot be encoded as UTF-8
    except (UnicodeEncodeError, ValueError):
        pass
    assert path.stat().st_size == size and log.offset() == size
    log.accepted([rec("b", "fine")], {"g0": 0})
    caplog.set_level(logging.WARNING, logger="echo2.coordinator.journal")
    assert [[r.record_id for r in b] for b, _ in journal.accepted_since(path, 0)] == [["b"]]
    assert not caplog.records, [r.getMessage() for r in caplog.records]
