"""The time-to-accuracy study's pure parts (issue 23): the first evaluation reaching the target and
what a run counts up to it (a run stopped late counts nothing after it), the seeded plan and
`--resume`'s skipping, and the summary over fabricated runs, a side with a run that never reached
the target included. No model, no training."""

from __future__ import annotations

import json
import math

import pytest
import tta_summary as tta
from tta_summary import (
    compare,
    eval_due,
    first_reaching,
    kept_runs,
    plan,
    run_record,
    side_summary,
    summarize,
    to_run,
)

SETTINGS = {"steps": 50, "eval_every": 2, "eval_size": 100, "target": 0.8, "threads": 2}


def test_first_reaching_takes_the_first_at_or_above():
    evals = [(0, 0.0, 0.4), (2, 10.0, 0.79), (4, 20.0, 0.8), (6, 30.0, 0.9)]
    assert first_reaching(evals, 0.8) == {"step": 4, "seconds": 20.0, "accuracy": 0.8}
    assert first_reaching(evals, 0.95) is None
    assert first_reaching(evals, 0.3)["step"] == 0


def test_eval_due_every_k_and_at_the_last_step():
    assert [s for s in range(1, 8) if eval_due(s, 2, 7)] == [2, 4, 6, 7]


def test_run_record_counts_up_to_the_target_only():
    # 5 steps ran (the run was stopped one step late); the target is reached at step 4
    secs, toks = [1.0, 2.0, 3.0, 4.0, 5.0], [100, 110, 120, 130, 140]
    rec = run_record(secs, toks, [(0, 0.4), (2, 0.6), (4, 0.85), (5, 0.9)], 0.8)
    assert rec["reached"] == {"step": 4, "seconds": 10.0, "accuracy": 0.85}
    assert (rec["seconds_to_target"], rec["steps_to_target"], rec["tokens_to_target"]) == (10.0, 4, 460)
    assert rec["evals"] == [[0, 0.0, 0.4], [2, 3.0, 0.6], [4, 10.0, 0.85]]
    assert rec["step_seconds"] == [1.0, 2.0, 3.0, 4.0] and rec["step_tokens"] == [100, 110, 120, 130]
    assert rec["seconds_per_step"] == pytest.approx(2.5)
    assert rec["tokens_per_step"] == pytest.approx(115)
    assert rec["tokens_per_s"] == pytest.approx(46.0)


def test_run_record_never_reached_counts_every_step():
    rec = run_record([2.0, 2.0, 2.0], [50, 50, 50], [(0, 0.4), (2, 0.5), (3, 0.6)], 0.8)
    assert rec["reached"] is None
    assert rec["seconds_to_target"] is rec["steps_to_target"] is rec["tokens_to_target"] is None
    assert (rec["steps_counted"], rec["train_seconds"], rec["generated_tokens"]) == (3, 6.0, 150)
    assert rec["tokens_per_s"] == pytest.approx(25.0)
    with pytest.raises(ValueError):
        run_record([1.0], [1, 2], [], 0.8)


def test_plan_interleaves_sides_by_seed():
    sides = tta.sides_of(["hf"], trl=True)
    assert sides == ["echo2-hf", "trl"]
    assert plan(sides, [0, 1, 2]) == [
        ("echo2-hf", 0),
        ("trl", 0),
        ("echo2-hf", 1),
        ("trl", 1),
        ("echo2-hf", 2),
        ("trl", 2),
    ]


def test_resume_skips_runs_with_the_same_settings_only():
    other = {**SETTINGS, "eval_every": 5}
    previous = {
        "runs": [
            {"side": "echo2-hf", "seed": 0, "settings": SETTINGS, "x": 1},
            {"side": "trl", "seed": 0, "settings": other, "x": 2},  # other settings: rerun
            {"side": "echo2-hf", "seed": 1, "settings": SETTINGS, "x": 3},
        ]
    }
    kept = kept_runs(json.loads(json.dumps(previous)), SETTINGS)  # as read back from the JSON
    assert [(r["side"], r["seed"]) for r in kept] == [("echo2-hf", 0), ("echo2-hf", 1)]
    todo = to_run(plan(["echo2-hf", "trl"], [0, 1, 2]), kept)
    assert todo == [("trl", 0), ("trl", 1), ("echo2-hf", 2), ("trl", 2)]
    assert kept_runs(None, SETTINGS) == []


