"""One staleness histogram, the learner's: a run over a worker process, resumed, writes in
summary.json (and shows on GET /status) the learner's whole-run histogram, which its checkpoint
carries across the resume, so it equals the cumulative counts of the last metrics row."""

from __future__ import annotations

import json
import os
from pathlib import Path

from support import TINY

from echo2.cli import main
from echo2.metrics import read_metrics

HERE = Path(__file__).parent


def test_summary_histogram_after_a_resume_is_the_metrics_one(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("PYTHONPATH", str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run_dir = tmp_path / "run"
    common = [
        "--workers=1",
        "--coordinator.heartbeat_interval=0.2",
        "--run.eval_size=0",
        "--run.threads=1",
        "-q",
    ]
    first = [TINY, f"--run.dir={run_dir}", "--task.type=custom", "--task.factory=toy_task:Vowels"]
    assert main(["run", *first, "--learner.staleness=2", "--learner.steps=3", *common]) == 0
    assert main(["run", "--resume", str(run_dir), "--learner.steps=5", *common]) == 0

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    from_metrics = {
        k.removeprefix("staleness/count_"): int(v)
        for k, v in rows[-1].items()
        if k.startswith("staleness/count_")
    }
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["staleness_histogram"] == from_metrics
    per_step = 2 * 4  # prompts_per_step x group_size of tiny.toml
    assert sum(from_metrics.values()) == 5 * per_step, "the whole run's records, both processes'"
    assert summary["t_train"] > 0, "the coordinator's own measurements are still in the summary"
