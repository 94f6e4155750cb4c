"""The coordinator over real loopback HTTP (port 0): auth, leases, idempotent ingestion, and a 4xx
with a reason for every kind of bad request, leaving the buffer exactly as it was."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request

import pytest
from support import FakeClock, make_state

from echo2.coordinator.publisher import Publisher
from echo2.coordinator.server import Coordinator
from echo2.wire.errors import Released

TOKEN = "secret-token"
CREDENTIALS: dict[str, str] = {}
"""Worker id -> the credential its registration returned (calls made as it carry it)."""


@pytest.fixture
def coord():
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
    return (len(state.intake.buffer), state.intake.buffer.contents_by_version(), state.intake.ingestion.accepted, sorted(state.intake.buffer._seen))


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
    assert len(state.intake.buffer) == 2 and state.intake.ingestion.accepted == 2 and state.intake.buffer.num_ready_groups() == 1
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
    assert {k: (v.version, v.throughput, v.status) for k, v in state.registry.workers.items()} == workers_before


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


def test_scheduler_in_the_coordinator_state():
    """Standby workers get no leases; the cheapest per unit throughput are activated after the
    sustained interval; a lost worker is replaced within one heartbeat timeout; decisions are kept
    with their reasons."""
    from echo2.fleet.scheduler import Scheduler

    clock = FakeClock()
    state = make_state(clock, scheduler=Scheduler(sustain_s=20.0), target=lambda: 2.0)
    state.publisher.publish(0, b"v0", keep=2)
    ids = {
        name: state.register(
            name=name, hardware="x", price_per_hour=price, inbound=False, throughput=1.0
        ).worker_id
        for name, price in [("a", 0.3), ("b", 0.9), ("c", 0.4), ("d", 0.5)]
    }
    assert state.intake.lease(ids["a"], version=0, max_groups=1) is None, "standby: no lease"
    state.expire()
    clock.now += 20.0
    for wid in ids.values():
        state.heartbeat(wid, version=0, throughput=1.0)
    state.expire()
    assert [d["worker"] for d in state.fleet.decisions] == ["a", "c"]  # rho 0.3, 0.4 reach 2.0/s
    assert state.intake.lease(ids["a"], version=0, max_groups=1) is not None
    # "c" dies: within one heartbeat timeout it is lost and "d" (next cheapest) replaces it at once
    for _ in range(6):
        clock.now += 2.0
        for name in ("a", "b", "d"):
            state.heartbeat(ids[name], version=0, throughput=1.0)
        state.expire()
    assert state.fleet.decisions[-1]["worker"] == "d" and "replacing lost" in state.fleet.decisions[-1]["reason"]
    assert len(state.fleet.decisions) == 3


class FakeProvider:
    """Records start/stop calls; a started slot runs until stopped."""

    def __init__(self, offers) -> None:
        from echo2.fleet.selection import WorkerOffer

        self.all = {name: WorkerOffer(name=name, throughput=mu, price=price) for name, mu, price in offers}
        self.live: set[str] = set()
        self.failed: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    def offers(self):
        return [o for n, o in self.all.items() if n not in self.live and n not in self.failed]

    def running(self):
        return [self.all[n] for n in sorted(self.live)]

    def owns(self, name):
        return name in self.all

    def start_slot(self, name):
        self.calls.append(("start", name))
        self.live.add(name)

    def stop_slot(self, name, *, failed=False):
        self.calls.append(("stop-failed" if failed else "stop", name))
        self.live.discard(name)
        if failed:
            self.failed.add(name)


def test_scheduler_with_a_provider_starts_and_stops_workers():
    """With a provider, standby workers are offers, not processes: activation starts one (counted
    while it starts, so no double start), release stops it (released, not lost, not replaced), and a
    silent worker is stopped as failed and replaced at once."""
    from echo2.coordinator.registry import WorkerStatus
    from echo2.fleet.scheduler import Scheduler

    clock = FakeClock()
    target = {"mu": 2.0}
    provider = FakeProvider([("a", 1.0, 0.3), ("b", 1.0, 0.9), ("c", 1.0, 0.4), ("d", 1.0, 0.5)])
    state = make_state(
        clock, scheduler=Scheduler(sustain_s=20.0), target=lambda: target["mu"], provider=provider
    )
    state.publisher.publish(0, b"v0", keep=2)
    state.expire()
    clock.now += 20.0
    state.expire()
    assert provider.calls == [("start", "a"), ("start", "c")]  # rho 0.3, 0.4 reach 2.0/s
    clock.now += 40.0
    state.expire()
    assert len(provider.calls) == 2, "started-but-unregistered workers count toward capacity"
    ids = {
        n: state.register(name=n, hardware="x", price_per_hour=p, inbound=False, throughput=1.0).worker_id
        for n, p in [("a", 0.3), ("c", 0.4)]
    }
    assert state.intake.lease(ids["a"], version=0, max_groups=1) is not None, "a started worker is active"

    target["mu"] = 0.8  # capacity 2.0 is far above: after the sustained interval, "c" (dearer) goes
    for _ in range(11):
        clock.now += 2.0
        for wid in ids.values():
            state.heartbeat(wid, version=0, throughput=1.0)
        state.expire()
    assert provider.calls[-1] == ("stop", "c")
    assert state.registry.workers[ids["c"]].status is WorkerStatus.RELEASED
    assert state.fleet.decisions[-1]["action"] == "release" and state.fleet.decisions[-1]["worker"] == "c"
    with pytest.raises(Released):  # told to stop, not to register again (410 on the wire)
        state.intake.lease(ids["c"], version=0, max_groups=1)
    n_decisions = len(state.fleet.decisions)
    for _ in range(10):  # "c" says nothing any more: released, never lost, never replaced
        clock.now += 2.0
        state.heartbeat(ids["a"], version=0, throughput=1.0)
        state.expire()
    assert state.registry.workers[ids["c"]].status is WorkerStatus.RELEASED and len(state.fleet.decisions) == n_decisions

    target["mu"] = 1.0  # "a" goes silent: lost within one heartbeat timeout, stopped as failed, replaced
    clock.now += 11.0
    state.expire()
    assert state.registry.workers[ids["a"]].status is WorkerStatus.LOST
    assert ("stop-failed", "a") in provider.calls
    assert provider.calls[-1] == ("start", "c") and "replacing lost" in state.fleet.decisions[-1]["reason"]


def test_worker_relay_port_in_use_exits_2(capsys):
    """`echo2 worker --inbound` on a port that is taken: exit 2 naming the flags, no traceback."""
    import socket

    from echo2.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["worker", "--coordinator", "http://127.0.0.1:9", "--token", "t", "--name", "a", "--inbound"]
        args += ["--relay-host", "127.0.0.1", "--relay-port", str(port), "--give-up-after", "1"]
        assert main(args) == 2
    assert "--relay-port" in capsys.readouterr().err


def test_a_publisher_subclass_wraps_route_and_report_installed():
    """The broadcast benchmark times routes and installs by subclassing the publisher (no
    monkeypatching): the coordinator calls the overrides, and the answers are unchanged."""
    import hashlib

    seen: list[tuple[str, int]] = []

    class Timed(Publisher):
        def route(self, worker_id, version, **form):
            seen.append(("route", version))
            return super().route(worker_id, version, **form)

        def report_installed(self, worker_id, version, sha256, transfers):
            seen.append(("installed", version))
            super().report_installed(worker_id, version, sha256, transfers)

    clock = FakeClock()
    state = make_state(clock, publisher=Timed)
    server = Coordinator(state, token=TOKEN, run_info={}, heartbeat_interval=1.0)
    server.start()
    try:
        wid = register(server)
        state.publisher.publish(0, b"v0", keep=2)
        status, route = call(server, "POST", "/v1/broadcast/route", {"worker_id": wid, "version": 0})
        assert status == 200 and route == {"version": 0, "parent_id": None, "url": None, "min_rate_bps": None, "form": "full"}
        status, got = call(server, "POST", "/v1/broadcast/route", {"worker_id": wid, "version": 5})
        assert (status, got["error"]) == (404, "no_snapshot")
        body = {"worker_id": wid, "version": 0, "sha256": hashlib.sha256(b"v0").hexdigest(), "transfers": []}
        assert call(server, "POST", "/v1/broadcast/installed", body) == (200, {"ok": True})
        status, got = call(server, "POST", "/v1/broadcast/installed", {**body, "sha256": "0" * 64})
        assert (status, got["error"]) == (422, "wrong_snapshot")
        assert seen == [("route", 0), ("route", 5), ("installed", 0), ("installed", 0)]
        assert state.registry.workers[wid].version == 0
    finally:
        server.stop()


class CountingLock:
    """The state's lock, noting the function that takes it each time (`with` or `acquire`)."""

    def __init__(self, lock) -> None:
        self.lock, self.takers = lock, []

    def acquire(self, *args, **kwargs):
        self.takers.append(sys._getframe(1).f_code.co_name)
        return self.lock.acquire(*args, **kwargs)

    def release(self) -> None:
        self.lock.release()

    def __enter__(self):
        self.takers.append(sys._getframe(1).f_code.co_name)
        return self.lock.__enter__()

    def __exit__(self, *exc) -> None:
        self.lock.__exit__(*exc)


