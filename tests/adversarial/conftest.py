from __future__ import annotations

import pytest
from hostile import Door, HostileWorker, open_door


@pytest.fixture
def door():
    d = open_door()
    yield d
    d.close()


@pytest.fixture
def mallory(door: Door) -> HostileWorker:
    return HostileWorker(door.url)
