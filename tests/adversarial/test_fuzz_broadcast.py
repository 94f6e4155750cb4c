"""The endpoint fuzz (issue 12), broadcast calls (route, failure, installed, sent) and reads.

What every answer must be, and the invariant after each run: fuzz_wire.py.
"""

from __future__ import annotations

import pytest
from fuzz_values import (
    JUNK,
    LATIN,
    LATIN_TEXT,
    NASTY_FLOATS,
    NASTY_INTS,
    NASTY_STRINGS,
    POSTS,
    TEXTS,
    V0_SHA,
    VALUES,
    VERSIONS,
    body_or_junk,
    ids,
    mostly,
    segment,
)
from fuzz_wire import (
    Probe,
    cast,
    run,
)
from hostile import Door
from hypothesis import strategies as st

# ---------------------------------------------------------------------------- broadcast calls


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
    assert fdoor.state.publisher.bcast.stats.get(c.me) is None, "mallory's own reports moved her score"
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
    assert fdoor.state.publisher.bcast.stats.get(c.me) is None, "mallory's own reports moved her score"
    probe.finish()


# ---------------------------------------------------------------------------- reads


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