def _run(side: str, seed: int, seconds: float | None, *, steps: int = 10) -> dict:
    """A fabricated run: reaching the target at `seconds` (None: never, after `steps` steps of 9 s)."""
    if seconds is None:
        rec = run_record([9.0] * steps, [400] * steps, [(0, 0.4), (steps, 0.7)], 0.8)
    else:
        n = 4
        rec = run_record([seconds / n] * n, [400] * n, [(0, 0.4), (2, 0.6), (4, 0.82)], 0.8)
    return {"side": side, "seed": seed, "settings": SETTINGS, **rec}


def test_side_summary_shows_the_runs_that_never_reached():
    runs = [_run("trl", s, t) for s, t in enumerate([40.0, 50.0, 60.0, 70.0])] + [_run("trl", 4, None)]
    s = side_summary(runs, 0.8)
    assert (s["n"], s["reached"]) == (5, 4)
    assert s["not_reached"] == [{"seed": 4, "steps_run": 10, "train_seconds": 90.0, "best_accuracy": 0.7}]
    assert s["median_seconds"] == pytest.approx(55.0)
    assert s["median_seconds_lower_bound"] == pytest.approx(60.0)  # the unreached run at its 90 s
    ci = s["median_seconds_ci"]
    assert ci["low"] <= 55.0 <= ci["high"] and ci["n"] == 4 and "bootstrap" in ci["method"]
    mean = s["mean_seconds_ci"]
    assert mean["estimate"] == pytest.approx(55.0) and mean["method"] == "t" and mean["df"] == 3
    assert s["steps_to_target"] == [4, 4, 4, 4] and s["tokens_to_target"] == [1600] * 4
    assert s["tokens_per_s"]["n"] == 5


def test_side_summary_all_reached_has_no_lower_bound_and_one_run_no_interval():
    s = side_summary([_run("a", 0, 10.0), _run("a", 1, 12.0)], 0.8)
    assert s["not_reached"] == [] and "median_seconds_lower_bound" not in s
    one = side_summary([_run("a", 0, 10.0)], 0.8)
    assert one["median_seconds"] == 10.0 and "median_seconds_ci" not in one


def test_compare_resolves_a_clear_gap_and_not_an_overlapping_one():
    fast = [_run("a", s, t) for s, t in enumerate([20.0, 21.0, 22.0, 23.0, 24.0])]
    slow = [_run("b", s, t) for s, t in enumerate([40.0, 42.0, 44.0, 46.0, 48.0])]
    c = compare(fast, slow, "a", "b")
    assert c["ratio_of_medians"] == pytest.approx(22.0 / 44.0)
    assert c["ratio_ci"][0] <= c["ratio_of_medians"] <= c["ratio_ci"][1] < 1
    assert c["resolved"] and "a faster" in c["text"]
    mixed = [_run("b", s, t) for s, t in enumerate([15.0, 30.0, 22.0, 18.0, 26.0])]
    c = compare(fast, mixed, "a", "b")
    assert not c["resolved"] and "not resolved" in c["text"] and "not resolved" in c["words"]
    assert c["ratio_ci"][0] <= 1 <= c["ratio_ci"][1]


def test_summarize_pairs_sides_on_the_seeds_both_reached():
    runs = [_run("echo2-hf", s, 30.0 + s) for s in range(5)]
    runs += [_run("trl", s, 50.0 + s) for s in range(4)] + [_run("trl", 4, None)]
    out = summarize(runs, ["echo2-hf", "trl"], 0.8)
    assert out["sides"]["trl"]["not_reached"][0]["seed"] == 4
    c = out["comparisons"]["echo2-hf / trl"]
    assert c["seeds"] == [0, 1, 2, 3] and c["left_out_seeds"] == [4]
    assert c["ratio_of_medians"] == pytest.approx(31.5 / 51.5)
    assert math.isfinite(c["mean_difference_seconds"]["estimate"])
    json.dumps(out)  # the summary goes into the JSON as it is
    few = summarize([_run("a", 0, 10.0), _run("b", 0, 12.0)], ["a", "b"], 0.8)
    assert "no interval" in few["comparisons"]["a / b"]["text"]
