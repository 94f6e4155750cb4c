from __future__ import annotations

import pytest
from hostile import Door, HostileWorker, open_door

from echo2.coordinator import longpoll


@pytest.fixture
def door():
    d = open_door()
    yield d
    d.close()


@pytest.fixture
def mallory(door: Door) -> HostileWorker:
    return HostileWorker(door.url)


@pytest.fixture
def fdoor(monkeypatch: pytest.MonkeyPatch):
    """A door that quarantines no one, whose long polls last 50 ms at most."""
    monkeypatch.setattr(longpoll, "LONG_POLL_MAX", 0.05)
    d = open_door(quarantine_after=10**9)
    yield d
    d.close()