def test_a_push_takes_the_state_lock_once_and_checks_its_lease_once():
    """Authentication, the lease's rules, the referee, the store and the journal of one push: one
    acquisition of the state's lock and one lease check (the expiry round's own are left out)."""
    refereed, journalled, checks = [], [], []

    class Referee:
        def check(self, record, index):
            refereed.append((record.record_id, index))

    state = make_state(FakeClock(), referee=Referee(), journal=lambda records, prompts: journalled.append(prompts))
    server = Coordinator(state, token=TOKEN, run_info={}, heartbeat_interval=1.0)
    server.start()
    try:
        wid = register(server)
        lease = leased(server, state, wid)
        check = state.intake.ingestion.check
        state.intake.ingestion.check = lambda *a, **k: checks.append(a[1]) or check(*a, **k)
        lock = state.shared.lock = CountingLock(state.shared.lock)
        batch = {"worker_id": wid, "lease_id": lease["lease_id"], "records": [record("g0", "a"), record("g0", "b")]}
        assert call(server, "POST", "/v1/trajectories", batch) == (200, {"accepted": 2, "duplicates": 0})
        assert [t for t in lock.takers if t != "expire"] == ["ingest"]
        assert checks == [lease["lease_id"]]
        assert refereed == [("a", 0), ("b", 0)] and journalled == [{"g0": 0}]
    finally:
        server.stop()


