"""A property-based fuzz of every endpoint the coordinator serves, over its schema (issue 12).

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

import hashlib
import http.client
import json
import math
import socket
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hostile import GROUP_SIZE, TOKEN, Door, HostileWorker, open_door
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from echo2.control import coordinator
from echo2.rollout.engine import encode_prompt

EXAMPLES = 300
"""Generated requests per endpoint (and per route of the junk-credential and after-the-run runs,
`SIDE_EXAMPLES`)."""
SIDE_EXAMPLES = 40
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
SIDE = settings(FUZZ, max_examples=SIDE_EXAMPLES)

POSTS = {
    "register": "/v1/register",
    "heartbeat": "/v1/heartbeat",
    "lease": "/v1/lease",
    "return_lease": "/v1/lease/return",
    "push": "/v1/trajectories",
    "route": "/v1/broadcast/route",
    "failure": "/v1/broadcast/failure",
    "installed": "/v1/broadcast/installed",
    "sent": "/v1/broadcast/sent",
}
GETS = [
    "/v1/snapshot",
    "/v1/snapshot/0",
    "/v1/published",
    "/v1/manifest/0",
    "/v1/chunks/0",
    "/status",
    "/metrics",
]


# ---------------------------------------------------------------------------- hostile values
NAN, INF = math.nan, math.inf
NASTY_FLOATS = [NAN, INF, -INF, 1e308, -1e308, 1e39, -1e39, 1e300, -1e300, 5e-324, -0.0, 2.0**63, 50.0, -1e30]
NASTY_INTS = [-1, -(2**31), 2**31, 2**53 + 1, 2**62 + 1, 2**63, -(2**63) - 1, 2**64, 10**30, 2**40, 10**100]
FORGED_LINE = "w\n2026-12-01 INFO echo2.learning.loop: version published: 99"
NASTY_STRINGS = [
    "",
    " ",
    "\n",
    "\r\n",
    "\x00",
    "\x1b[31mred",
    "\u2028",
    "\ud800",
    "\udcff",
    "é",
    "\U0001f642" * 8,
    "../../etc/passwd",
    "%00",
    "null",
    "NaN",
    "1e999",
    "-1",
    "0",
    "<script>alert(1)</script>",
    FORGED_LINE,
    "x" * 129,
    "x" * 70_000,
    "x" * 300_000,  # over the small-body cap of every endpoint but pushes
]


def nested(depth: int, leaf: Any = 0, kind: str = "list") -> Any:
    out = leaf
    for _ in range(depth):
        out = [out] if kind == "list" else {"a": out}
    return out


def choose(*weighted: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, each `weight` times in `sum(weights)` (hypothesis' `one_of` has its
    own preferences)."""
    table = [strategy for weight, strategy in weighted for _ in range(weight)]
    return st.sampled_from(range(len(table))).flatmap(table.__getitem__)


SCALARS = st.one_of(
    st.sampled_from([None, True, False, *NASTY_INTS, *NASTY_FLOATS, *NASTY_STRINGS]),
    st.integers(),
    st.floats(),
    st.text(max_size=16),
)
VALUES = choose(
    (6, SCALARS),
    (
        3,
        st.recursive(
            SCALARS,
            lambda inner: (
                st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
            ),
            max_leaves=6,
        ),
    ),
    (
        1,
        st.sampled_from(
            [nested(40), nested(900), nested(40, kind="dict"), nested(900, kind="dict"), [0] * 70_000]
        ),
    ),
)
"""Any JSON value a hostile worker might put where a field is expected."""
JUNK = st.one_of(
    st.binary(max_size=512),
    st.text(max_size=64).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.sampled_from(
        [
            b"",
            b"[" * 100_000,
            b"{" * 100_000,
            b'{"a":' * 50_000,
            b"[" * 990 + b"]" * 990,
            b"NaN",
            b"-Infinity",
            b"1e999999",
            b"9" * 5000,
            b"null",
            b"true",
            b'"x"',
            b"[]",
            b"\xef\xbb\xbf{}",
            b"\xff\xfe{\x00}\x00",
            b'{"worker_id": "',
            b"{}{}",
            b'{"a": 1, "a": 2}',
            b"\x00" * 16,
            b" " * 1000,
            b'{"worker_id": "\\ud800"}',
            b"x" * 300_000,
        ]
    ),
)
"""Raw bodies: no JSON, JSON that is not an object, JSON too deep or too large."""


HITS = (0, 0, 0, 1, 1, 1, 2, 3)
"""How many fields of a body are replaced or left out (one drawn)."""


