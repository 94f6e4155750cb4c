from __future__ import annotations

import pytest

from echo2.cli import main
from echo2.config import ConfigError, build_config, load_config, parse_overrides


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\ntype = "tiny"\n[learner]\nsteps = 2\nstaleness = 3\n')
    return path


def test_overrides_are_parsed_as_toml_values():
    got = parse_overrides(
        ["--learner.lr=1e-6", "--run.seed", "3", "--run.name=abc", "--task.operations=['+']"]
    )
    assert got == {"learner.lr": 1e-6, "run.seed": 3, "run.name": "abc", "task.operations": ["+"]}


def test_override_applies_and_defaults_derive(cfg_file):
    cfg = load_config(cfg_file, {"learner.lr": 3e-6})
    assert cfg.learner.lr == 3e-6
    assert cfg.learner.publish_every == 2  # kappa = max(1, S - 1) with S = 3


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("--learner.staleness=-1", "learner.staleness"),
        ("--rollout.group_size=1", "rollout.group_size"),
        ("--rollout.top_p=0", "rollout.top_p"),
        ("--rollout.top_p=1.5", "rollout.top_p"),
        ("--learner.typo=1", "learner.typo"),
        ("--learner.lr=fast", "learner.lr"),
        ("--learner.kappa=5", "learner.kappa"),
        ("--model.hidden_size=2", "model.hidden_size"),
        ("--task.type=poetry", "task"),
        ("--rollout.lag=4", "rollout.lag"),  # > learner.staleness = 3
        ("--learner.correction=ppo", "learner.correction"),
        ("--learner.dual_clip_delta=1", "learner.dual_clip_delta"),
        ("--learner.is_cap=0.5", "learner.is_cap"),
    ],
)
def test_bad_values_exit_2_naming_the_key(cfg_file, tmp_path, capsys, override, key):
    run_dir = tmp_path / "run"
    assert main(["run", str(cfg_file), override, f"--run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, "one line"
    assert f"config error: {key}" in err
    assert not run_dir.exists(), "nothing starts"


def test_missing_file_and_bad_toml_name_the_file(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml: no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner\n")
    assert main(["run", str(bad)]) == 2
    assert "bad.toml: invalid TOML" in capsys.readouterr().err


def test_dry_run_prints_resolved_config(cfg_file, capsys):
    assert main(["run", str(cfg_file), "--dry-run", "--learner.lr=7e-7"]) == 0
    out = capsys.readouterr().out
    assert "lr = 7e-07" in out and 'type = "tiny"' in out
    import tomllib

    assert build_config(tomllib.loads(out)).learner.lr == 7e-7  # the dump round-trips


def test_resume_needs_a_run_dir(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_override_into_a_value_is_refused():
    with pytest.raises(ConfigError, match="learner.lr.x"):
        build_config({"learner": {"lr": 1e-6}}, {"learner.lr.x": 1})
