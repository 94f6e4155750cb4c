"""The accepted-records journal: RUN_DIR/accepted.jsonl, so a learner crash loses no accepted record.

Owns the file, its line format and its key; knows nothing of HTTP or training. One JSON object a
line, written whole (unbuffered) before the batch is acknowledged, or cut back and the failure
raised, so that a push whose line failed is stored nowhere (a killed process loses nothing written;
`sync` fsyncs, at every checkpoint). Every line carries `seq`, one more than the line before it
(across restarts), and ends with `mac`: HMAC-SHA256, keyed by the run's secret RUN_DIR/journal.key
(32 random bytes, mode 0600, made with the journal), of the line's bytes before it. A line the
learner did not write, or wrote and someone changed, fails its MAC:

- `{"start": EPOCH, "t": ...}`: a learner (re)started; EPOCH is its coordinator's epoch id.
- `{"accepted": [record, ...], "prompts": {group_id: prompt index}, "t": ...}`: one accepted batch.
- `{"taken": [record_id, ...], "version": V, "t": ...}`: records handed to the learner at version V
  (the step from V to V + 1 trains them). After a resume, the last line of each V is what the run's
  weights were trained on.
- `{"published": V, "epoch": EPOCH, "t": ...}`: a snapshot published.

A checkpoint stores the journal's byte offset together with the buffer, under the coordinator's
lock: every record accepted before the offset is trained or in the checkpointed buffer, every one
after it is neither, so `accepted_since(offset)` is exactly what a resumed learner must put back. A
torn last line (the process killed mid-write) is cut off when the journal is opened again.

On resume nothing in the file is trusted: a line that does not parse or fails its MAC is skipped
with a warning naming its line number and why, a jump in `seq` is reported as lines missing, a
journal shorter than the checkpoint's offset (or gone) as truncated, and the records of every line
kept go through the door's checks again (wire/validate.py, the lease's limits and the task's
referee) in `replay`; a batch that fails them is skipped whole and its prompts are generated again.
What no check here can see: lines cut from the end of the journal after the last checkpoint.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from echo2.records import Trajectory
from echo2.wire.validate import Referee, door_problem, printable

if TYPE_CHECKING:
    from echo2.coordinator.leases import Leases
    from echo2.data.buffer import ReplayBuffer

logger = logging.getLogger(__name__)

NAME = "accepted.jsonl"
KEY_NAME = "journal.key"
"""The run's journal secret, next to the journal (mode 0600); workers never see the run directory."""
_MAC_HEAD = b',"mac":"'
_MAC_TAIL = len(_MAC_HEAD) + 64 + 2
"""Bytes of `,"mac":"<64 hex digits>"}` at the end of every line."""