def shaped(good: dict[str, st.SearchStrategy], hits: tuple[int, ...] = HITS) -> st.SearchStrategy[dict]:
    """Bodies of one endpoint's shape: up to three fields replaced by a hostile value or left out,
    the others drawn from `good` (mostly valid values, some at or past their bounds); extra keys
    now and then."""
    keys, hits_of = sorted(good), hits

    @st.composite
    def build(draw) -> dict:
        hits = draw(st.sampled_from(hits_of))
        hit = draw(st.lists(st.sampled_from(keys), min_size=min(hits, len(keys)), max_size=hits, unique=True))
        body = {}
        for key in keys:
            if key not in hit:
                body[key] = draw(good[key])
            elif draw(st.booleans()):
                body[key] = draw(VALUES)
        if draw(st.sampled_from(range(10))) == 9:  # not 0: hypothesis draws its simplest choice often
            body.update(draw(st.dictionaries(st.text(max_size=10), VALUES, min_size=1, max_size=2)))
        return body

    return build()


def mostly(valid: st.SearchStrategy, *edges: st.SearchStrategy) -> st.SearchStrategy:
    """`valid` three times in four, else one of `edges`."""
    return choose((3, valid), (1, st.one_of(*edges)))


def body_or_junk(
    good: dict[str, st.SearchStrategy], hits: tuple[int, ...] = HITS
) -> st.SearchStrategy[tuple[Any, bytes | None]]:
    """(JSON body, None) of the endpoint's shape (7 in 10) or any JSON value, or (None, raw junk)."""
    return choose(
        (7, shaped(good, hits).map(lambda b: (b, None))),
        (1, VALUES.map(lambda v: (v, None))),
        (2, JUNK.map(lambda raw: (None, raw))),
    )


def ids(me: str, *others: str) -> st.SearchStrategy[str]:
    """A worker id: mostly the caller's own, else another worker's, one nobody has, or nonsense."""
    return mostly(
        st.just(me),
        st.sampled_from([*others, "nobody", "-1", me.upper(), me + "\n", f"{me}.{me}"]),
        st.text(max_size=12),
    )


VERSIONS = mostly(st.just(0), st.integers(-2, 3), st.sampled_from(NASTY_INTS))
"""Version 0 is the door's one published version."""
RATES = mostly(st.floats(min_value=0, max_value=1e9), st.floats(), st.sampled_from(NASTY_FLOATS))
TEXTS = mostly(st.text(max_size=40), st.sampled_from(NASTY_STRINGS))


