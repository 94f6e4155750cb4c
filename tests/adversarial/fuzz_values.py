"""Hostile values and request shapes for the endpoint fuzz (test_fuzz_*.py): NaN, infinities,
huge and negative numbers, wrong types, long strings, nesting, control characters and lone
surrogates, and bodies of an endpoint's own shape whose fields are good, hostile or missing."""

from __future__ import annotations

import hashlib
import math
import urllib.parse
from typing import Any

from hostile import TOKEN
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

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


V0_SHA = hashlib.sha256(b"weights-v0").hexdigest()
"""Of the door's version 0."""


def segment(s: str) -> str:
    return urllib.parse.quote(s.encode("utf-8", "surrogatepass"), safe="")


LATIN = st.one_of(
    LATIN_TEXT,
    st.sampled_from(["", "Bearer", "Bearer ", "Basic Zm9vOmJhcg==", "bearer " + TOKEN, "Bearer  " + TOKEN]),
).map(lambda s: s.encode("latin-1"))
"""Header values a client can send: printable ASCII and obs-text (bytes 0x80-0xff, no UTF-8)."""
