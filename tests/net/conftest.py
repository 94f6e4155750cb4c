"""tests/net's shared fixture: `coord`, a coordinator on loopback (tests/coordinator_http.py)."""

from __future__ import annotations

import pytest
from coordinator_http import started_coordinator


@pytest.fixture
def coord():
    """(server, state, clock): a started coordinator on 127.0.0.1 port 0, stopped after the test."""
    yield from started_coordinator()
