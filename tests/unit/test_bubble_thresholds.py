"""bench/bubble_thresholds.py: `echo2 plan`, the scheduler and the simulator against the measured
bubble benchmark (docs/bench/bubble.json), thresholds within one worker for S in {2, 3, 5} (issue 14),
and docs/bench/bubble_thresholds.json still what the script computes."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
META = {"steps": 12, "warmup": 3, "group_size": 16}


@pytest.fixture
def bt(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # as `python bench/bubble_thresholds.py` runs
    return importlib.import_module("bubble_thresholds")


def _load(name: str) -> dict:
    return json.loads((ROOT / "docs" / "bench" / name).read_text())


def test_plan_and_scheduler_within_one_worker_of_measured(bt):
    result = bt.thresholds(_load("bubble.json"), None, META, simulate=False)
    assert result["defaults"]["plan_model"] == "continuous"
    assert set(result["per_staleness"]) == {"2", "3", "5"}
    for s, v in result["per_staleness"].items():
        x, measured = v["summary"], v["summary"]["measured"]
        assert measured is not None, s
        for key in ("echo2 plan threshold", "echo2 plan activates", "scheduler activates"):
            assert abs(x[key] - measured) <= 1, (s, key, x)
        # the plan's model alone (no gamma headroom) gives the measured threshold exactly
        assert x["echo2 plan threshold"] == measured, (s, x)
        assert v["plan"]["active"] >= v["plan"]["active_gamma_1"]


def test_recorded_json_matches_a_recomputation(bt):
    recorded = _load("bubble_thresholds.json")
    fresh = bt.thresholds(_load("bubble.json"), _load("validation.json"), META, simulate=False)
    assert recorded["command"] == bt.COMMAND
    for s, v in fresh["per_staleness"].items():
        rec = recorded["per_staleness"][s]
        for key in ("measured", "echo2 plan threshold", "echo2 plan activates", "scheduler activates"):
            assert rec["summary"][key] == v["summary"][key], (s, key)
        assert rec["plan"]["mu_target"] == pytest.approx(v["plan"]["mu_target"])
        assert rec["scheduler"]["target"] == pytest.approx(v["scheduler"]["target"])
        # the simulator's thresholds, fresh and from validation.json, within one worker
        for key in ("simulator", "simulator (validation.json)"):
            assert abs(rec["summary"][key] - rec["summary"]["measured"]) <= 1, (s, key)


@pytest.mark.parametrize("target", [0.5, 35.0, 35.01, 112.2, 209.9, 500.0])
def test_scheduler_activates_ceil_of_target_over_rate(bt, target):
    cfg = bt.SchedulerConfig()
    assert bt.scheduler_activates(target, rate=35.0, count=6, config=cfg) == min(6, math.ceil(target / 35.0))


def test_one_fresh_simulation_matches_the_recorded_one(bt):
    rows = _load("bubble.json")["5"]["rows"]
    row = next(r for r in rows if r["pool"] == 3)
    recorded = _load("bubble_thresholds.json")["per_staleness"]["5"]["simulator"]["bubble_by_pool"]["3"]
    sim = bt.simulator_way([row], {}, META)
    assert sim["bubble_by_pool"][3] == pytest.approx(recorded, abs=1e-9)
