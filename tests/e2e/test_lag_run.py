"""`echo2 run --rollout.lag=2` on the tiny model: every step trains on records exactly min(step, 2)
versions old, the off-policy diagnostics are in every row (split by that staleness), and each
correction trains to a finite loss."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from support import TINY

from echo2.cli import main
from echo2.metrics import read_metrics

TOY = ["--task.type=custom", "--task.factory=toy_task:Vowels"]  # rewards that vary on a random model


@pytest.mark.parametrize("correction", ["clip", "dual_clip", "tis", "decoupled"])
def test_a_lagged_run_trains_on_records_exactly_lag_versions_old(tmp_path, monkeypatch, correction):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    run_dir = tmp_path / "run"
    args = [
        "run",
        TINY,
        *TOY,
        "--learner.steps=5",
        "--rollout.lag=2",
        "--learner.staleness=2",
        "--run.eval_size=0",
    ]
    assert (
        main([*args, f"--learner.correction={correction}", "--learner.lr=1e-3", f"--run.dir={run_dir}", "-q"])
        == 0
    )
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["staleness/max"] for r in rows] == [0, 1, 2, 2, 2]
    assert [r["staleness/mean"] for r in rows] == [0, 1, 2, 2, 2]
    for r in rows:
        k = int(r["staleness/max"])
        assert r[f"offpolicy/ratio_p99@s{k}"] == r["offpolicy/ratio_p99"]
        assert math.isfinite(r["train/loss"]) and r["offpolicy/ratio_max"] >= r["offpolicy/ratio_p99"]
    assert rows[0]["offpolicy/kl_behaviour"] == pytest.approx(0.0, abs=1e-4), "on-policy: learner = engine"
    assert any(r["offpolicy/kl_behaviour"] > 1e-4 for r in rows[2:]), "stale records: pi differs from mu"
