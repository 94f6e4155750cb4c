"""The coordinator's parts under its HTTP server: a worker's relay port in use, a publisher subclass's
routes, the state lock taken once per push, and large pushes parsed in the parser process."""

from __future__ import annotations

import json
import sys
import time

from coordinator_http import CREDENTIALS, TOKEN, call, leased, record, register
from support import FakeClock, make_state

from echo2.coordinator.publisher import Publisher
from echo2.coordinator.server import Coordinator


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
        assert status == 200 and route == {
            "version": 0,
            "parent_id": None,
            "url": None,
            "min_rate_bps": None,
            "form": "full",
        }
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

    state = make_state(
        FakeClock(), referee=Referee(), journal=lambda records, prompts: journalled.append(prompts)
    )
    server = Coordinator(state, token=TOKEN, run_info={}, heartbeat_interval=1.0)
    server.start()
    try:
        wid = register(server)
        lease = leased(server, state, wid)
        check = state.intake.ingestion.check
        state.intake.ingestion.check = lambda *a, **k: checks.append(a[1]) or check(*a, **k)
        lock = state.shared.lock = CountingLock(state.shared.lock)
        batch = {
            "worker_id": wid,
            "lease_id": lease["lease_id"],
            "records": [record("g0", "a"), record("g0", "b")],
        }
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

    good = {
        "worker_id": wid,
        "lease_id": lease["lease_id"],
        "records": [record("g0", "a"), record("g0", "b")],
    }
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
