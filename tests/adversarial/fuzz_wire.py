"""The endpoint fuzz's wire and judge (test_fuzz_*.py): one keep-alive HTTP/1.1 connection to a
real `Coordinator`, the checks every answer must pass, and the state fingerprint that shows a
refusal changed nothing but its refusal counter and strikes.

What every fuzz run (test_fuzz_worker.py, test_fuzz_broadcast.py, test_fuzz_http.py) checks:

Hypothesis generates requests for each endpoint: bodies of the endpoint's own shape whose fields are
good, hostile (NaN, infinities, huge and negative numbers, wrong types, long strings, nesting, control
characters and lone surrogates, other workers' ids) or missing, with extra keys now and then; raw
bodies that are no JSON at all, or JSON too deep or too large; junk query strings, path parameters,
credentials, cookies and methods. Each goes through a real `Coordinator` on 127.0.0.1 (port 0), as a
registered hostile worker, over one keep-alive connection. Every answer must be:

- never a 5xx;
- when an error (4xx), a JSON object with a non-empty `error` reason and a `detail` (the one
  exception: the status page's sign-in form, an HTML page for people, `/ui`);
- when a refusal, a change of nothing but the refusal counter of the reason it was answered with
  (only pushes count refusals) and the strikes against the worker that sent it.

After each endpoint's run, `door.invariant` holds: nothing changed since the last accepted request,
every weight is finite and the learner still trains on an honest batch.

The doors here quarantine no one (`quarantine_after` huge): the quarantine after a third strike puts
the worker's leases back, a change the refusal check would rightly see, and quarantine has tests of
its own (test_learner_checks.py). What the fuzz looks for is what the door lets through.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fuzz_values import (
    FUZZ,
)
from hostile import TOKEN, Door, HostileWorker
from hypothesis import given, settings
from hypothesis import strategies as st


# ---------------------------------------------------------------------------- the wire
@dataclass
class Answer:
    status: int
    content_type: str
    payload: bytes


class Wire:
    """One keep-alive HTTP/1.1 connection to the door (opened again when the server closed it)."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.conn: http.client.HTTPConnection | None = None

    def send(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        raw: bytes | None = None,
        auth: str | bytes | None = None,
        headers: dict[str, str | bytes] | None = None,
    ) -> Answer:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        sent = dict(headers or {})
        if auth is not None:
            sent["Authorization"] = auth
        if data is not None:
            sent.setdefault("Content-Type", "application/json")
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            try:
                try:
                    self.conn.request(method, path, body=data, headers=sent)
                except (BrokenPipeError, ConnectionResetError):
                    # The door may refuse before it reads the whole body (lingering_time 0: it answers
                    # and closes). Its answer is then already on the socket: read it, as curl does.
                    # Only a loaded machine saw it: on an idle one the body is written before the
                    # door reads the headers.
                    pass
                resp = self.conn.getresponse()
                payload = resp.read()
            except (http.client.HTTPException, OSError):
                self.close()
                if attempt:
                    raise
                continue
            if resp.will_close:
                self.close()
            return Answer(resp.status, resp.getheader("Content-Type", ""), payload)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def judged(answer: Answer, method: str = "POST", *, page: bool = False) -> Any:
    """The answer's JSON body (None for a 2xx that is not JSON), after the rules every answer keeps."""
    assert answer.status < 500, f"{answer.status}: {answer.payload[:400]!r}"
    is_json = answer.content_type.startswith("application/json")
    if (
        answer.status >= 400
        and method != "HEAD"
        and not (page and answer.content_type.startswith("text/html"))
    ):
        assert is_json, f"{answer.status} {answer.content_type}: {answer.payload[:200]!r} is not JSON"
        body = json.loads(answer.payload)
        assert isinstance(body, dict), body
        assert isinstance(body.get("error"), str) and body["error"], body
        assert isinstance(body.get("detail"), str), body
        return body
    return json.loads(answer.payload) if is_json and answer.payload else None


