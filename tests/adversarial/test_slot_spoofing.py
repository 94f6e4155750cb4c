"""Issue 41 item 4: provider slot-name spoofing (and, from item 6, the token the registration reply echoed).

Anyone with the run token could register under the name of a slot the provider had just started and
go silent: the coordinator then took the slot's worker for lost, the provider tore the real machine
down and (SkyPilot) blocked its type for an hour, and the scheduler moved to a dearer type. A
provider now puts a fresh secret in each slot's environment (identity.SLOT_SECRET_ENV) and only a
registration that carries it (`slot_proof`) may take the slot's name.
"""

from __future__ import annotations

import subprocess

import pytest
from support import FakeClock, FakeProvider, make_state

from echo2.fleet.providers.local import LocalFleet
from echo2.fleet.scheduler import Scheduler
from echo2.fleet.selection import WorkerOffer
from echo2.wire import identity
from echo2.wire.errors import SlotUnproven


def _fleet():
    clock = FakeClock()
    provider = FakeProvider([("cheap-0", 1.0, 0.25), ("dear-0", 1.0, 0.69)])
    state = make_state(clock, scheduler=Scheduler(sustain_s=20.0), target=lambda: 1.0, provider=provider)
    state.publisher.publish(0, b"v0", keep=2)
    state.expire()
    clock.now += 20.0
    state.expire()
    assert provider.calls == [("start", "cheap-0")]
    return clock, provider, state


@pytest.mark.parametrize("proof", [None, "guessed", identity.new_secret()])
def test_a_registration_claiming_a_slot_without_its_secret_is_refused_and_changes_nothing(proof):
    clock, provider, state = _fleet()
    before = dict(state.registry.workers)
    claim = {} if proof is None else {"slot_proof": proof}  # None: what a token holder sent before
    with pytest.raises(SlotUnproven):
        state.register(name="cheap-0", hardware="x", price_per_hour=0.25, inbound=False, **claim)
    assert state.registry.workers == before
    for _ in range(10):  # what going silent did: lost, the real slot stopped as failed, a dearer one started
        clock.now += 2.0
        state.expire()
    assert provider.calls == [("start", "cheap-0")], provider.calls
    # the slot's own worker, with the secret its provider gave it, registers as provided
    info = state.register(
        name="cheap-0", hardware="x", price_per_hour=0.25, inbound=False, slot_proof=provider.secrets["cheap-0"]
    )
    assert info.provided


def test_a_name_no_slot_has_needs_no_proof():
    _, _, state = _fleet()
    assert not state.register(name="laptop", hardware="x", price_per_hour=0.0, inbound=False).provided


def test_the_local_provider_gives_each_start_a_fresh_secret_in_the_workers_environment(monkeypatch):
    started: list[dict] = []

    class Proc:
        pid = 4242

        def poll(self):
            return None

    def popen(cmd, env):
        started.append(env)
        return Proc()

    monkeypatch.setattr(subprocess, "Popen", popen)
    fleet = LocalFleet([WorkerOffer(name="local-0", throughput=1.0, price=0.0)], initial=0)
    fleet.url, fleet.token = "http://127.0.0.1:1", "tok"
    assert not fleet.proves("local-0", None)  # never started: nothing proves it
    fleet.start_slot("local-0")
    secret = started[0][identity.SLOT_SECRET_ENV]
    assert fleet.proves("local-0", secret) and not fleet.proves("local-0", secret[:-1] + "x")
    fleet.slots["local-0"].proc = None  # exited; started again: the old secret proves nothing
    fleet.start_slot("local-0")
    assert started[1][identity.SLOT_SECRET_ENV] != secret and not fleet.proves("local-0", secret)


def test_the_registration_reply_does_not_echo_the_run_token():
    """Issue 41 item 6, in part: the run as workers are told it left `coordinator.token` in."""
    from echo2.config import build_config
    from echo2.wire.protocol import RunView

    config = build_config({"coordinator": {"token": "the-run-token"}})
    view = RunView.of(config)
    assert view.coordinator.token is None and "the-run-token" not in view.model_dump_json()
    assert view.config().coordinator.lease_timeout == config.coordinator.lease_timeout
