"""The worker acts on every refusal the protocol defines without dying: `lease_limit` (429) gives back
what it holds, pauses and carries on; `quarantined` ends the run and `echo2 worker` stops with one
line and exit status 1, as does any other refusal it does not act on. The refusals are made by the
real client from the coordinator's answers (wire/client.py: `refusal`); the coordinator is a fake
that records the calls."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from echo2.cli import main
from echo2.rollout import worker as worker_module
from echo2.rollout.worker import Worker
from echo2.rollout.worker_config import WorkerConfig
from echo2.wire import client, errors


def answer(status: int, reason: str) -> errors.Refused:
    return client.refusal(status, {"error": reason, "detail": f"injected {reason}"})


class FakeCoordinator:
    """Answers leases and pushes from scripts (an exception is raised, anything else returned)."""

    def __init__(self, *, leases: list, pushes: list) -> None:
        self.leases, self.pushes = leases, pushes
        self.returned: list[str] = []

    async def lease(self, req):
        return self._next(self.leases)

    async def push(self, req):
        return self._next(self.pushes)

    async def return_lease(self, req) -> None:
        self.returned.append(req.lease_id)

    @staticmethod
    def _next(script: list):
        got = script.pop(0)
        if isinstance(got, BaseException):
            raise got
        return got


def make_worker(coordinator: FakeCoordinator) -> Worker:
    w = Worker(WorkerConfig(url="http://127.0.0.1:9", token="t", name="w"))
    w.member.coordinator, w.member.worker_id = coordinator, "w1"
    w.run_config = SimpleNamespace(
        coordinator=SimpleNamespace(groups_per_lease=1), rollout=SimpleNamespace(prompts_per_step=1)
    )
    w.engine = SimpleNamespace(version=0)

    async def generate(lease) -> list[dict]:
        record = {
            "record_id": f"r-{lease.lease_id}",
            "group_id": "g0",
            "prompt_ids": [1],
            "response_ids": [2],
        }
        return [record | {"behaviour_logprobs": [-0.5], "loss_mask": [1], "reward": 1.0, "version": 0}]

    w._generate = generate
    return w


def lease(lease_id: str) -> SimpleNamespace:
    return SimpleNamespace(lease_id=lease_id, indices=[0])


def test_lease_limit_returns_what_the_worker_holds_and_it_carries_on(monkeypatch):
    """A refused push leaves its lease open at the coordinator: the worker gives it back at once. A
    lease_limit refusal returns whatever is still held (here one whose return failed before), the
    worker pauses, and its next lease is worked through as usual."""
    monkeypatch.setattr(worker_module, "LEASE_LIMIT_PAUSE", 0.01)
    fake = FakeCoordinator(
        leases=[lease("L1"), answer(429, "lease_limit"), lease("L2")],
        pushes=[answer(422, "group_overflow"), {"accepted": 0, "duplicates": 0}],
    )
    w = make_worker(fake)
    stop = asyncio.Event()

    async def scenario() -> None:
        await w.step(stop)  # L1: push refused, lease given back
        assert fake.returned == ["L1"] and w.held == set()
        w.held.add("L0")  # a lease whose return did not reach the coordinator
        await w.step(stop)  # lease_limit: give back L0, pause
        assert fake.returned == ["L1", "L0"] and w.held == set()
        await w.step(stop)  # carries on
        assert w.held == set() and not fake.leases and not fake.pushes

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert (
        w.counts["lease_limit"] == 1
        and w.counts["dropped"] == 1
        and w.counts["pushed"] == 1
        and not stop.is_set()
    )


def test_quarantined_is_not_taken_for_a_lost_credential():
    """403 quarantined ends the worker's run (registering again is no remedy); 403 forbidden rejoins."""
    w = make_worker(FakeCoordinator(leases=[], pushes=[]))
    rejoined = []

    async def rejoin(seen, refusal) -> None:
        rejoined.append(refusal.reason)

    w.member.rejoin = rejoin

    async def refuse(status: int, reason: str) -> None:
        raise answer(status, reason)

    async def scenario() -> None:
        stop = asyncio.Event()
        await w.member.as_member(stop, lambda: refuse(403, "forbidden"))
        with pytest.raises(errors.Quarantined):
            await w.member.as_member(stop, lambda: refuse(403, "quarantined"))
        assert not stop.is_set()

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert rejoined == ["forbidden"]


@pytest.mark.parametrize(
    ("status", "reason", "says"),
    [(403, "quarantined", "quarantined by the coordinator"), (404, "no_snapshot", "refused (no_snapshot")],
)
def test_echo2_worker_stops_with_one_line_on_a_refusal(monkeypatch, capsys, status, reason, says):
    async def refused(self, stop) -> None:
        raise answer(status, reason)

    monkeypatch.setattr(Worker, "run", refused)
    argv = ["worker", "--coordinator", "http://127.0.0.1:9", "--token", "t", "--emulate", "5"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("status", "reason"),
    [(409, "some_conflict"), (404, "no_snapshot"), (418, "a_newer_reason")],
)
def test_any_refusal_with_a_reason_returns_what_is_held_and_backs_off(monkeypatch, status, reason):
    """A lease or push refused with a 4xx and a reason the loop does not otherwise act on (one newer
    than this worker, a rate limit) never ends the worker: it gives back what it holds, waits
    longer after each refusal in a row, and carries on."""
    monkeypatch.setattr(worker_module, "REFUSAL_PAUSE", 0.001)
    fake = FakeCoordinator(
        leases=[answer(status, reason), lease("L1"), answer(status, reason), lease("L2")],
        pushes=[answer(status, reason), {"accepted": 1, "duplicates": 0}],
    )
    w = make_worker(fake)
    w.held.add("L0")
    stop = asyncio.Event()

    async def scenario() -> None:
        await w.step(stop)  # the lease refused: L0 given back
        assert fake.returned == ["L0"] and w.held == set()
        await w.step(stop)  # L1's push refused: L1 given back
        assert "L1" in fake.returned and w.held == set()
        await w.step(stop)
        assert w._refusals == 3
        await w.step(stop)  # carries on: L2 pushed
        assert w._refusals == 0 and not fake.leases and not fake.pushes

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert w.counts["pushed"] == 1 and not stop.is_set()