def journal_key(path: Path, *, create: bool) -> bytes | None:
    """The journal secret in `path` (RUN_DIR/journal.key): made (32 random bytes, 0600) if `create`
    and there is none; None if there is none and not `create`."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        if not create:
            return None
    key = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


def _sign(key: bytes, body: bytes) -> bytes:
    """`body` (one encoded JSON object) with its MAC as the last field, and a newline."""
    mac = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
    return body[:-1] + _MAC_HEAD + mac + b'"}\n'


def _verified(key: bytes | None, line: bytes) -> dict | str:
    """The entry of `line` (without its newline) if its MAC is right and it parses; else why not."""
    if len(line) < _MAC_TAIL or line[-_MAC_TAIL : -_MAC_TAIL + len(_MAC_HEAD)] != _MAC_HEAD:
        return "no MAC"
    if key is None:
        return f"no key ({KEY_NAME} is missing) to check its MAC"
    body = line[:-_MAC_TAIL] + b"}"
    mac = line[-_MAC_TAIL + len(_MAC_HEAD) : -2]
    if not hmac.compare_digest(hmac.new(key, body, hashlib.sha256).hexdigest().encode(), mac):
        return "bad MAC: the learner did not write this line"
    try:
        entry = json.loads(body)
    except ValueError as e:
        return f"does not parse ({e})"
    if not isinstance(entry, dict) or not isinstance(entry.get("seq"), int):
        return "no sequence number"
    return entry


class Journal:
    def __init__(self, path: Path, *, epoch: str) -> None:
        self.path = path
        self._key = journal_key(path.with_name(KEY_NAME), create=True)
        _cut_torn_tail(path)
        self._seq = _next_seq(path, self._key)
        self._file = path.open("ab", buffering=0)  # one write per line: nothing left in a buffer
        self._end = self._file.seek(0, os.SEEK_END)
        """Bytes of whole lines written: a failed write is cut back to it."""
        self._lock = threading.Lock()
        self._write({"start": epoch, "t": time.time()})

    def accepted(self, records: list[Trajectory], prompts: dict[str, int]) -> None:
        self._write({"accepted": records, "prompts": prompts, "t": time.time()})

    def taken(self, version: int, record_ids: list[str]) -> None:
        self._write({"taken": record_ids, "version": version, "t": time.time()})

    def published(self, version: int, epoch: str) -> None:
        self._write({"published": version, "epoch": epoch, "t": time.time()})

    def offset(self) -> int:
        """Bytes written so far (every line before it is flushed); final once closed."""
        with self._lock:
            return self._end

    def sync(self) -> None:
        with self._lock:
            if not self._file.closed:
                os.fsync(self._file.fileno())

    def close(self) -> None:
        """Idempotent; the learner's last checkpoint may still ask for the offset."""
        with self._lock:
            if not self._file.closed:
                os.fsync(self._file.fileno())
                self._file.close()

    def _write(self, line: dict) -> None:
        """Append one signed line, whole or not at all: a write that fails (a full disk) is cut
        back to the last whole line and raised, and the next line takes the same `seq`, so the
        caller may undo what it journalled (intake.py acknowledges a push only after this)."""
        with self._lock:
            line["seq"] = self._seq
            signed = _sign(self._key, _encode(line))  # msgspec: about 10x json's speed on records' numbers
            try:
                data = memoryview(signed)
                while data:
                    data = data[self._file.write(data) :]
            except BaseException:
                os.ftruncate(self._file.fileno(), self._end)
                raise
            self._end += len(signed)
            self._seq += 1


_encode = msgspec.json.Encoder().encode
"""Writes a `Trajectory` as its fields (msgspec encodes a dataclass without copying it;
`Trajectory.from_dict` reads it back)."""


def accepted_since(
    path: Path, offset: int, *, key: bytes | None = None
) -> Iterator[tuple[list[Trajectory], dict[str, int]]]:
    """The batches accepted after byte `offset`, in order: (records, prompt index of each group),
    from lines whose MAC (with `key`, default: the run's journal.key next to `path`) is right. Lines
    skipped, sequence gaps and truncation are logged as warnings that name them."""
    if not path.is_file():
        if offset > 0:
            logger.warning("%s is gone: records accepted after the checkpoint are lost", path)
        return
    if key is None:
        key = journal_key(path.with_name(KEY_NAME), create=False)
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size < offset:
            logger.warning(
                "%s is truncated: %d bytes, the checkpoint was taken at byte %d; records accepted "
                "after it are lost",
                path,
                size,
                offset,
            )
            return
        number, expected = _position(f, offset, key)
        f.seek(offset)
        for line in f:
            number += 1
            if not line.endswith(b"\n"):
                break  # torn tail
            entry = _verified(key, line[:-1])
            if isinstance(entry, str):
                logger.warning("%s line %d skipped: %s", path, number, entry)
                expected = None if expected is None else expected + 1
                continue
            seq = entry["seq"]
            if expected is not None and seq != expected:
                if seq < expected:
                    logger.warning("%s line %d skipped: seq %d repeats an earlier line", path, number, seq)
                    continue
                logger.warning(
                    "%s line %d: %d lines missing before it (seq %d, expected %d)",
                    path,
                    number,
                    seq - expected,
                    seq,
                    expected,
                )
            expected = seq + 1
            if "accepted" in entry:
                try:
                    batch = (
                        [Trajectory.from_dict(d) for d in entry["accepted"]],
                        {str(g): int(i) for g, i in entry["prompts"].items()},
                    )
                except (KeyError, TypeError, ValueError, AttributeError) as e:
                    logger.warning("%s line %d skipped: not a batch (%s)", path, number, printable(e))
                    continue
                yield batch


