"""fleet/providers/skypilot/cost.py: the bill integrates the price of what runs over time."""

from __future__ import annotations

import pytest

from echo2.fleet.providers.skypilot.cost import CostMeter


def test_cost_meter_integrates_the_price_of_what_runs():
    m = CostMeter()
    m.observe(0.0, 2.0)
    m.observe(1800.0, 0.5)  # $2/h for half an hour
    m.observe(3600.0, 0.0)  # $0.5/h for half an hour
    m.observe(7200.0, 0.0)
    assert m.usd == pytest.approx(1.25)
