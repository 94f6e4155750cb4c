"""The benchmark harness's tests import its modules the way its scripts do (`python bench/X.py`
puts bench/ first on sys.path): bench/ goes on sys.path here, for this directory only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


@pytest.fixture(scope="session")
def shaped_network():
    """Skip (with the reason) where this process cannot build a shaped network; probed on first
    use, not at collection, so a run that deselects these tests builds nothing."""
    from netns import ShapedNetwork

    ok, why = ShapedNetwork.available()
    if not ok:
        pytest.skip(f"shaped network unavailable: {why}")
