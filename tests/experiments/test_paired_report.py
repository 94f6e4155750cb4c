"""experiments/time_to_accuracy/paired_report.py: seconds to a target from a run's evaluations, and
the paired ratio's interval and sign test (issue 42 part 2)."""

from __future__ import annotations

import math

import pytest
from paired_report import paired, seconds_to


def run(side: str, seed: int, evals: list[tuple[int, float, float]]) -> dict:
    return {"side": side, "seed": seed, "evals": [list(e) for e in evals], "seconds_per_step": 1.0}


def test_seconds_to_is_the_first_evaluation_at_or_above_the_target():
    r = run("trl", 0, [(0, 0.0, 0.4), (2, 20.0, 0.79), (4, 40.0, 0.8), (6, 60.0, 0.9)])
    assert seconds_to(r, 0.8) == 40.0
    assert seconds_to(r, 0.95) is None


def test_the_ratio_is_paired_by_seed_and_a_wide_interval_is_not_resolved():
    runs = []
    for seed, (a, b) in enumerate([(10.0, 20.0), (30.0, 20.0), (5.0, 40.0)]):
        runs.append(run("echo2-hf", seed, [(0, 0.0, 0.4), (2, a, 0.85)]))
        runs.append(run("trl", seed, [(0, 0.0, 0.4), (2, b, 0.85)]))
    out = paired(runs, 0.8)
    assert [s["ratio"] for s in out["seeds"]] == [0.5, 1.5, 0.125]
    assert out["geomean_ratio"]["estimate"] == pytest.approx(math.exp(math.log(0.5 * 1.5 * 0.125) / 3))
    assert out["sign_test"] == {"echo2_faster": 2, "n": 3, "p_two_sided": 1.0}
    assert out["resolved"] is False  # one seed the other way: the interval contains ratio 1


def test_a_consistent_ratio_is_resolved():
    runs = []
    for seed, ratio in enumerate([0.5, 0.45, 0.55, 0.5]):
        runs.append(run("echo2-hf", seed, [(2, 100.0 * ratio, 0.9)]))
        runs.append(run("trl", seed, [(2, 100.0, 0.9)]))
    out = paired(runs, 0.8)
    assert out["resolved"] is True and out["geomean_ratio"]["high"] < 1
    assert out["sign_test"]["echo2_faster"] == 4 and out["seeds_for_80pct_power"] <= 4