# ---------------------------------------------------------------------------- the state
def fingerprint(door: Door) -> dict[str, Any]:
    """`door.snapshot()` and the rest a refused request must leave alone: who is registered (and
    with which credential, relay and name), quarantine, and the broadcast bookkeeping."""
    out = door.snapshot()
    s = door.state
    with s.shared.lock:
        b = s.publisher.bcast
        out.update(
            registered={k: (w.name, w.hardware, w.relay_url, w.secret_digest) for k, w in s.registry.workers.items()},
            quarantined=sorted(s.intake.integrity.quarantined),
            strikes=dict(s.intake.integrity.strikes),
            kept=sorted(b.snapshots),
            plans=dict(b.plans),
            receiving={v: set(w) for v, w in b.receiving.items()},
            leaf_only={v: set(w) for v, w in b.leaf_only.items()},
            noted=dict(b.installs.noted),
            installed_at={v: dict(w) for v, w in b.installs.installed_at.items()},
            t_bcast={q: dict(t) for q, t in b.installs.t_bcast.items()},
            failures=dict(b.failures),
            stats={
                w: (p.successes, p.failures, p.consecutive_failures, tuple(p.rates))
                for w, p in b.stats.items()
            },
            ledger=(
                dict(b.ledger.routed),
                {k: (a.bytes, a.seconds) for k, a in b.ledger.sender.items()},
                {k: (a.bytes, a.seconds) for k, a in b.ledger.receiver.items()},
                set(b.ledger.credited),
                dict(b.ledger.outcomes),
            ),
            bytes_served=b.bytes_served,
        )
    return out


def changed_nothing(before: dict[str, Any], after: dict[str, Any], reason: str, who: str) -> None:
    """A refusal answered with `reason` changed nothing but its own refusal counter and the strikes
    against `who`, the worker that sent it."""
    before, after = dict(before), dict(after)
    rb, ra = before.pop("rejected"), after.pop("rejected")
    sb, sa = before.pop("strikes"), after.pop("strikes")
    assert after == before, "a refused request changed the state: " + ", ".join(
        k for k in after if after[k] != before.get(k)
    )
    counters = {k for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)}
    assert counters <= {reason}, f"answered {reason!r}, counted {counters}"
    struck = {k for k in sa.keys() | sb.keys() if sa.get(k) != sb.get(k)}
    assert struck <= {who}, f"a refusal of {who}'s request struck {struck}"


class Probe:
    """Sends one request and checks its answer against the state before and after."""

    def __init__(self, door: Door) -> None:
        self.door = door
        self.wire = Wire(door.url)
        self.refused = self.accepted = 0

    def __call__(
        self, method: str, path: str, *, who: str = "", page: bool = False, **kw: Any
    ) -> tuple[Answer, Any]:
        before = fingerprint(self.door)
        answer = self.wire.send(method, path, **kw)
        body = judged(answer, method, page=page)
        if answer.status >= 400:
            self.refused += 1
            reason = body["error"] if isinstance(body, dict) else ""
            changed_nothing(before, fingerprint(self.door), reason, who)
        else:
            self.accepted += 1
            if answer.content_type.startswith("application/octet-stream"):
                # a stream's handler accounts for it after its last byte went out: the next request
                # on this connection is read only once that handler returned
                self.wire.send("GET", "/v1/published?after=-1&wait=0", auth=f"Bearer {TOKEN}")
        return answer, body

    def finish(self) -> None:
        """The door's invariant after the run: weights finite, the learner still trains."""
        self.wire.close()
        self.door.invariant(self.door.snapshot(), None)


@dataclass
class Cast:
    """Mallory and the honest victim whose ids and lease she tries, as the fuzz sees them."""

    mallory: HostileWorker
    victim: HostileWorker
    victim_lease: str
    victim_groups: list[str]

    @property
    def me(self) -> str:
        return self.mallory.worker_id

    def auth(self) -> str:
        return f"Bearer {self.mallory.secret}"


def cast(door: Door) -> Cast:
    mallory, victim = HostileWorker(door.url), HostileWorker(door.url, "victim")
    status, lease = victim.lease(max_groups=1)
    assert status == 200, lease
    return Cast(
        mallory, victim, lease["lease_id"], [door.task.train_prompt(i).group_id for i in lease["indices"]]
    )


def run(test: Callable[[st.DataObject], None], config: settings = FUZZ) -> None:
    """Run `test` under hypothesis, one generated input per call."""
    config(given(data=st.data())(test))()
