"""A push's body as records, without holding the coordinator's GIL for long.

pydantic parses a JSON body into a tree in one C call before it validates it, and the items past a
list's bound are walked in that call too: a 61 MiB push held the GIL for seconds, and with it the
event loop that answers heartbeats. So a body over `IN_THREAD` bytes is parsed, checked against the
wire models and made into `Trajectory`s in a parser process (`Parser`: one per coordinator, started
on the first such push, spoken to over pipes), which sends the records back one pickle each, so the
coordinator's ingest thread unpickles them in short calls the interpreter switches between. A
smaller body (a quickstart push of 4 groups is about 17 KiB) is parsed in the ingest thread itself,
as before: a process hop would cost it more than its parse. Either way the same `parse_body` runs
and every refusal reads as it always did.

Run as `python -m echo2.coordinator.pushparse` it is that parser process; it imports no aiohttp.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
from typing import BinaryIO

from pydantic import ValidationError

from echo2.records import Trajectory, invalid_in
from echo2.wire import errors, validate
from echo2.wire.errors import Forbidden, Reason, Unreadable
from echo2.wire.protocol import PushRequest

IN_THREAD = 32 * 1024
"""Bytes of a push body parsed in the ingest thread; a larger one goes to the parser process. A
body this size holds the GIL at most tens of milliseconds, whatever it holds (about 11,000 empty
records: 60 ms)."""
_FRAME = struct.Struct("<Q")
READY = b"ready"
NICE = 10
"""The parser process's niceness: under contention for the CPU the coordinator's own process (its
event loop, the learner) comes first, and its start (about a second of imports) steals little."""
_NICE_MAIN = f"import os; os.nice({NICE}); from echo2.coordinator.pushparse import main; main()"


def parse_body(raw: bytes, model, worker: str | None, *, direct: bool = False):
    """`raw` as `model`, made as `worker` if the model names one. Blocking (a large push takes a
    while): the coordinator calls it off its event loop for pushes, `direct`ly (pydantic parses
    the JSON itself, about 4x faster than `json.loads` and then validating a push's dicts; a body
    its parser refuses is read again the usual way, so every refusal reads as it always did)."""
    req = None
    if direct:
        try:
            req = model.model_validate_json(raw)
        except ValidationError as e:
            if e.errors()[0]["type"] not in ("json_invalid", "recursion_loop"):
                raise
    if req is None:
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise Unreadable(f"body is not JSON: {validate.printable(e)}") from None
        except RecursionError:
            raise Unreadable("body is nested too deep") from None
        req = model.model_validate(data)
    if "worker_id" in model.model_fields and req.worker_id != worker:
        raise Forbidden(f"this credential is not worker {validate.printable(req.worker_id)!r}'s")
    return req


def malformed(e: ValidationError) -> errors.Invalid:
    """The refusal of a body that does not validate (the guard's answer to a ValidationError)."""
    err = e.errors(include_url=False, include_input=False)[0]
    return errors.Invalid(Reason.MALFORMED, f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}")


def outcome(raw: bytes, worker: str, tag: dict[str, str]) -> tuple:
    """What a push's body is, in plain values: ("ok", lease_id, n, records) with the records as the
    `Trajectory`s pydantic made of the body (their metadata carrying `tag`, the coordinator's own
    word on who generated them), or a refusal: ("malformed" | "unreadable" | "forbidden", detail),
    ("invalid", reason, detail, n) for a record `Trajectory` itself refuses (lengths, a NaN reward)."""
    try:
        req = parse_body(raw, PushRequest, worker, direct=True)
    except ValidationError as e:
        if (bad := invalid_in(e.errors())) is not None:
            return ("invalid", bad.reason, validate.printable(bad), _count_records(raw))
        return ("malformed", malformed(e).detail)
    except Unreadable as e:
        return ("unreadable", e.detail)
    except Forbidden as e:
        return ("forbidden", e.detail)
    for i, r in enumerate(req.records):
        if (problem := validate.metadata_problem(r.metadata)) is not None:
            return ("malformed", f"records.{i}.metadata: {problem}")
    for r in req.records:
        r.metadata.update(tag)  # the record's own dict, fresh from the parse
    return ("ok", req.lease_id, len(req.records), req.records)


def _count_records(raw: bytes) -> int:
    """The records of a body that parsed but holds one `Trajectory` refuses (the refusal counts
    them all, as a batch is refused whole)."""
    try:
        return len(json.loads(raw)["records"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return 1


def records_of(result: tuple, intake, worker: str | None) -> tuple[str, list[Trajectory]]:
    """The lease and records of an "ok" `outcome`; a refusal is counted in `intake` as the door
    counts it (a body that does not parse once, as malformed; a record `Trajectory` refuses under its
    reason, a strike) and raised."""
    kind, *rest = result
    if kind == "ok":
        return rest[0], rest[2]
    if kind in ("malformed", "unreadable"):
        intake.count_rejected(Reason.MALFORMED, 1)
        raise errors.Invalid(Reason.MALFORMED, rest[0]) if kind == "malformed" else Unreadable(rest[0])
    if kind == "forbidden":
        raise Forbidden(rest[0])
    intake.refuse(worker, rest[0], rest[2])  # lengths disagree, a non-finite reward
    raise errors.InvalidBatch(rest[0], rest[1])


# ---------------------------------------------------------------------------- the parser process
def _write(out: BinaryIO, payload: bytes) -> None:
    out.write(_FRAME.pack(len(payload)))
    out.write(payload)
    out.flush()


def _read(inp: BinaryIO) -> bytes:
    head = inp.read(_FRAME.size)
    if len(head) < _FRAME.size:
        raise EOFError("the parser process closed its pipe")
    size = _FRAME.unpack(head)[0]
    payload = inp.read(size)
    if len(payload) < size:
        raise EOFError("the parser process closed its pipe")
    return payload


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """The parser process: says READY, then takes a frame of (worker, tag) as JSON and the body's
    frame, and answers the body's `outcome`, pickled, with an "ok" one's records pickled one by one."""
    _write(out, READY)
    while True:
        try:
            worker, tag = json.loads(_read(inp))
            raw = _read(inp)
        except EOFError:
            return
        result = outcome(raw, worker, tag)
        if result[0] == "ok":
            result = (*result[:3], [pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL) for r in result[3]])
        _write(out, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))


class Parser:
    """The coordinator's parser process, started by `start` (the coordinator's first registration:
    every push comes from a registered worker) or the first large push, and again after it dies; one
    push at a time (the coordinator's one ingest thread calls `outcome`)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._ready = False
        self._lock = threading.Lock()

    def outcome(self, raw: bytes, worker: str | None, tag: dict[str, str]) -> tuple | None:
        """`outcome(raw, worker, tag)`, computed in the parser process; None while that process is
        still starting (about a second: the caller parses the body itself meanwhile)."""
        with self._lock:
            if not self._started() or (proc := self._proc) is None:  # None: closed meanwhile
                return None
            try:
                _write(proc.stdin, json.dumps([worker, tag]).encode())
                _write(proc.stdin, raw)
                result = pickle.loads(_read(proc.stdout))
            except (OSError, EOFError):  # it died (out of memory, killed): the next push starts another
                proc.kill()
                self._proc = None
                raise RuntimeError("the push parser process died") from None
        if result[0] == "ok":  # one record per call: the event loop's thread gets the GIL between them
            result = (*result[:3], [pickle.loads(b) for b in result[3]])
        return result

    def start(self) -> None:
        """Start the process if it is not running (it takes about a second to be ready). Never
        waits: while a push is being parsed the process runs."""
        if self._lock.acquire(blocking=False):
            try:
                self._started()
            finally:
                self._lock.release()

    def _started(self) -> bool:
        """Whether the process is up and has said so (its first frame); starts it if it is not."""
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(  # its own session: a terminal's ^C is the parent's
                [sys.executable, "-c", _NICE_MAIN],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                start_new_session=True,
            )
            self._ready = False
        if not self._ready and select.select([self._proc.stdout], [], [], 0)[0]:
            try:
                self._ready = _read(self._proc.stdout) == READY
            except EOFError:  # it died starting: started again on the next push
                self._proc.kill()
        return self._ready

    def close(self) -> None:
        """Stop the process (a push it is parsing meanwhile fails with a 500)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()


def main() -> None:
    """The frames go over a private copy of stdout; whatever prints goes to stderr instead. Ends
    when the coordinator closes its end (it stopped, or its process died)."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        serve(sys.stdin.buffer, out)
    except (BrokenPipeError, KeyboardInterrupt):
        pass


if __name__ == "__main__":
    main()