LATIN_TEXT = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=40
)
"""What a header value may hold (printable ASCII and obs-text, bytes 0x80-0xff that are no UTF-8);
other control characters are no HTTP (test_malformed_http)."""


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
                self.conn.request(method, path, body=data, headers=sent)
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
    with s.lock:
        b = s.bcast
        out.update(
            registered={k: (w.name, w.hardware, w.relay_url, w.secret_digest) for k, w in s.workers.items()},
            quarantined=sorted(s.integrity.quarantined),
            strikes=dict(s.integrity.strikes),
            kept=sorted(b.snapshots),
            plans=dict(b.plans),
            receiving={v: set(w) for v, w in b.receiving.items()},
            leaf_only={v: set(w) for v, w in b.leaf_only.items()},
            noted=dict(b.noted),
            installed_at={v: dict(w) for v, w in b.installed_at.items()},
            t_bcast={q: dict(t) for q, t in b.t_bcast.items()},
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


@pytest.fixture
def fdoor(monkeypatch: pytest.MonkeyPatch):
    """A door that quarantines no one, whose long polls last 50 ms at most."""
    monkeypatch.setattr(coordinator, "LONG_POLL_MAX", 0.05)
    d = open_door(quarantine_after=10**9)
    yield d
    d.close()


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


# ---------------------------------------------------------------------------- worker calls
def test_register(fdoor: Door):
    probe = Probe(fdoor)
    hosts = st.sampled_from(
        ["127.0.0.1", "::1", "::ffff:127.0.0.1", "[::1]", "localhost", "10.0.0.1", "169.254.169.254"]
    )
    good = {
        "name": mostly(st.just("w"), TEXTS),
        "hardware": TEXTS,
        "price_per_hour": RATES,
        "inbound": st.booleans(),
        "relay_port": mostly(st.none(), st.integers(-1, 70_000)),
        "relay_host": mostly(st.none(), hosts, st.text(alphabet="0123456789abcdef.:[]-", max_size=40)),
        "throughput": RATES,
    }

    bodies = body_or_junk(good)
    auths = st.sampled_from([f"Bearer {TOKEN}"] * 4 + [f"Bearer {TOKEN}x", "Bearer", ""])

    def one(data: st.DataObject) -> None:
        body, raw = data.draw(bodies)
        auth = data.draw(auths)
        answer, reply = probe("POST", POSTS["register"], body=body, raw=raw, auth=auth)
        if answer.status == 200:
            assert reply["credential"].startswith(reply["worker_id"] + ".")
            info = fdoor.state.workers[reply["worker_id"]]
            assert not any(ch < " " or ch == "\x7f" for ch in info.name + info.hardware), info
            assert info.relay_url is None or "127.0.0.1" in info.relay_url or "::1" in info.relay_url

    run(one)
    assert probe.accepted and probe.refused
    probe.finish()


def test_heartbeat(fdoor: Door):
    c, probe = cast(fdoor), Probe(fdoor)
    good = {"worker_id": ids(c.me, c.victim.worker_id), "version": VERSIONS, "throughput": RATES}

    bodies = body_or_junk(good)

    def one(data: st.DataObject) -> None:
        body, raw = data.draw(bodies)
        answer, reply = probe("POST", POSTS["heartbeat"], body=body, raw=raw, auth=c.auth(), who=c.me)
        if answer.status == 200:
            w = fdoor.state.workers[c.me]
            assert reply["published_version"] == 0 and -1 <= w.version <= 0
            assert math.isfinite(w.throughput) and 0 <= w.throughput <= 1e9

    run(one)
    assert probe.accepted and probe.refused
    probe.finish()


def test_lease(fdoor: Door):
    c, probe = cast(fdoor), Probe(fdoor)
    good = {
        "worker_id": ids(c.me, c.victim.worker_id),
        "version": VERSIONS,
        "max_groups": mostly(st.integers(1, 4), st.integers(-5, 5000)),
    }

    bodies = body_or_junk(good)

    def one(data: st.DataObject) -> None:
        body, raw = data.draw(bodies)
        answer, reply = probe("POST", POSTS["lease"], body=body, raw=raw, auth=c.auth(), who=c.me)
        if answer.status == 200:
            assert 1 <= len(reply["indices"]) <= fdoor.state.max_groups_per_lease
            assert fdoor.state.leases[reply["lease_id"]].worker_id == c.me
            back = {"worker_id": c.me, "lease_id": reply["lease_id"]}  # so the next one may be granted
            assert c.mallory.call("POST", POSTS["return_lease"], back)[0] == 200

    run(one)
    assert probe.accepted and probe.refused
    probe.finish()


HELD = "<held lease>"
"""Stands for the lease mallory holds at the time (a strategy is built once, the lease changes)."""


def test_return_lease(fdoor: Door):
    c, probe = cast(fdoor), Probe(fdoor)
    held: list[str] = []
    leases = mostly(st.just(HELD), st.sampled_from([c.victim_lease, "nolease", HELD + "x"]), TEXTS)
    bodies = body_or_junk({"worker_id": ids(c.me, c.victim.worker_id), "lease_id": leases})

    def one(data: st.DataObject) -> None:
        if not held:
            status, lease = c.mallory.lease(max_groups=1)
            assert status == 200, lease
            held.append(lease["lease_id"])
        body, raw = data.draw(bodies)
        if isinstance(body, dict) and body.get("lease_id") == HELD:
            body["lease_id"] = held[0]
        answer, _ = probe("POST", POSTS["return_lease"], body=body, raw=raw, auth=c.auth(), who=c.me)
        if answer.status == 200 and held[0] not in fdoor.state.leases:
            held.clear()
        assert c.victim_lease in fdoor.state.leases, "mallory returned the victim's lease"

    run(one)
    assert probe.accepted and probe.refused
    probe.finish()


INVERT = "<1 - reward>"
SHORT_INTS = st.one_of(st.integers(-(2**70), 2**70), st.integers(-3, 200))
SEMANTIC: dict[str, st.SearchStrategy] = {
    "reward": st.one_of(st.sampled_from([*NASTY_FLOATS, INVERT, 0.5, 1.0, 0.0, 1.5, -0.5]), st.floats()),
    "behaviour_logprobs": st.lists(
        st.one_of(st.sampled_from([*NASTY_FLOATS, 0.0, 1e-3, 2e-3, -1e3, -1001.0]), st.floats()),
        min_size=4,
        max_size=4,
    ).map(lambda v: ("same length", v)),
    "loss_mask": st.lists(st.sampled_from([0, 1, 2, -1, 10**6, True, 1.0]), min_size=4, max_size=4).map(
        lambda v: ("same length", v)
    ),
    "prompt_ids": st.one_of(
        st.sampled_from(["<eval prompt>", "<unleased prompt>", [5] * 70_000]),
        st.lists(SHORT_INTS, max_size=8),
    ),
    "response": st.lists(SHORT_INTS, max_size=6),
    "version": st.one_of(st.integers(0, 3), st.sampled_from(NASTY_INTS)),
    "group_id": st.one_of(st.sampled_from(["<victim group>", "g-other"]), st.text(min_size=1, max_size=8)),
    "metadata": st.one_of(
        st.sampled_from(
            [{"correct": True}, {"correct": False}, {"deep": nested(900)}, {"n": NAN}, {"k": "x" * 9000}]
        ),
        st.dictionaries(st.text(max_size=8), SCALARS, max_size=4),
    ),
}
"""Values of a record field's own type that a hostile worker might send (`<...>`: filled in when
the batch is made)."""
MUTATIONS: dict[str, st.SearchStrategy] = {
    **{name: choose((4, strategy), (1, VALUES)) for name, strategy in SEMANTIC.items()},
    "drop": st.integers(0, 8),  # a field left out
    "extra": st.dictionaries(st.text(max_size=8), VALUES, min_size=1, max_size=2),
}
"""What a record's fields may be replaced with: four times in five a value of the field's type."""
SEEDS = [
    ("reward", NAN),
    ("reward", -INF),
    ("reward", 1e39),
    ("reward", INVERT),  # a forged reward: the referee re-scores the response
    ("behaviour_logprobs", ("same length", [NAN] * 4)),
    ("behaviour_logprobs", ("same length", [50.0] * 4)),
    ("behaviour_logprobs", ("same length", [-1e30] * 4)),
    ("loss_mask", ("same length", [2] * 4)),
    ("loss_mask", ("same length", [-1] * 4)),
    ("prompt_ids", "<eval prompt>"),  # a held-out evaluation problem under a leased group
    ("prompt_ids", "<unleased prompt>"),
    ("response", [2**40]),  # out of the vocabulary: refused before the referee decodes it
    ("response", [-1, 5]),
    ("version", 999),
    ("group_id", "<victim group>"),
    ("metadata", {"deep": nested(900)}),
    ("metadata", {"correct": "forged"}),
]
"""One record's attack each, sent before the generated pushes (the attacks of issue 12)."""
RECORD_PLANS = st.tuples(
    st.integers(0, 3),  # which honest record of the lease it starts from
    st.sampled_from(["fresh", "fresh", "fresh", "fresh", "stored", "same", "text"]),  # its record id
    choose(  # a fresh id, drawn (so two honest batches are two examples), or any text
        (3, st.uuids().map(lambda u: u.hex)),
        (1, st.text(min_size=1, max_size=64)),
        (1, st.sampled_from(NASTY_STRINGS)),
    ),
    choose(
        (1, st.just(())),
        (1, st.lists(st.sampled_from(sorted(MUTATIONS)), min_size=1, max_size=2, unique=True)),
    ).flatmap(lambda names: st.tuples(*(st.tuples(st.just(n), MUTATIONS[n]) for n in names))),
)
"""How one record of a push is made: an honest record, one time in two with a field or two
replaced."""


def test_push(fdoor: Door):
    """Pushes made of the honest records for mallory's own lease, each with hostile fields."""
    c, probe = cast(fdoor), Probe(fdoor)
    task, tok = fdoor.task, fdoor.tokenizer
    held: dict[str, Any] = {}
    prompts = {
        "<eval prompt>": encode_prompt(tok, task.eval_prompts(1)[0]),  # a held-out evaluation problem
        "<unleased prompt>": encode_prompt(tok, task.train_prompt(10**6)),
    }

    def record(plan: tuple, stored: list[str]) -> dict:
        pick, id_mode, drawn_id, mutations = plan
        r = json.loads(json.dumps(held["records"][pick % len(held["records"])]))
        n = len(r["response_ids"])
        r["record_id"] = {
            "fresh": drawn_id if len(drawn_id) == 32 else uuid.uuid4().hex,
            "stored": stored[pick % len(stored)] if stored else drawn_id,
            "same": held["records"][0]["record_id"],
            "text": drawn_id,
        }[id_mode]
        for name, value in mutations:
            if name == "response" and isinstance(value, list):  # lengths agree: the referee sees it
                r.update(
                    response_ids=value, behaviour_logprobs=[-0.5] * len(value), loss_mask=[1] * len(value)
                )
            elif name == "response":
                r["response_ids"] = value
            elif name == "drop":
                r.pop(sorted(r)[value % len(r)])
            elif name == "extra":
                r.update(value)
            elif isinstance(value, tuple):  # ("same length", values)
                r[name] = value[1][:n]
            elif value == INVERT:
                r["reward"] = 1.0 - r["reward"]
            elif isinstance(value, str) and value in prompts:
                r[name] = prompts[value]
            elif value == "<victim group>":
                r[name] = c.victim_groups[0]
            else:
                r[name] = value
        return r

    good = {
        "worker_id": ids(c.me, c.victim.worker_id),
        "lease_id": mostly(st.just(HELD), st.sampled_from([c.victim_lease, "nolease"]), TEXTS),
        "records": choose(
            (8, st.lists(RECORD_PLANS, min_size=1, max_size=3).map(lambda p: ("plans", p))),
            (1, st.sampled_from([[], "<4,400 records>"])),
            (1, VALUES),
        ),
    }
    bodies = body_or_junk(good, hits=(0, 0, 0, 0, 1))  # most pushes get as far as their records

    def one(data: st.DataObject) -> None:
        push(*data.draw(bodies))

    def push(body: Any, raw: bytes | None) -> None:
        if fdoor.state.leases.get(held.get("lease_id", "")) is None:  # none yet, or completed
            lease_id, records = fdoor.honest_lease(c.mallory)
            held.update(lease_id=lease_id, records=records)
        if isinstance(body, dict):
            if body.get("lease_id") == HELD:
                body["lease_id"] = held["lease_id"]
            stored = sorted(fdoor.state.buffer._seen)[-8:]
            if isinstance(body.get("records"), tuple):
                body["records"] = [record(plan, stored) for plan in body["records"][1]]
            elif body.get("records") == "<4,400 records>":
                body["records"] = [record((i, "fresh", "", ()), stored) for i in range(4)] * 1100
        answer, reply = probe("POST", POSTS["push"], body=body, raw=raw, auth=c.auth(), who=c.me)
        if answer.status == 200:
            assert reply["accepted"] + reply["duplicates"] == len(body["records"])
            if reply["accepted"]:
                settle()

    def settle() -> None:
        """Mallory completes her lease with honest records (no group is left half stored, so the
        next pushes meet the record checks, not `group_overflow`); the learner takes what is done."""
        state = fdoor.state
        lease = state.leases.get(held["lease_id"])
        if lease is not None:
            rest = []
            for gid in sorted(lease.group_ids - lease.done_groups):
                missing = GROUP_SIZE - state.buffer.group_count(gid)
                rest += [
                    dict(r, record_id=uuid.uuid4().hex) for r in held["records"] if r["group_id"] == gid
                ][:missing]
            status, reply = c.mallory.push(held["lease_id"], rest)
            assert status == 200 and reply["accepted"] == len(rest), reply
        ready = state.buffer.num_ready_groups()
        if ready:
            taken.extend(state.take_groups(ready, timeout=5.0)[0])

    taken: list[list] = []
    for name, value in SEEDS:  # each known attack once, whatever hypothesis draws
        push(
            {"worker_id": c.me, "lease_id": HELD, "records": ("plans", [(0, "fresh", "", ((name, value),))])},
            None,
        )
    assert probe.accepted == 0 and probe.refused == len(SEEDS)
    run(one)
    assert probe.accepted and probe.refused
    for group in taken + list(fdoor.state.buffer._groups.values()):  # what was stored, the door admits
        for r in group:
            assert 0.0 <= r.reward <= 1.0 and all(-1e3 <= lp <= 1e-3 for lp in r.behaviour_logprobs)
            assert set(r.loss_mask) <= {0, 1}
            assert all(0 <= t < len(tok) for t in r.prompt_ids + r.response_ids)
    probe.finish()


# ---------------------------------------------------------------------------- broadcast calls
V0_SHA = hashlib.sha256(b"weights-v0").hexdigest()
"""Of the door's version 0."""


def test_route(fdoor: Door):
    c, probe = cast(fdoor), Probe(fdoor)
    good = {"worker_id": ids(c.me, c.victim.worker_id), "version": VERSIONS}

    bodies = body_or_junk(good)

    def one(data: st.DataObject) -> None:
        body, raw = data.draw(bodies)
        answer, reply = probe("POST", POSTS["route"], body=body, raw=raw, auth=c.auth(), who=c.me)
        if answer.status == 200:
            assert reply["version"] == 0 and reply["parent_id"] in (None, c.victim.worker_id)

    run(one)
    assert probe.accepted and probe.refused
    probe.finish()


def test_failure(fdoor: Door):
    c, probe = cast(fdoor), Probe(fdoor)
    parents = mostly(
        st.sampled_from([None, c.victim.worker_id]), st.sampled_from([c.me, "nobody", "", "x" * 129])
    )
    reasons = mostly(
        st.sampled_from(["unreachable", "stalled", "bad_chunk", "refused", "incomplete", "gone"]),
        st.sampled_from(["", "evil", "STALLED"]),
        TEXTS,
    )
    good = {
        "worker_id": ids(c.me, c.victim.worker_id),
        "version": VERSIONS,
        "parent_id": parents,
        "reason": reasons,
        "detail": mostly(TEXTS, st.just("y" * 1001)),
    }

    bodies = body_or_junk(good)

    def one(data: st.DataObject) -> None:
        body, raw = data.draw(bodies)
        probe("POST", POSTS["failure"], body=body, raw=raw, auth=c.auth(), who=c.me)

    run(one)
    assert probe.accepted and probe.refused
    probe.finish()


def transfers(*parents: str | None) -> st.SearchStrategy[list]:
    one = st.fixed_dictionaries(
        {
            "parent_id": st.sampled_from([*parents, "nobody"]),
            "bytes": mostly(st.integers(0, 2**20), st.integers(-1, 2**41), st.sampled_from(NASTY_INTS)),
            "seconds": mostly(st.floats(1e-3, 10.0), st.floats(), st.sampled_from(NASTY_FLOATS)),
        }
    )
    return mostly(
        st.lists(one, max_size=3), st.lists(one, min_size=1, max_size=1).map(lambda t: t * 257), VALUES
    )


def test_installed(fdoor: Door):
    c, probe = cast(fdoor), Probe(fdoor)
    good = {
        "worker_id": ids(c.me, c.victim.worker_id),
        "version": VERSIONS,
        "sha256": mostly(
            st.just(V0_SHA),
            st.sampled_from(["0" * 64, V0_SHA.upper(), "", "g" * 64, V0_SHA + "\n"]),
            st.text(alphabet="0123456789abcdef", max_size=70),
        ),
        "transfers": transfers(None, c.victim.worker_id, c.me),
    }

    bodies = body_or_junk(good)

    def one(data: st.DataObject) -> None:
        body, raw = data.draw(bodies)
        probe("POST", POSTS["installed"], body=body, raw=raw, auth=c.auth(), who=c.me)

    run(one)
    assert probe.accepted and probe.refused
    assert fdoor.state.bcast.stats.get(c.me) is None, "mallory's own reports moved her score"
    probe.finish()


def test_sent(fdoor: Door):
    c, probe = cast(fdoor), Probe(fdoor)
    good = {
        "worker_id": ids(c.me, c.victim.worker_id),
        "version": VERSIONS,
        "child_id": mostly(st.just(c.victim.worker_id), st.sampled_from([c.me, "", "x" * 65]), TEXTS),
        "bytes": mostly(st.integers(0, 2**20), st.integers(-1, 2**41), st.sampled_from(NASTY_INTS)),
        "seconds": mostly(st.floats(1e-3, 10.0), st.floats(), st.sampled_from(NASTY_FLOATS)),
    }

    bodies = body_or_junk(good)

    def one(data: st.DataObject) -> None:
        body, raw = data.draw(bodies)
        probe("POST", POSTS["sent"], body=body, raw=raw, auth=c.auth(), who=c.me)

    run(one)
    assert probe.accepted and probe.refused
    assert fdoor.state.bcast.stats.get(c.me) is None, "mallory's own reports moved her score"
    probe.finish()


# ---------------------------------------------------------------------------- reads
def segment(s: str) -> str:
    return urllib.parse.quote(s.encode("utf-8", "surrogatepass"), safe="")


PARAMS = st.one_of(
    st.integers(-3, 3).map(str),
    st.sampled_from(
        [str(n) for n in NASTY_INTS] + ["1e3", "0x1", "1_0", " 0", "\u0660", "inf", "nan", "-inf"]
    ),
    st.sampled_from([s for s in NASTY_STRINGS if len(s) < 1000]),
    st.text(max_size=12),
)
QUERIES = st.dictionaries(
    st.sampled_from(["after", "wait", "from", "to", "token", "x", ""]), PARAMS, max_size=3
)


def query(params: dict[str, str]) -> str:
    return "?" + "&".join(f"{segment(k)}={segment(v)}" for k, v in params.items()) if params else ""


@pytest.mark.parametrize(
    "route",
    [
        "/v1/snapshot",
        "/v1/snapshot/{}",
        "/v1/published",
        "/v1/manifest/{}",
        "/v1/chunks/{}",
        "/status",
        "/metrics",
    ],
)
def test_reads(fdoor: Door, route: str):
    """Every GET: junk path parameters and query strings, made with a worker's credential."""
    c, probe = cast(fdoor), Probe(fdoor)

    def one(data: st.DataObject) -> None:
        path = route.format(segment(data.draw(PARAMS))) if "{}" in route else route
        answer, reply = probe("GET", path + query(data.draw(QUERIES)), auth=c.auth(), who=c.me)
        if answer.status == 200 and route == "/v1/published":
            assert reply == {"version": 0}

    run(one)
    assert probe.accepted
    probe.finish()


def test_status_page(fdoor: Door):
    """GET and POST /ui (the sign-in): junk tokens in the query and the form, junk cookies; GET
    /status and /metrics with junk cookies and no bearer token."""
    probe = Probe(fdoor)
    forms = st.one_of(
        st.sampled_from(
            ["application/x-www-form-urlencoded", "multipart/form-data", "multipart/form-data; boundary=x"]
        ),
        LATIN_TEXT,
    ).map(lambda s: s.encode("latin-1"))
    requests = st.one_of(
        st.tuples(st.just("GET"), st.sampled_from(["/ui", "/status", "/metrics"]), st.none(), st.none()),
        st.tuples(
            st.just("POST"),
            st.just("/ui"),
            forms,
            st.one_of(JUNK, PARAMS.map(lambda v: b"token=" + segment(v).encode())),
        ),
    )
    cookies = st.one_of(st.none(), LATIN)

    def one(data: st.DataObject) -> None:
        method, path, form, raw = data.draw(requests)
        headers: dict[str, str | bytes] = {}
        cookie = data.draw(cookies)
        if cookie is not None:
            headers["Cookie"] = cookie
        if form is not None:
            headers["Content-Type"] = form
        probe(method, path + query(data.draw(QUERIES)), raw=raw, headers=headers, page=True)

    run(one)
    probe.finish()


# ---------------------------------------------------------------------------- credentials, methods
LATIN = st.one_of(
    LATIN_TEXT,
    st.sampled_from(["", "Bearer", "Bearer ", "Basic Zm9vOmJhcg==", "bearer " + TOKEN, "Bearer  " + TOKEN]),
).map(lambda s: s.encode("latin-1"))
"""Header values a client can send: printable ASCII and obs-text (bytes 0x80-0xff, no UTF-8)."""


HONEST_RECORD = {
    "record_id": "r",
    "group_id": "g",
    "prompt_ids": [5],
    "response_ids": [6],
    "behaviour_logprobs": [-0.5],
    "loss_mask": [1],
    "reward": 0.0,
    "version": 0,
}
"""A record of the wire's shape."""


@pytest.mark.parametrize("route", sorted(POSTS.values()) + GETS)
def test_credentials(fdoor: Door, route: str):
    """A valid request for mallory made with anything but her credential: refused, 4xx in JSON."""
    c, probe = cast(fdoor), Probe(fdoor)
    wid = c.me
    bodies = {
        "/v1/register": {"name": "sybil"},
        "/v1/heartbeat": {"worker_id": wid, "version": 0},
        "/v1/lease": {"worker_id": wid, "version": 0, "max_groups": 1},
        "/v1/lease/return": {"worker_id": wid, "lease_id": c.victim_lease},
        "/v1/trajectories": {"worker_id": wid, "lease_id": "x", "records": [HONEST_RECORD]},
        "/v1/broadcast/route": {"worker_id": wid, "version": 0},
        "/v1/broadcast/failure": {"worker_id": wid, "version": 0, "parent_id": None, "reason": "stalled"},
        "/v1/broadcast/installed": {"worker_id": wid, "version": 0, "sha256": V0_SHA},
        "/v1/broadcast/sent": {"worker_id": wid, "version": 0, "child_id": "x", "bytes": 1, "seconds": 1.0},
    }
    secret = c.mallory.secret
    forged = st.one_of(
        LATIN,
        st.sampled_from(
            [
                f"Bearer {wid}.{secret[::-1]}",
                f"Bearer {wid}.",
                f"Bearer .{secret}",
                f"Bearer nobody.{secret}",
                f"Bearer {secret}\x80",
                *(  # valid, but not for this call
                    [f"Bearer {c.victim.secret}"] + ([f"Bearer {TOKEN}"] if route != "/v1/register" else [])
                    if route in bodies
                    else []
                ),
            ]
        ).map(lambda s: s.encode("latin-1")),
        st.binary(max_size=40).map(lambda b: b"Bearer " + bytes(x for x in b if x >= 0x20 and x != 0x7F)),
    )

    def one(data: st.DataObject) -> None:
        auth = data.draw(forged)
        method = "POST" if route in bodies else "GET"
        answer, reply = probe(method, route, body=bodies.get(route), auth=auth, who=wid)
        assert answer.status in (401, 403, 404), (auth, answer)

    run(one, SIDE)
    probe.finish()


METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "PROPFIND"])
"""Methods HTTP parsers know (one they do not is refused below the app: test_malformed_http)."""
PATHS = st.one_of(
    st.sampled_from(sorted(POSTS.values()) + GETS + ["/", "/v1", "/v1/", "/v2/lease", "/ui/", "//status"]),
    st.text(max_size=20).map(lambda s: "/" + segment(s)),
    st.text(max_size=20).map(lambda s: "/v1/" + segment(s)),
)


