"""`echo2 run` end to end on the tiny random model: a 3-step run, then resume to 5 steps."""

from __future__ import annotations

import json
from pathlib import Path

from support import TINY

from echo2.cli import main
from echo2.metrics import read_metrics

TOY = ["--task.type=custom", "--task.factory=toy_task:Vowels"]  # rewards that vary on a random model


def test_three_step_run_then_resume(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["run", TINY, f"--run.dir={run_dir}", "-q"]) == 0  # arithmetic on a random model
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["version"] == 3
    for key in (
        "reward/mean",
        "reward/accuracy",
        "train/loss",
        "train/kl",
        "train/clip_fraction",
        "staleness/mean",
        "time/step",
        "time/learner_wait",
        "throughput/rollout_tokens_per_s",
        "throughput/train_tokens_per_s",
    ):
        assert key in rows[0]
    assert all(r["staleness/max"] == 0 for r in rows)
    assert "time/rollout" not in rows[0], "the learner's wait is reported once, as time/learner_wait"
    assert [r["staleness/count_0"] for r in rows] == [8.0, 16.0, 24.0], "one cumulative histogram"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_before"]["eval/count"] == 4 and summary["eval_after"] is not None
    state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    assert state["step"] == 3 and state["version"] == 3 and state["source"]["next_prompt"] == 6
    assert state["staleness_histogram"] == {"0": 24} == summary["staleness_histogram"]
    assert "held-out accuracy" in capsys.readouterr().out

    # a second plain start refuses to overwrite the run
    assert main(["run", TINY, f"--run.dir={run_dir}", "-q"]) == 2
    assert "--resume" in capsys.readouterr().err

    assert main(["run", "--resume", str(run_dir), "--learner.steps=5", "-q"]) == 0
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and rows[-1]["version"] == 5
    state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    assert state["source"]["next_prompt"] == 10, "prompts continue where the first run stopped"
    assert rows[-1]["staleness/count_0"] == 40.0, "the histogram is restored with the checkpoint"
    assert json.loads((run_dir / "summary.json").read_text())["eval_before"] == summary["eval_before"]


def test_resume_continues_identically(tmp_path, monkeypatch):
    """3 steps + resume to 5 == 5 steps straight (model, optimizer and prompt cursor restored), on a
    task whose rewards vary so that every step really updates the weights."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = [*TOY, "--learner.lr=1e-3", "--run.eval_size=0", "-q"]
    assert main(["run", TINY, f"--run.dir={straight}", "--learner.steps=5", *common]) == 0
    assert main(["run", TINY, f"--run.dir={split}", "--learner.steps=3", *common]) == 0
    weights_at_3 = (split / "checkpoint" / "model.safetensors").read_bytes()
    assert main(["run", "--resume", str(split), "--learner.steps=5", "-q"]) == 0
    assert (split / "checkpoint" / "model.safetensors").read_bytes() != weights_at_3
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(split / "metrics.jsonl")
    assert len(a) == len(b) == 5
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["reward/mean"] - rb["reward/mean"]) < 1e-6
        assert abs(ra["train/loss"] - rb["train/loss"]) < 1e-5
    assert (straight / "checkpoint" / "model.safetensors").read_bytes() == (
        split / "checkpoint" / "model.safetensors"
    ).read_bytes()


def test_a_custom_task_plugs_in_and_trains(tmp_path, monkeypatch):
    """A task defined outside the package (tests/e2e/toy_task.py) runs with no learner or rollout
    change; its rewards vary within groups, so every step has a gradient and moves the weights."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    run_dir = tmp_path / "toy"
    assert (
        main(["run", TINY, f"--run.dir={run_dir}", *TOY, "--learner.steps=2", "--run.eval_size=2", "-q"]) == 0
    )
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert all(r["train/grad_norm"] > 0 and r["train/adv_abs_mean"] > 0 for r in rows)
    assert 0 < rows[0]["reward/mean"] < 1


def test_unknown_custom_task_exits_2(tmp_path, capsys):
    assert (
        main(
            [
                "run",
                TINY,
                f"--run.dir={tmp_path / 'r'}",
                "--task.type=custom",
                "--task.factory=nowhere:Task",
                "-q",
            ]
        )
        == 2
    )
    assert "task.factory: cannot load 'nowhere:Task'" in capsys.readouterr().err


def test_a_bad_model_path_exits_2_and_writes_nothing(tmp_path, capsys):
    """The model is loaded before the run directory is created: a mistake leaves nothing behind."""
    run_dir = tmp_path / "run"
    missing = tmp_path / "no-such-model"
    assert (
        main(["run", TINY, f"--run.dir={run_dir}", "--model.type=hf", f"--model.path={missing}", "-q"]) == 2
    )
    err = capsys.readouterr().err
    assert "model.path" in err and str(missing) in err
    assert not run_dir.exists(), "no run directory, so no config.toml, for a run that never started"


def test_a_bad_tokenizer_file_exits_2_naming_the_key(tmp_path, capsys):
    run_dir = tmp_path / "run"
    bad = tmp_path / "none.gguf"
    assert main(["run", TINY, f"--run.dir={run_dir}", f"--model.tokenizer_file={bad}", "-q"]) == 2
    assert "model.tokenizer_file" in capsys.readouterr().err
    assert not run_dir.exists()


def test_eval_every_measures_held_out_accuracy_during_the_run_and_changes_no_rollout(tmp_path, monkeypatch):
    """`run.eval_every = 1`: eval/accuracy after every step. With S = 3 (a snapshot every 2 steps)
    the engine is behind the learner at odd steps, so evaluating installs the current weights and
    puts the published ones back: rewards are those of a run that never evaluates."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    common = [
        *TOY,
        "--learner.steps=4",
        "--learner.staleness=3",
        "--learner.lr=1e-3",
        "--run.eval_size=4",
        "-q",
    ]
    assert main(["run", TINY, f"--run.dir={tmp_path / 'plain'}", *common]) == 0
    assert main(["run", TINY, f"--run.dir={tmp_path / 'eval'}", "--run.eval_every=1", *common]) == 0
    plain = read_metrics(tmp_path / "plain" / "metrics.jsonl")
    evaluated = read_metrics(tmp_path / "eval" / "metrics.jsonl")
    assert all("eval/accuracy" not in r for r in plain)
    assert all(r["eval/count"] == 4 and 0 <= r["eval/accuracy"] <= 1 for r in evaluated)
    assert [r["reward/mean"] for r in evaluated] == [r["reward/mean"] for r in plain]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert evaluated[-1]["eval/accuracy"] == summary["eval_after"]["eval/accuracy"], "the same weights"
