"""The coordinator over real loopback HTTP, as tests/net's coordinator tests drive it: `coord` (a
fixture, in tests/net/conftest.py: a started `Coordinator` on port 0 over `support.make_state`, its
state and fake clock), `call` (one request, with a registered worker's credential), `register`,
`record`, `leased` and `snapshot` (what a refused request must leave unchanged)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from support import FakeClock, make_state

from echo2.coordinator.server import Coordinator

TOKEN = "secret-token"
CREDENTIALS: dict[str, str] = {}
"""Worker id -> the credential its registration returned (calls made as it carry it)."""


def started_coordinator():
    clock = FakeClock()
    state = make_state(clock)
    server = Coordinator(state, token=TOKEN, run_info={}, heartbeat_interval=1.0, max_body=200_000)
    server.start()
    yield server, state, clock
    server.stop()
    server.stop()  # idempotent


def call(server, method, path, body=None, *, token=TOKEN, raw: bytes | None = None):
    """One request; a body naming a registered worker goes with that worker's credential."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    if raw is not None and body is None:
        try:
            body = json.loads(raw)
        except ValueError:
            pass
    if token == TOKEN and isinstance(body, dict) and body.get("worker_id") in CREDENTIALS:
        token = CREDENTIALS[body["worker_id"]]
    req = urllib.request.Request(server.url + path, data=data, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            payload = resp.read()
            return resp.status, (json.loads(payload) if payload else None)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def register(server, name="w"):
    status, body = call(server, "POST", "/v1/register", {"name": name, "price_per_hour": 0.5})
    assert status == 200
    CREDENTIALS[body["worker_id"]] = body["credential"]
    return body["worker_id"]


def record(gid, rid, *, version=0, prompt=(1, 2), response=(3, 4), reward=1.0, **extra):
    return {
        "record_id": rid,
        "group_id": gid,
        "prompt_ids": list(prompt),
        "response_ids": list(response),
        "behaviour_logprobs": [-0.1] * len(response),
        "loss_mask": [1] * len(response),
        "reward": reward,
        "version": version,
        **extra,
    }


def leased(server, state, wid, groups=1):
    state.publisher.publish(0, b"weights-v0", keep=2)
    status, lease = call(server, "POST", "/v1/lease", {"worker_id": wid, "version": 0, "max_groups": groups})
    assert status == 200
    return lease


def snapshot(state):
    return (
        len(state.intake.buffer),
        state.intake.buffer.contents_by_version(),
        state.intake.ingestion.accepted,
        sorted(state.intake.buffer._seen),
    )
