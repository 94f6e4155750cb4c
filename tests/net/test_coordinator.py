"""The coordinator over real loopback HTTP (port 0): auth, leases, idempotent ingestion, and a 4xx
with a reason for every kind of bad request, leaving the buffer exactly as it was."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from coordinator_http import CREDENTIALS, TOKEN, call, leased, record, register, snapshot


def test_register_requires_the_token(coord):
    server, state, _ = coord
    for token in (None, "wrong"):
        status, body = call(server, "POST", "/v1/register", {"name": "w"}, token=token)
        assert status == 401 and body["error"] == "unauthorized"
    assert state.registry.workers == {}
    assert call(server, "GET", "/status", token=None)[0] == 401


def test_lease_push_and_idempotent_retry(coord):
    server, state, _ = coord
    wid = register(server)
    assert call(server, "POST", "/v1/lease", {"worker_id": wid, "version": 0, "max_groups": 1})[0] == 204
    state.publisher.publish(0, b"weights-v0", keep=2)
    # a worker that has installed nothing gets no lease, even when S would admit version -1
    assert call(server, "POST", "/v1/lease", {"worker_id": wid, "version": -1, "max_groups": 1})[0] == 204
    lease = leased(server, state, wid)
    assert lease["indices"] == [0] and lease["deadline_s"] == pytest.approx(30.0)
    batch = {
        "worker_id": wid,
        "lease_id": lease["lease_id"],
        "records": [record("g0", "a"), record("g0", "b")],
    }
    assert call(server, "POST", "/v1/trajectories", batch) == (200, {"accepted": 2, "duplicates": 0})
    assert call(server, "POST", "/v1/trajectories", batch) == (200, {"accepted": 0, "duplicates": 2})
    assert (
        len(state.intake.buffer) == 2
        and state.intake.ingestion.accepted == 2
        and state.intake.buffer.num_ready_groups() == 1
    )
    assert state.intake.ingestion.leases == {}, "a lease whose groups are all complete is closed"
    status, body = call(server, "GET", "/status")
    assert status == 200 and body["workers"][0]["state"] == "active" and body["buffer_by_version"] == {"0": 2}


def test_heartbeat_and_manifest_and_snapshot(coord):
    server, state, _ = coord
    wid = register(server)
    assert call(server, "GET", "/v1/snapshot")[0] == 404
    state.publisher.publish(0, b"weights-v0", keep=2)
    status, manifest = call(server, "GET", "/v1/snapshot")
    assert status == 200 and manifest["version"] == 0 and manifest["size"] == 10
    req = urllib.request.Request(server.url + "/v1/snapshot/0", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.read() == b"weights-v0"
    assert (
        call(server, "POST", "/v1/heartbeat", {"worker_id": wid, "version": 0, "throughput": 3.0})[0] == 200
    )
    assert state.registry.workers[wid].throughput == 3.0
    assert call(server, "GET", "/v1/snapshot/7")[0] == 404
    assert call(server, "GET", "/v1/snapshot/x")[0] == 400


@pytest.mark.parametrize(
    ("records", "status", "reason"),
    [
        ([record("g0", "a", response=(3, 400))], 422, "out_of_vocab"),
        ([record("g0", "a", prompt=(-1, 2))], 422, "out_of_vocab"),
        ([record("g0", "a", version=5)], 422, "future_version"),
        ([record("g0", "a", response=(1, 2, 3, 4, 5))], 422, "too_long"),
        ([record("g9", "a")], 422, "wrong_group"),
        ([record("g0", "a"), record("g0", "b"), record("g0", "c")], 422, "group_overflow"),
        ([record("g0", "a", reward=float("nan"))], 422, "non_finite_reward"),
        ([{**record("g0", "a"), "loss_mask": [1]}], 422, "malformed"),
        ([{**record("g0", "a"), "extra_field": 1}], 422, "malformed"),
        ([{k: v for k, v in record("g0", "a").items() if k != "reward"}], 422, "malformed"),
        ([record("g0", "ok"), record("g0", "bad", response=(3, 999))], 422, "out_of_vocab"),
    ],
)
def test_bad_pushes_get_4xx_and_change_nothing(coord, records, status, reason):
    server, state, _ = coord
    wid = register(server)
    lease = leased(server, state, wid)
    before = snapshot(state)
    body = {"worker_id": wid, "lease_id": lease["lease_id"], "records": records}
    raw = json.dumps(body, allow_nan=True).encode()
    got_status, got = call(server, "POST", "/v1/trajectories", raw=raw)
    assert (got_status, got["error"]) == (status, reason) and got["detail"]
    assert snapshot(state) == before
    assert state.intake.ingestion.rejected[reason] >= 1


def test_stale_records_are_rejected_and_their_prompts_reissued(coord):
    server, state, _ = coord
    wid = register(server)
    lease = leased(server, state, wid)
    state.publisher.publish(1, b"v1", keep=2)
    state.publisher.publish(2, b"v2", keep=2)
    state.intake.set_learner_version(2)  # v - S = 1 > 0
    before = snapshot(state)
    body = {"worker_id": wid, "lease_id": lease["lease_id"], "records": [record("g0", "a")]}
    status, got = call(server, "POST", "/v1/trajectories", body)
    assert (status, got["error"]) == (409, "stale") and snapshot(state) == before
    assert list(state.intake.ingestion.reissue) == [0]
    # a worker still on version 0 gets no lease until it installs a newer snapshot
    assert call(server, "POST", "/v1/lease", {"worker_id": wid, "version": 0, "max_groups": 1})[0] == 204
    status, again = call(server, "POST", "/v1/lease", {"worker_id": wid, "version": 2, "max_groups": 1})
    assert status == 200 and again["indices"] == [0]


@pytest.mark.parametrize(
    ("path", "body", "status", "reason"),
    [
        ("/v1/register", {}, 422, "malformed"),
        ("/v1/register", {"name": "w", "price_per_hour": -1}, 422, "malformed"),
        ("/v1/register", {"name": "w", "colour": "red"}, 422, "malformed"),
        ("/v1/heartbeat", {"worker_id": "nobody", "version": 0}, 403, "forbidden"),
        ("/v1/heartbeat", {"worker_id": "W", "version": 9}, 422, "future_version"),
        ("/v1/heartbeat", {"worker_id": "W", "version": "x"}, 422, "malformed"),
        ("/v1/lease", {"worker_id": "W", "version": 0, "max_groups": 0}, 422, "malformed"),
        ("/v1/lease", {"worker_id": "nobody", "version": 0, "max_groups": 1}, 403, "forbidden"),
        (
            "/v1/trajectories",
            {"worker_id": "W", "lease_id": "nope", "records": [record("g0", "a")]},
            409,
            "lease_expired",
        ),
        ("/v1/trajectories", {"worker_id": "W", "lease_id": "L", "records": []}, 422, "malformed"),
        ("/v1/lease/return", {"worker_id": "W", "lease_id": "L", "x": 1}, 422, "malformed"),
    ],
)
def test_bad_requests_to_every_endpoint(coord, path, body, status, reason):
    server, state, _ = coord
    wid = register(server)
    state.publisher.publish(0, b"v0", keep=2)
    body = json.loads(json.dumps(body).replace('"W"', json.dumps(wid)))
    workers_before = {k: (v.version, v.throughput, v.status) for k, v in state.registry.workers.items()}
    before = snapshot(state)
    got_status, got = call(server, "POST", path, body)
    assert (got_status, got["error"]) == (status, reason), got
    assert snapshot(state) == before and len(state.intake.ingestion.leases) == 0
    assert {
        k: (v.version, v.throughput, v.status) for k, v in state.registry.workers.items()
    } == workers_before


def test_not_json_and_oversized_bodies(coord):
    server, state, _ = coord
    wid = register(server)
    before = snapshot(state)
    status, got = call(server, "POST", "/v1/trajectories", raw=b"{not json", token=CREDENTIALS[wid])
    assert (status, got["error"]) == (400, "malformed")
    status, got = call(server, "POST", "/v1/trajectories", raw=b"x" * 300_000, token=CREDENTIALS[wid])
    assert (status, got["error"]) == (413, "too_large")
    assert snapshot(state) == before


def test_expired_lease_is_reissued_and_late_result_dropped(coord):
    server, state, clock = coord
    slow, fast = register(server, "slow"), register(server, "fast")
    lease = leased(server, state, slow)
    clock.now += 31  # past the lease deadline
    for wid in (slow, fast):  # both alive, only the lease is late
        call(server, "POST", "/v1/heartbeat", {"worker_id": wid, "version": 0})
    state.expire()
    status, other = call(server, "POST", "/v1/lease", {"worker_id": fast, "version": 0, "max_groups": 1})
    assert status == 200 and other["indices"] == lease["indices"]
    late = {
        "worker_id": slow,
        "lease_id": lease["lease_id"],
        "records": [record("g0", "a"), record("g0", "b")],
    }
    status, got = call(server, "POST", "/v1/trajectories", late)
    assert (status, got["error"]) == (409, "lease_expired") and len(state.intake.buffer) == 0
    good = {
        "worker_id": fast,
        "lease_id": other["lease_id"],
        "records": [record("g0", "c"), record("g0", "d")],
    }
    assert call(server, "POST", "/v1/trajectories", good)[0] == 200
    assert len(state.intake.buffer) == 2


def test_silent_worker_is_lost_and_its_lease_reissued(coord):
    server, state, clock = coord
    wid = register(server)
    lease = leased(server, state, wid)
    clock.now += 11  # past heartbeat_timeout
    state.expire()
    status, body = call(server, "GET", "/status")
    assert body["workers"][0]["state"] == "lost" and body["reissue_queue"] == 1
    # the lost worker is told to register again
    status, got = call(server, "POST", "/v1/lease", {"worker_id": wid, "version": 0, "max_groups": 1})
    assert (status, got["error"]) == (404, "unknown_worker")
    again = register(server, "w-again")
    status, new = call(server, "POST", "/v1/lease", {"worker_id": again, "version": 0, "max_groups": 1})
    assert new["indices"] == lease["indices"]


def test_t_bcast_measured_from_heartbeats(coord):
    server, state, clock = coord
    workers = [register(server, f"w{i}") for i in range(3)]
    state.publisher.publish(0, b"v0", keep=2)
    clock.now += 2.0
    for wid in workers[:2]:
        call(server, "POST", "/v1/heartbeat", {"worker_id": wid, "version": 0})
    assert state.publisher.t_bcast == {}, "2 of 3 is below q = 0.9"
    clock.now += 1.5
    call(server, "POST", "/v1/heartbeat", {"worker_id": workers[2], "version": 0})
    assert state.publisher.t_bcast == {0: pytest.approx(3.5)}