def test_methods_and_paths(fdoor: Door):
    """Any method on any path, with the run token: a 404 or 405 in JSON where no route takes it
    (or the route's own refusal), never a 5xx."""
    probe = Probe(fdoor)

    def one(data: st.DataObject) -> None:
        method, path = data.draw(METHODS), data.draw(PATHS)
        answer, reply = probe(
            method, path, auth=f"Bearer {TOKEN}", raw=b"{}" if method != "GET" else None, page=True
        )
        if method in ("PUT", "DELETE", "PATCH", "PROPFIND") and path in POSTS.values():
            assert (answer.status, reply["error"]) == (405, "method_not_allowed")

    run(one)
    probe.finish()


MALFORMED = [
    b"FOO /v1/heartbeat HTTP/1.1\r\n\r\n",
    b"POST /v1/heartbeat HTTP/1.1\r\nAuthorization: Bearer \x01\r\n\r\n",
    b"POST /v1/heartbeat HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/heartbeat HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
    b"POST /v1/heartbeat HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET /status HTTP/9.9\r\n\r\n",
    b"GET /st\x00atus HTTP/1.1\r\n\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",  # a TLS hello to the plain-HTTP port
]
"""Bytes that are no HTTP request; `test_malformed_http` adds generated request lines and headers."""


