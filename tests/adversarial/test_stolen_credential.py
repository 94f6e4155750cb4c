"""Issue 41 item 6: a stolen credential used beside its worker.

Seen at ec77695: a copy of a worker's credential held the victim's lease slots (its throughput went
from 18 to 0 records/s) and one forged install report got the honest worker quarantined, unnoticed.
Here the honest worker numbers its calls as `echo2 worker`'s client does (X-Echo2-Seq,
coordinator/sessions.py); a copy of its credential, whatever it sends (no number, a low one, a
jump ahead), is caught within two calls: the credential is revoked for both, the conflict is on
/status and /metrics, and the honest worker's next call is answered 403 so it registers again.
Honest concurrency (many calls in flight, arriving out of order) is not a conflict."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from test_large_bodies import TOKEN, register, served  # noqa: F401 - served: the fixture

from echo2.coordinator.sessions import WINDOW, SeqWindow
from echo2.wire.client import CoordinatorClient
from echo2.wire.identity import SEQ_HEADER
from echo2.wire.protocol import HeartbeatRequest


def beat(url: str, worker: str, secret: str, seq: int | None) -> tuple[int, dict]:
    req = urllib.request.Request(
        url + "/v1/heartbeat", data=json.dumps({"worker_id": worker, "version": 0}).encode(), method="POST"
    )
    req.add_header("Authorization", f"Bearer {secret}")
    if seq is not None:
        req.add_header(SEQ_HEADER, str(seq))
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def status(url: str) -> dict:
    req = urllib.request.Request(url + "/status")
    req.add_header("Authorization", f"Bearer {TOKEN}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def metrics(url: str) -> str:
    req = urllib.request.Request(url + "/metrics")
    req.add_header("Authorization", f"Bearer {TOKEN}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read().decode()


@pytest.mark.parametrize("copy", ["unnumbered", "restarted counter", "jump ahead"])
def test_a_copy_used_beside_its_worker_is_caught_and_the_credential_revoked(served, copy):  # noqa: F811
    _, server = served
    worker, secret = register(server.url, "victim")
    for n in range(1, 6):  # the honest worker's calls so far
        assert beat(server.url, worker, secret, n)[0] == 200
    thief = {"unnumbered": [None], "restarted counter": [1], "jump ahead": [10**9]}[copy]
    answers = [beat(server.url, worker, secret, n)[0] for n in thief]
    honest = beat(server.url, worker, secret, 6)  # the worker's next call
    assert 403 in answers + [honest[0]], (answers, honest)
    assert honest[0] == 403 and "revoked" in honest[1]["detail"], honest
    assert beat(server.url, worker, secret, 10**9 + 1)[0] == 403, "revoked for every copy"
    assert beat(server.url, worker, secret, None)[0] == 403
    conflicts = status(server.url)["credential_conflicts"]
    assert [c["worker_id"] for c in conflicts] == [worker] and conflicts[0]["name"] == "victim"
    assert "echo2_credential_conflicts_total 1.0" in metrics(server.url)
    again, new_secret = register(server.url, "victim")  # the operator's worker registers again
    assert beat(server.url, again, new_secret, 1)[0] == 200


def test_honest_calls_in_flight_together_are_not_a_conflict(served):  # noqa: F811
    """The real client: 64 heartbeats at once over its connection pool, arriving in any order, and
    a window's worth more after them."""
    _, server = served

    async def run() -> None:
        async with await CoordinatorClient.create(server.url, TOKEN) as client:
            from echo2.wire.protocol import RegisterRequest

            reply = await client.register(RegisterRequest(name="honest"))
            for _ in range(3):
                await asyncio.gather(
                    *(
                        client.heartbeat(HeartbeatRequest(worker_id=reply.worker_id, version=0))
                        for _ in range(64)
                    )
                )

    asyncio.run(run())
    assert status(server.url)["credential_conflicts"] == []


def test_the_window_admits_reordering_and_refuses_repeats_and_stragglers():
    w = SeqWindow()
    assert w.admit(None) is None  # a client that never numbers stays unchecked
    for n in [3, 1, 2, 7, 5]:
        assert w.admit(n) is None
    assert "twice" in w.admit(5)
    assert w.admit(None) is not None  # numbered now: an unnumbered call is another client
    assert w.admit(7 + WINDOW) is None
    assert "below" in w.admit(6)
    assert w.admit(8) is None  # within WINDOW of the highest: a late honest call
    for n in range(WINDOW + 8, 4 * WINDOW):  # the seen set is pruned, the window still holds
        assert w.admit(n) is None
    assert len(w.seen) <= 2 * WINDOW + 1
    assert w.admit(4 * WINDOW - 1) is not None