def test_a_large_push_is_parsed_in_the_parser_process_and_answered_as_in_the_thread(monkeypatch):
    """A body over IN_THREAD bytes (here: padded with whitespace) is parsed in the parser process:
    accepted, or refused with the same answer and the same count as the same body parsed in the
    ingest thread."""
    state = make_state(FakeClock(), quarantine_after=100)  # every refusal below is a strike
    server = Coordinator(state, token=TOKEN, run_info={}, heartbeat_interval=1.0, max_body=200_000)
    server.start()
    try:
        _large_push_cases(server, state, monkeypatch)
    finally:
        server.stop()


def _large_push_cases(server, state, monkeypatch) -> None:
    from echo2.coordinator import server as coordinator_module
    from echo2.coordinator.pushparse import IN_THREAD

    wid = register(server)  # starts the parser process
    while server.parser.outcome(b"{}", wid, {}) is None:  # until it is ready
        time.sleep(0.05)
    in_thread = []
    parse = coordinator_module.outcome
    monkeypatch.setattr(coordinator_module, "outcome", lambda *a: in_thread.append(1) or parse(*a))
    lease = leased(server, state, wid)
    pad = b" " * IN_THREAD

    def both(batch, raw=None, token=TOKEN):
        raw = raw if raw is not None else json.dumps(batch).encode()
        small = call(server, "POST", "/v1/trajectories", batch, raw=raw, token=token)
        before = sum(state.intake.ingestion.rejected.values())
        large = call(server, "POST", "/v1/trajectories", batch, raw=raw + pad, token=token)
        assert sum(state.intake.ingestion.rejected.values()) - before == (small[0] in (400, 422))
        return small, large

    good = {"worker_id": wid, "lease_id": lease["lease_id"], "records": [record("g0", "a"), record("g0", "b")]}
    status, body = call(server, "POST", "/v1/trajectories", good, raw=json.dumps(good).encode() + pad)
    assert (status, body) == (200, {"accepted": 2, "duplicates": 0}) and in_thread == []
    assert state.intake.buffer.seen("a") and state.intake.buffer.seen("b")
    for bad in (
        {**good, "records": [record("g1", "c", reward="x")]},
        {**good, "records": [record("g1", "d", response=(3, 4), loss_mask=[1])]},
        {**good, "records": [record("g1", "e", reward=float("nan"))]},
    ):
        small, large = both(bad)
        assert small == large and small[0] >= 400, (small, large)
    small, large = both({**good, "worker_id": register(server, "o")}, token=CREDENTIALS[wid])
    assert small == large and small[0] == 403  # a body made as another worker
    small, large = both(good, raw=b"{not json")
    assert small == large and small[0] == 400
    assert len(in_thread) == 5  # the small ones only