def test_malformed_http(fdoor: Door):
    """Bytes that are no HTTP (an unknown method, a control character in a header, a bad length):
    aiohttp's parser refuses them with a 400 before the app sees them (its own plain-text answer,
    not the app's JSON), and nothing changes."""
    probe = Probe(fdoor)
    lines = st.one_of(
        st.sampled_from(MALFORMED),
        st.binary(min_size=1, max_size=40).map(
            lambda b: b"POST /v1/heartbeat HTTP/1.1\r\nX-Junk: " + b + b"\r\n\r\n"
        ),
        st.binary(min_size=1, max_size=40).map(lambda b: b + b" /status HTTP/1.1\r\n\r\n"),
    )

    def one(data: st.DataObject) -> None:
        raw = data.draw(lines)
        before = fingerprint(fdoor)
        with socket.create_connection((probe.wire.host, probe.wire.port), timeout=30) as sock:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.") else None
        assert status is None or status < 500, reply[:300]
        if status is not None and status >= 400:
            changed_nothing(before, fingerprint(fdoor), "", "")

    run(one, SIDE)
    probe.finish()


# ---------------------------------------------------------------------------- after the run
@pytest.mark.parametrize("route", sorted(POSTS.values()))
def test_after_the_run(fdoor: Door, route: str):
    """Once the run is over every worker call is answered 410 `run_finished` (or refused before
    that, 4xx in JSON), whatever its body."""
    c = cast(fdoor)
    fdoor.state.close()
    probe = Probe(fdoor)
    good = {"worker_id": ids(c.me, c.victim.worker_id), "version": VERSIONS, "name": TEXTS}

    bodies = body_or_junk(good)

    def one(data: st.DataObject) -> None:
        body, raw = data.draw(bodies)
        auth = f"Bearer {TOKEN}" if route == "/v1/register" else c.auth()
        answer, _ = probe("POST", route, body=body, raw=raw, auth=auth, who=c.me)
        assert 400 <= answer.status < 500

    run(one, SIDE)
    probe.wire.close()
