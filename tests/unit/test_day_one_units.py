"""Pure pieces behind the day-one fixes: fresh run directories, config-relative file names,
samples and the zero-variance signal, the warning's cadence."""

from __future__ import annotations

import logging

from support import TINY

from echo2.config import load_config
from echo2.preflight import fresh_run_dir
from echo2.records import Trajectory
from echo2.tracking import Tracker, pick_samples, signal_stats


def rec(group: str, reward: float, i: int = 0) -> Trajectory:
    return Trajectory(
        group_id=group,
        prompt_ids=(1, 2),
        response_ids=(3,),
        behaviour_logprobs=(-0.1,),
        loss_mask=(1,),
        reward=reward,
        version=0,
        record_id=f"{group}-{i}",
    )


def test_fresh_run_dir_takes_the_first_free_suffix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.toml").write_text('[run]\nname = "x"\n')
    config = load_config(tmp_path / "cfg.toml")
    assert str(fresh_run_dir(config)) == "runs/x-seed0"
    for taken in ("runs/x-seed0", "runs/x-seed0-2"):
        (tmp_path / taken).mkdir(parents=True)
    assert str(fresh_run_dir(config)) == "runs/x-seed0-3"
    explicit = load_config(tmp_path / "cfg.toml", {"run.dir": "runs/x-seed0"})
    assert str(fresh_run_dir(explicit)) == "runs/x-seed0", "an empty explicit directory is used as given"


def test_file_names_in_a_config_are_relative_to_it(tmp_path, monkeypatch):
    folder = tmp_path / "proj"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "t.jsonl").write_text("{}\n")
    (folder / "c.toml").write_text(
        '[model]\ntype = "hf"\npath = "org/name"\n[task]\ntype = "math"\ntrain_file = "data/t.jsonl"\n'
        '[scheduler]\npool = "missing-pool.toml"\n'
    )
    monkeypatch.chdir(tmp_path)
    config = load_config(folder / "c.toml")
    assert config.task.train_file == str(folder / "data" / "t.jsonl")
    assert config.model.path == "org/name", "a hub id stays a hub id"
    assert config.scheduler.pool == str(folder / "missing-pool.toml"), (
        "a missing file is named where looked for"
    )
    cli = load_config(folder / "c.toml", {"task.train_file": "other.jsonl"})
    assert cli.task.train_file == "other.jsonl", "command-line values are relative to the working directory"
    (folder / "custom.toml").write_text('[task]\ntype = "custom"\nfactory = "m:T"\npythonpath = ["lib"]\n')
    assert load_config(folder / "custom.toml").task.pythonpath == [str(folder / "lib"), str(folder)]


def test_samples_are_spread_over_groups_and_flat_groups_counted():
    groups = [[rec("a", 1.0, 0), rec("a", 0.0, 1)], [rec("b", 0.5, 0), rec("b", 0.5, 1)]]
    assert [r.record_id for r in pick_samples(groups, 3)] == ["a-0", "b-0", "a-1"]
    assert pick_samples(groups, 10) == [r for i in range(2) for g in groups for r in [g[i]]]
    assert signal_stats(groups) == {"reward/zero_std_fraction": 0.5}
    assert signal_stats([groups[1]]) == {"reward/zero_std_fraction": 1.0}


def test_the_zero_variance_warning_is_not_repeated_every_step(tmp_path, caplog):
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    config = load_config(TINY)
    tracker = Tracker(config, tmp_path, Tok())
    flat = [[rec("b", 0.5, 0), rec("b", 0.5, 1)]]
    with caplog.at_level(logging.WARNING, logger="echo2.tracking"):
        for step in range(30):
            tracker.log_step(step, {"reward/zero_std_fraction": 1.0, "reward/mean": 0.5}, flat)
    tracker.close()
    warned = [r.getMessage() for r in caplog.records if "no gradient" in r.getMessage()]
    # not for 4 flat steps in a row (the quickstart's late steps), then at the 5th and every 25th after
    assert len(warned) == 2 and warned[0].startswith("step 4:") and warned[1].startswith("step 29:")
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 30 * 2 and '"completion": "3"' in lines[0]


def test_short_runs_of_flat_steps_do_not_warn(tmp_path, caplog):
    """A healthy run has single steps where every answer is right (or wrong): the quickstart printed
    the warning 5 times for those (issue 43), so only WARN_AFTER flat steps in a row warn."""

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    tracker = Tracker(load_config(TINY), tmp_path, Tok())
    flat = [[rec("b", 1.0, 0), rec("b", 1.0, 1)]]
    with caplog.at_level(logging.WARNING, logger="echo2.tracking"):
        for step in range(40):
            share = 0.5 if step % 5 == 4 else 1.0  # 4 flat steps, then one with some variance
            tracker.log_step(step, {"reward/zero_std_fraction": share, "reward/mean": 1.0}, flat)
    tracker.close()
    assert not [r for r in caplog.records if "no gradient" in r.getMessage()]
