"""The math task's rows through `datasets`: Parquet, Arrow, a save_to_disk directory and CSV,
local files only (a socket that refuses to connect proves no network), a column mapping and a
prompt template; a bad file or template is one error naming it."""

from __future__ import annotations

import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from echo2.config import ConfigError, MathTaskConfig
from echo2.data.tasks import make_task
from echo2.data.tasks.math import TaskFileError

ROWS = {"problem": ["1+1?", "2+3?", "4*4?", "9-2?"], "solution": ["2", "5", "16", "7"], "level": [1, 1, 2, 1]}


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(self, address):
        raise OSError(f"test: no network ({address})")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def files(tmp_path):
    from datasets import Dataset

    table = pa.table(ROWS)
    pq.write_table(table, tmp_path / "t.parquet")
    data = Dataset.from_dict(ROWS)
    data.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    data.to_csv(str(tmp_path / "t.csv"), index=False)
    return {
        "parquet": tmp_path / "t.parquet",
        "dataset": tmp_path / "saved",
        "arrow": arrow,
        "csv": tmp_path / "t.csv",
    }


def test_every_format_gives_the_same_prompts(tmp_path):
    seen = {}
    for kind, path in files(tmp_path).items():
        config = MathTaskConfig(
            train_file=str(path),
            eval_file=str(path),
            question_field="problem",
            answer_field="solution",
            prompt_template="Problem (level {level}): {question}",
            system_prompt="Answer in \\boxed{}.",
        )
        task = make_task(config, seed=0)
        prompts = task.eval_prompts(10)
        seen[kind] = [(p.messages[1]["content"], p.answer) for p in prompts]
        assert prompts[0].messages[0]["content"] == "Answer in \\boxed{}."
        assert task.score(prompts[2], "\\boxed{16}").correct
    assert seen["parquet"][0] == ("Problem (level 1): 1+1?", "2")
    assert all(v == seen["parquet"] for v in seen.values()), seen


def test_a_template_naming_a_missing_column_names_the_key(tmp_path):
    path = files(tmp_path)["parquet"]
    config = MathTaskConfig(
        train_file=str(path),
        eval_file=str(path),
        question_field="problem",
        answer_field="solution",
        prompt_template="{question} ({topic})",
    )
    with pytest.raises(TaskFileError, match=r"task.prompt_template: .*t.parquet:1 has no column 'topic'"):
        make_task(config, seed=0)


def test_an_unreadable_file_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError) as e:
        make_task(MathTaskConfig(train_file=str(bad), eval_file=str(bad)), seed=0)
    assert str(e.value).startswith(f"{bad}: cannot read as parquet:") and "\n" not in str(e.value)
    odd = tmp_path / "rows.xlsx"
    odd.write_text("x")
    with pytest.raises(TaskFileError, match="unknown format"):
        make_task(MathTaskConfig(train_file=str(odd), eval_file=str(odd)), seed=0)
