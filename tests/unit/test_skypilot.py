"""The `skypilot` provider's launch/poll/stop logic and the cost meter.

Everything here runs WITHOUT SkyPilot and without a cloud: the SDK boundary (`SkyClient`) is a
FAKE (`FakeSky`, below) that records every call and answers as a test tells it to, and the task
builder is a stand-in. test_skypilot_bridge.py tests the real client and bridge over a fake `sky`;
test_skypilot_task.py builds and validates the real tasks with SkyPilot itself, through the bridge.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from echo2.config import SchedulerConfig, SkyPilotConfig
from echo2.coordinator.activation import Fleet, Slots
from echo2.coordinator.registry import Registry
from echo2.fleet.providers.skypilot.provider import Outcome, SkyPilotFleet
from echo2.fleet.scheduler import Action, Scheduler

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- the fake SDK
@dataclass
class FakeSky:
    """A FAKE SkyPilot client (the `SkyClient` seam): requests finish after `delay` polls; a launch
    of a cluster in `fail` fails with that error; `status` reports the clusters in `up`."""

    delay: int = 1
    fail: dict[str, str] = field(default_factory=dict)
    events: list[tuple] = field(default_factory=list)
    up: set[str] = field(default_factory=set)
    log: Path | None = None
    tokens: list[str] = field(default_factory=list)
    slot_secrets: list[str] = field(default_factory=list)
    _requests: dict[str, list] = field(default_factory=dict)

    def _record(self, *event) -> None:
        self.events.append(event)
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(json.dumps(event) + "\n")

    def _request(self, outcome: Outcome, effect=None) -> str:
        rid = f"req-{len(self._requests)}"
        self._requests[rid] = [self.delay, outcome, effect]
        return rid

    def launch(self, task, *, token: str, slot_secret: str, cluster_name: str, idle_minutes: int) -> str:
        self.tokens.append(token)  # the secrets: kept apart from the events, which are logged
        self.slot_secrets.append(slot_secret)
        self._record("launch", cluster_name, idle_minutes)
        if cluster_name in self.fail:
            return self._request(Outcome(ok=False, error=self.fail[cluster_name]))
        return self._request(Outcome(ok=True), lambda: self.up.add(cluster_name))

    def down(self, cluster_name: str) -> str:
        self._record("down", cluster_name)
        return self._request(Outcome(ok=True), lambda: self.up.discard(cluster_name))

    def status(self, cluster_names: list[str]) -> str:
        self._record("status", *cluster_names)
        return self._request(None, None)  # answered from `up` when it finishes

    def poll(self, request_id: str) -> Outcome | None:
        req = self._requests[request_id]
        if req[0] > 0:
            req[0] -= 1
            return None
        outcome, effect = req[1], req[2]
        if effect is not None:
            effect()
            req[2] = None
        if outcome is None:
            return Outcome(ok=True, value={c: "UP" for c in self.up})
        return outcome

    def cancel(self, request_id: str) -> None:
        self._record("cancel", request_id)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_build(worker, config, *, slot, learner_key=None):
    """Stand-in for `task_config`: what it was asked to build."""
    return {"slot": slot, "accelerator": worker.accelerator}


def sky_config(**kw) -> SkyPilotConfig:
    workers = kw.pop(
        "workers",
        [
            dict(
                name="vast-4090-spot",
                count=1,
                throughput=1.0,
                price=0.25,
                accelerator="RTX4090",
                infra=["vast"],
                spot=True,
            ),
            dict(
                name="runpod-4090-od",
                count=1,
                throughput=1.0,
                price=0.69,
                accelerator="RTX4090",
                infra=["runpod"],
            ),
        ],
    )
    kw.setdefault("poll_s", 1.0)
    return SkyPilotConfig(coordinator_url="https://learner.example:8765", workers=workers, **kw)


def started(config: SkyPilotConfig, sky: FakeSky, clock: Clock, *, initial: int = 0) -> SkyPilotFleet:
    fleet = SkyPilotFleet(config, initial=initial, client=sky, clock=clock, build=fake_build)
    fleet.start(SimpleNamespace(token="s3cret-token", fingerprint="fp"), poll_in_background=False)
    return fleet


def settle(fleet: SkyPilotFleet, clock: Clock, rounds: int = 6) -> None:
    for _ in range(rounds):
        clock.now += 1
        fleet.tick()


# ---------------------------------------------------------------------------- launch / poll / stop
def test_start_slot_only_queues_then_tick_launches_with_autodown_and_polls_until_up():
    sky, clock = FakeSky(delay=2), Clock()
    fleet = started(sky_config(autostop_minutes=7), sky, clock)
    assert [o.name for o in fleet.offers()] == ["vast-4090-spot-0", "runpod-4090-od-0"]
    fleet.start_slot("vast-4090-spot-0")
    assert sky.events == []  # no SDK call on the caller's thread
    assert [o.name for o in fleet.running()] == ["vast-4090-spot-0"]
    fleet.tick()
    assert sky.events == [("launch", "echo2-vast-4090-spot-0", 7)]
    settle(fleet, clock)
    assert "echo2-vast-4090-spot-0" in sky.up
    assert [o.name for o in fleet.running()] == ["vast-4090-spot-0"]
    assert [o.name for o in fleet.offers()] == ["runpod-4090-od-0"]
    fleet.stop_slot("vast-4090-spot-0")
    assert fleet.running() == []
    settle(fleet, clock)
    assert ("down", "echo2-vast-4090-spot-0") in sky.events
    assert sky.up == set()
    assert {o.name for o in fleet.offers()} == {"vast-4090-spot-0", "runpod-4090-od-0"}


def test_the_token_goes_to_the_launch_as_its_secret_not_into_the_task_or_any_log(caplog):
    sky, clock = FakeSky(), Clock()
    built = []
    fleet = SkyPilotFleet(
        sky_config(), initial=1, client=sky, clock=clock, build=lambda *a, **k: built.append(k) or k
    )
    with caplog.at_level("DEBUG"):
        fleet.start(SimpleNamespace(token="s3cret-token", fingerprint="fp"), poll_in_background=False)
        settle(fleet, clock)
        fleet.stop(grace=5)
    assert sky.tokens == ["s3cret-token"] and built == [{"slot": "vast-4090-spot-0", "learner_key": "fp"}]
    assert "s3cret-token" not in json.dumps(sky.events) and "s3cret-token" not in caplog.text


def test_a_failed_launch_marks_the_type_unavailable_for_a_while_and_tears_down_what_is_left():
    sky, clock = FakeSky(fail={"echo2-vast-4090-spot-0": "ResourcesUnavailableError: no capacity"}), Clock()
    fleet = started(sky_config(unavailable_s=100), sky, clock)
    fleet.start_slot("vast-4090-spot-0")
    settle(fleet, clock)
    assert fleet.failures == {"vast-4090-spot": 1}
    assert ("down", "echo2-vast-4090-spot-0") in sky.events
    assert fleet.running() == []
    assert [o.name for o in fleet.offers()] == ["runpod-4090-od-0"]
    clock.now += 100
    assert [o.name for o in fleet.offers()] == ["vast-4090-spot-0", "runpod-4090-od-0"]


def test_a_launch_the_api_server_refuses_is_a_failed_launch():
    class Refusing(FakeSky):
        def launch(self, task, *, token, slot_secret, cluster_name, idle_minutes):
            super().launch(
                task,
                token=token,
                slot_secret=slot_secret,
                cluster_name=cluster_name,
                idle_minutes=idle_minutes,
            )
            raise ConnectionError("API server down")

    sky, clock = Refusing(), Clock()
    fleet = started(sky_config(), sky, clock)
    fleet.start_slot("vast-4090-spot-0")
    settle(fleet, clock)
    assert fleet.failures == {"vast-4090-spot": 1} and fleet.running() == []
    assert [o.name for o in fleet.offers()] == ["runpod-4090-od-0"]
    fleet.stop(grace=5)
    assert sky.events[-1] == ("down", "echo2-vast-4090-spot-0")  # in case it was submitted after all


def test_a_lost_worker_marks_its_type_unavailable_and_its_cluster_is_torn_down():
    sky, clock = FakeSky(), Clock()
    fleet = started(sky_config(), sky, clock)
    fleet.start_slot("runpod-4090-od-0")
    settle(fleet, clock)
    fleet.stop_slot("runpod-4090-od-0", failed=True)
    settle(fleet, clock)
    assert ("down", "echo2-runpod-4090-od-0") in sky.events
    assert fleet.failures == {"runpod-4090-od": 1}
    assert [o.name for o in fleet.offers()] == ["vast-4090-spot-0"]


def test_stopping_a_queued_slot_launches_nothing():
    sky, clock = FakeSky(), Clock()
    fleet = started(sky_config(), sky, clock)
    fleet.start_slot("vast-4090-spot-0")
    fleet.stop_slot("vast-4090-spot-0")
    settle(fleet, clock)
    assert sky.events == []


@pytest.mark.parametrize("fault", ["no capacity", "preempted"])
def test_a_failed_type_is_skipped_and_the_scheduler_activates_the_next_cheapest(fault):
    """The real scheduler and fleet over the provider: the cheapest type (vast spot) fails (its
    launch, or its cluster vanishes once up); the runpod on-demand type is activated instead."""
    vast = "echo2-vast-4090-spot-0"
    sky, clock = (
        FakeSky(fail={vast: "ResourcesUnavailableError: no capacity"} if fault == "no capacity" else {}),
        Clock(),
    )
    provider = started(sky_config(unavailable_s=3600), sky, clock)
    fleet = Fleet(scheduler=Scheduler(sustain_s=30), target=lambda: 1.0, has_provider=True)
    registry = Registry(heartbeat_timeout=15)
    activated = []
    for _ in range(200):
        clock.now += 1
        for step in fleet.plan(registry, Slots.read(provider), clock.now):
            if step.decision.action is Action.ACTIVATE:
                activated.append(step.name)
            step.call.apply(provider)
        provider.tick()
        if fault == "preempted" and vast in sky.up and clock.now > 40:
            sky.up.discard(vast)  # the spot market takes the machine back
    assert activated == ["vast-4090-spot-0", "runpod-4090-od-0"]
    assert provider.failures == {"vast-4090-spot": 1}
    assert sky.up == {"echo2-runpod-4090-od-0"}
    assert [o.name for o in provider.running()] == ["runpod-4090-od-0"]


# ---------------------------------------------------------------------------- the learner's exit
def _all_torn_down(events) -> bool:
    launched = {e[1] for e in events if e[0] == "launch"}
    downed = {e[1] for e in events if e[0] == "down"}
    return bool(launched) and launched <= downed


def test_stop_tears_down_every_launched_cluster_and_cancels_launches_in_flight():
    sky, clock = FakeSky(delay=0), Clock()
    config = sky_config(
        workers=[dict(name="l40s", count=3, throughput=1.0, price=0.86, accelerator="L40S", infra=["runpod"])]
    )
    fleet = started(config, sky, clock, initial=3)
    fleet.tick()  # three launches submitted
    fleet.tick()  # all up
    sky.delay = 5
    fleet.stop_slot("l40s-2")
    fleet.tick()  # l40s-2's teardown in flight
    fleet.stop(grace=30)
    assert _all_torn_down(sky.events)
    assert fleet.offers() == [] and fleet.running() == []
    fleet.stop()  # idempotent
    assert sum(e[0] == "down" for e in sky.events) == 3


def test_an_exception_in_the_learner_tears_the_fleet_down():
    sky, clock = FakeSky(delay=0), Clock()
    with pytest.raises(RuntimeError, match="learner crashed"):
        with started(sky_config(), sky, clock, initial=2) as fleet:
            fleet.tick()
            fleet.tick()
            raise RuntimeError("learner crashed")
    assert _all_torn_down(sky.events)
    assert {e[1] for e in sky.events if e[0] == "down"} == {
        "echo2-vast-4090-spot-0",
        "echo2-runpod-4090-od-0",
    }


def test_a_launch_still_in_flight_at_exit_is_cancelled_and_torn_down():
    sky, clock = FakeSky(delay=100), Clock()
    fleet = started(sky_config(), sky, clock, initial=1)
    fleet.tick()
    fleet.stop(grace=0)
    assert [e[0] for e in sky.events] == ["launch", "cancel", "down"]


def test_one_teardown_that_fails_does_not_stop_the_others_and_is_named_for_the_user(caplog):
    class Flaky(FakeSky):
        def down(self, cluster_name):
            if cluster_name == "echo2-vast-4090-spot-0":
                self._record("down-refused", cluster_name)
                raise ConnectionError("API server down")
            return super().down(cluster_name)

    sky, clock = Flaky(delay=0), Clock()
    fleet = started(sky_config(), sky, clock, initial=2)
    fleet.tick()
    fleet.tick()
    fleet.stop(grace=5)
    assert ("down", "echo2-runpod-4090-od-0") in sky.events
    assert "sky down echo2-vast-4090-spot-0" in caplog.text


_SIGTERM_CHILD = """
import signal, sys, time
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, {tests!r})
from test_skypilot import FakeSky, sky_config, fake_build
from echo2.fleet.providers.skypilot.provider import SkyPilotFleet

signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # as `echo2 learner` does
sky = FakeSky(delay=0, log=Path({log!r}))
fleet = SkyPilotFleet(sky_config(poll_s=0.05), initial=2, client=sky, build=fake_build)
try:
    fleet.start(SimpleNamespace(token="t", fingerprint=None))
    while True:
        time.sleep(0.05)
finally:
    fleet.stop(grace=10)  # api.py stops its fleet in `finally`
"""


def test_sigterm_to_the_learner_tears_down_every_launched_cluster(tmp_path):
    log = tmp_path / "events.jsonl"
    code = _SIGTERM_CHILD.format(tests=str(Path(__file__).parent), log=str(log))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            lines = log.read_text().splitlines() if log.exists() else []
            if sum('"launch"' in line for line in lines) == 2:
                break
            assert proc.poll() is None, "the child died early"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = [tuple(json.loads(line)) for line in log.read_text().splitlines()]
    assert _all_torn_down(events)


# ---------------------------------------------------------------------------- cost
def test_the_provider_bills_from_launch_to_the_end_of_teardown():
    sky, clock = FakeSky(delay=0), Clock()
    fleet = started(sky_config(), sky, clock)
    fleet.start_slot("runpod-4090-od-0")
    fleet.tick()
    clock.now += 3600
    fleet.tick()
    assert fleet.metrics() == {
        "fleet/cost_usd": pytest.approx(0.69),
        "fleet/price_per_hour": pytest.approx(0.69),
    }
    fleet.stop(grace=5)
    clock.now += 3600
    assert fleet.metrics()["fleet/cost_usd"] == pytest.approx(0.69)


# ---------------------------------------------------------------------------- config
def test_the_skypilot_provider_needs_its_section_and_the_scheduler():
    with pytest.raises(ValueError, match="scheduler.skypilot"):
        SchedulerConfig(enabled=True, provider="skypilot")
    with pytest.raises(ValueError, match="scheduler.enabled"):
        SchedulerConfig(provider="skypilot", skypilot=sky_config())
    with pytest.raises(ValueError, match="names must be unique"):
        sky_config(workers=[dict(name="a", count=1, throughput=1, price=1, accelerator="L4")] * 2)
    with pytest.raises(ValueError, match="name"):
        sky_config(workers=[dict(name="Bad_Name", count=1, throughput=1, price=1, accelerator="L4")])
    assert (
        SchedulerConfig(enabled=True, provider="skypilot", skypilot=sky_config()).skypilot.autostop_minutes
        == 10
    )