def _position(f, offset: int, key: bytes | None) -> tuple[int, int | None]:
    """(lines before byte `offset`, the seq the line at `offset` must have: None if unknown)."""
    f.seek(0)
    number, at = 0, 0
    while at < offset:
        block = f.read(min(1 << 20, offset - at))
        number += block.count(b"\n")
        at += len(block)
    if offset == 0:
        return number, 0
    previous = _line_ending_at(f, offset)
    entry = _verified(key, previous) if previous is not None else "none"
    return number, entry["seq"] + 1 if isinstance(entry, dict) else None


def _line_start(f, end: int) -> int:
    """Where the line holding the byte before `end` starts: just past the newline before it, or 0."""
    at = end
    while at > 0:
        step = min(65536, at)
        f.seek(at - step)
        nl = f.read(step).rfind(b"\n")
        if nl >= 0:
            return at - step + nl + 1
        at -= step
    return 0


def _line_ending_at(f, end: int) -> bytes | None:
    """The line whose newline is the byte before `end` (without it), or None."""
    f.seek(end - 1)
    if f.read(1) != b"\n":
        return None
    start = _line_start(f, end - 1)
    f.seek(start)
    return f.read(end - 1 - start)


def _next_seq(path: Path, key: bytes) -> int:
    """The seq of the next line: one more than the last line's (its MAC checked), 0 for a new
    journal. A last line that fails its check is scanned past, back to the last good one."""
    if not path.is_file():
        return 0
    with path.open("rb") as f:
        end = f.seek(0, os.SEEK_END)
        while end > 0:
            line = _line_ending_at(f, end)
            if line is None:
                break
            entry = _verified(key, line)
            if isinstance(entry, dict):
                return entry["seq"] + 1
            end -= len(line) + 1
    return 0


def _cut_torn_tail(path: Path) -> None:
    """Drop a last line without its newline (the process was killed while writing it)."""
    if not path.is_file():
        return
    with path.open("r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        at = _line_start(f, size)
        logger.warning("%s: cutting a torn last line (%d bytes)", path, size - at)
        f.truncate(at)


def replay(
    ingestion: Leases,
    batches: Iterator[tuple[list[Trajectory], dict[str, int]]],
    *,
    referee: Referee | None = None,
) -> list[Trajectory]:
    """Put the batches accepted after a checkpoint back, once its buffer and prompt queue are
    loaded. Each batch goes through the door again (`validate.door_problem`: the record rules, the
    lease's limits, and `referee`'s check of the prompt and reward): one that fails is skipped
    whole, with a warning, and its prompts are generated again. Records already seen are skipped (none is trained
    twice); the others go to the buffer, or are returned to be held while they are newer than the
    resumed learner (`admit_held` puts them in as it advances). Their prompts are done: out of the
    reissue queue, and the prompt cursor moves past them (a prompt handed out after the checkpoint
    but never answered is queued again)."""
    buffer = ingestion.buffer
    held: list[Trajectory] = []
    held_ids: set[str] = set()
    prompts: dict[str, int] = {}
    refused = 0
    for records, batch_prompts in batches:
        problem = door_problem(ingestion.limits, records, batch_prompts, referee)
        if problem is not None:
            refused += 1
            logger.warning(
                "journal batch of %d records skipped on replay: %s %s",
                len(records),
                problem.reason,
                problem.detail,
            )
            continue
        prompts.update(batch_prompts)
        for r in records:
            if buffer.seen(r.record_id) or r.record_id in held_ids:
                continue
            if r.version > buffer.learner_version:
                held.append(r)
                held_ids.add(r.record_id)
            else:
                buffer.add([r])
    done = set(prompts.values())
    ingestion.buffered.update(prompts)  # a stale group's prompt is queued again, as for any other
    cursor = ingestion.next_index
    if done and max(done) >= cursor:
        ingestion.reissue.extend(i for i in range(cursor, max(done) + 1) if i not in done)
        ingestion.next_index = max(done) + 1
    kept = [i for i in ingestion.reissue if i not in done]
    ingestion.reissue.clear()
    ingestion.reissue.extend(kept)
    logger.info(
        "replayed the journal: %d groups back, %d records held until their version, %d batches refused",
        len(prompts),
        len(held),
        refused,
    )
    return held


def admit_held(buffer: ReplayBuffer, held: list[Trajectory]) -> list[Trajectory]:
    """Put held records whose version the learner has reached into the buffer; returns the rest."""
    ready = [r for r in held if r.version <= buffer.learner_version]
    if ready:
        buffer.add(ready)
    return [r for r in held if r.version > buffer.learner_version]
