"""The accepted-records journal: RUN_DIR/accepted.jsonl, so a learner crash loses no accepted record.

Owns the file and its line format; knows nothing of HTTP or training. One JSON object a line,
appended and flushed before the batch is acknowledged (a killed process loses nothing flushed;
`sync` fsyncs, at every checkpoint):

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
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from echo2.records import Trajectory

if TYPE_CHECKING:
    from echo2.control.leases import Leases
    from echo2.data.buffer import ReplayBuffer

logger = logging.getLogger(__name__)

NAME = "accepted.jsonl"


class Journal:
    def __init__(self, path: Path, *, epoch: str) -> None:
        self.path = path
        _cut_torn_tail(path)
        self._file = path.open("ab")
        self._end = 0
        self._lock = threading.Lock()
        self._write({"start": epoch, "t": time.time()})

    def accepted(self, records: list[Trajectory], prompts: dict[str, int]) -> None:
        self._write({"accepted": [_fields(r) for r in records], "prompts": prompts, "t": time.time()})

    def taken(self, version: int, record_ids: list[str]) -> None:
        self._write({"taken": record_ids, "version": version, "t": time.time()})

    def published(self, version: int, epoch: str) -> None:
        self._write({"published": version, "epoch": epoch, "t": time.time()})

    def offset(self) -> int:
        """Bytes written so far (every line before it is flushed); final once closed."""
        with self._lock:
            return self._end if self._file.closed else self._file.tell()

    def sync(self) -> None:
        with self._lock:
            if not self._file.closed:
                os.fsync(self._file.fileno())

    def close(self) -> None:
        """Idempotent; the learner's last checkpoint may still ask for the offset."""
        with self._lock:
            if not self._file.closed:
                self._end = self._file.tell()
                os.fsync(self._file.fileno())
                self._file.close()

    def _write(self, line: dict) -> None:
        data = _encode(line) + b"\n"  # msgspec: about 10x json's speed on records' numbers
        with self._lock:
            self._file.write(data)
            self._file.flush()


_encode = msgspec.json.Encoder().encode


def _fields(r: Trajectory) -> dict:
    """`r.to_dict()` without its deep copy (json writes tuples as lists; `from_dict` reads them)."""
    return {
        "record_id": r.record_id,
        "group_id": r.group_id,
        "prompt_ids": r.prompt_ids,
        "response_ids": r.response_ids,
        "behaviour_logprobs": r.behaviour_logprobs,
        "loss_mask": r.loss_mask,
        "reward": r.reward,
        "version": r.version,
        "metadata": r.metadata,
    }


def accepted_since(path: Path, offset: int) -> Iterator[tuple[list[Trajectory], dict[str, int]]]:
    """The batches accepted after byte `offset`, in order: (records, prompt index of each group)."""
    if not path.is_file():
        return
    with path.open("rb") as f:
        f.seek(offset)
        for line in f:
            if not line.endswith(b"\n"):
                break  # torn tail
            entry = json.loads(line)
            if "accepted" in entry:
                yield [Trajectory.from_dict(d) for d in entry["accepted"]], dict(entry["prompts"])


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
        at = size
        while at > 0:
            step = min(65536, at)
            f.seek(at - step)
            block = f.read(step)
            nl = block.rfind(b"\n")
            if nl >= 0:
                at = at - step + nl + 1
                break
            at -= step
        logger.warning("%s: cutting a torn last line (%d bytes)", path, size - at)
        f.truncate(at)


def replay(ingestion: Leases, batches: Iterator[tuple[list[Trajectory], dict[str, int]]]) -> list[Trajectory]:
    """Put the batches accepted after a checkpoint back, once its buffer and prompt queue are
    loaded. Records already seen are skipped (none is trained twice); the others go to the buffer,
    or are returned to be held while they are newer than the resumed learner (`admit_held` puts
    them in as it advances). Their prompts are done: out of the reissue queue, and the prompt
    cursor moves past them (a prompt handed out after the checkpoint but never answered is queued
    again)."""
    buffer = ingestion.buffer
    held: list[Trajectory] = []
    held_ids: set[str] = set()
    prompts: dict[str, int] = {}
    for records, batch_prompts in batches:
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
        "replayed the journal: %d groups back, %d records held until their version", len(prompts), len(held)
    )
    return held


def admit_held(buffer: ReplayBuffer, held: list[Trajectory]) -> list[Trajectory]:
    """Put held records whose version the learner has reached into the buffer; returns the rest."""
    ready = [r for r in held if r.version <= buffer.learner_version]
    if ready:
        buffer.add(ready)
    return [r for r in held if r.version > buffer.learner_version]
