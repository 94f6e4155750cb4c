"""Small inputs, big answers: each hostile request gets a 4xx with a JSON reason, changes nothing,
and the learner keeps training."""

from __future__ import annotations

import hashlib
import logging

import pytest
from hostile import Door, HostileWorker

from echo2.broadcast.tracker import BroadcastPolicy, BroadcastState, Peer


def test_a_lease_for_an_unpublished_version_is_refused(door: Door, mallory: HostileWorker):
    before = door.snapshot()
    status, body = mallory.lease(version=999)
    assert (status, body["error"]) == (422, "future_version"), body
    door.invariant(before, None)


def test_100000_nested_brackets_get_a_400(door: Door, mallory: HostileWorker):
    before = door.snapshot()
    for path in ("/v1/trajectories", "/v1/heartbeat", "/v1/register"):
        status, body = mallory.call("POST", path, raw=b"[" * 100_000)
        assert (status, body["error"]) == (400, "malformed"), body
    door.invariant(before, "malformed", count=1)  # one unparsable push counts once


@pytest.mark.parametrize(
    ("method", "path", "status", "reason"),
    [
        ("GET", "/v1/nothing-here", 404, "not_found"),
        ("POST", "/status", 405, "method_not_allowed"),
        ("GET", "/v1/lease", 405, "method_not_allowed"),
    ],
)
def test_404_and_405_answer_in_json(door: Door, mallory: HostileWorker, method, path, status, reason):
    before = door.snapshot()
    got, body = mallory.call(method, path, {} if method == "POST" else None)
    assert isinstance(body, dict), f"not JSON: {body!r}"
    assert (got, body["error"]) == (status, reason) and body["detail"]
    door.invariant(before, None)


def test_a_name_with_a_newline_is_refused(door: Door):
    before = door.snapshot()
    forged = "w\n2026-12-01 INFO echo2.learning.loop: version published: 99"
    for field in ("name", "hardware"):
        status, body = HostileWorker(door.url, "").call("POST", "/v1/register", {"name": "w", field: forged})
        assert (status, body["error"]) == (422, "malformed"), body
    door.invariant(before, None)


def test_a_failure_detail_with_a_newline_writes_one_log_line(
    door: Door, mallory: HostileWorker, caplog: pytest.LogCaptureFixture
):
    body = {
        "worker_id": mallory.worker_id,
        "version": 0,
        "parent_id": None,
        "reason": "stalled",
        "detail": "slow\n2026-12-01 INFO echo2.coordinator.state: worker quarantined: honest",
    }
    with caplog.at_level(logging.INFO, logger="echo2"):
        assert mallory.call("POST", "/v1/broadcast/failure", body)[0] == 200
    lines = [r.getMessage() for r in caplog.records if "reports parent" in r.getMessage()]
    assert lines and all("\n" not in line for line in lines)


def test_an_impossible_transfer_report_is_refused(door: Door, mallory: HostileWorker):
    """2^40 bytes in 5e-324 s: refused at the door; the next publication plans as before."""
    before = door.snapshot()
    report = {
        "worker_id": mallory.worker_id,
        "version": 0,
        "sha256": hashlib.sha256(b"weights-v0").hexdigest(),
        "transfers": [{"parent_id": None, "bytes": 2**40, "seconds": 5e-324}],
    }
    status, body = mallory.call("POST", "/v1/broadcast/installed", report)
    assert (status, body["error"]) == (422, "malformed"), body
    door.invariant(before, None)
    door.state.publisher.publish(1, b"weights-v1", keep=2)  # the chain count reads the measured rates


def test_the_chain_count_survives_an_infinite_rate():
    """The consumer does not trust the door alone: an infinite measured rate plans one chain."""
    bcast = BroadcastState(BroadcastPolicy(uplink_budget_bps=None))  # B0 unlimited: inf / inf
    peers = {w: Peer(worker_id=w, relay_url=f"http://{w}:1", registered_at=0.0) for w in ("a", "b")}
    bcast.credits.rates.append(float("inf"))
    plan = bcast.make_plan(peers, 0.0)
    assert sorted(w for chain in plan.chains for w in chain) == ["a", "b"]
