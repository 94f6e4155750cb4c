"""The endpoint fuzz (issue 12): credentials, methods and paths, malformed HTTP, after the run.

What every answer must be, and the invariant after each run: fuzz_wire.py.
"""

from __future__ import annotations

import socket

import pytest
from fuzz_values import (
    GETS,
    LATIN,
    POSTS,
    SIDE,
    TEXTS,
    V0_SHA,
    VERSIONS,
    body_or_junk,
    ids,
    segment,
)
from fuzz_wire import (
    Probe,
    cast,
    changed_nothing,
    fingerprint,
    run,
)
from hostile import TOKEN, Door
from hypothesis import strategies as st

# ---------------------------------------------------------------------------- credentials, methods


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
