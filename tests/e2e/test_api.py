"""The Python API: the README's example runs as written (tiny model, poker, two steps), and a
mistake in `set` names the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from echo2.api import Echo2
from echo2.config import ConfigError

ROOT = Path(__file__).parents[2]


def test_the_readme_example_runs(tmp_path, monkeypatch, capsys):
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"<!-- api-example -->\n```python\n(.*?)```", readme, re.S).group(1)
    assert len(code.strip().splitlines()) <= 10
    monkeypatch.chdir(ROOT)  # the example names configs/tiny.toml
    exec(compile(code.replace("runs/api-demo", str(tmp_path / "api-demo")), "README", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[:2]] == ["0", "1"]  # one line per step
    assert "->" in out[-1]
    assert (tmp_path / "api-demo" / "summary.json").exists()


def test_set_changes_only_what_it_names():
    run = Echo2(str(ROOT / "configs" / "tiny.toml"))
    rollout = run.config.rollout
    run.set(staleness=2, task="poker:heads_up?opponent=random")
    assert run.config.learner.staleness == 2 and run.config.task.type == "env"
    assert run.config.rollout == rollout, "switching tasks changes no other section"
    with pytest.raises(ConfigError, match=r"^learner\.staleness"):
        run.set(staleness=-1)
    with pytest.raises(ConfigError, match=r"^task\.max_turns"):
        run.set({"task.max_turns": 0})
    with pytest.raises(ConfigError, match=r"^task\.env"):
        Echo2({"task": {"type": "env", "env": "nonsense"}})
