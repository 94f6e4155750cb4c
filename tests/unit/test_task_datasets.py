"""The math task's rows through `datasets`: Parquet, Arrow, a save_to_disk directory and CSV,
local files only (a socket that refuses to connect proves no network), a column mapping and a
prompt template; a bad file or template is one error naming it."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from echo2.config import ConfigError, MathTaskConfig
from echo2.data.tasks import make_task
from echo2.data.tasks.rows import TaskFileError

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


# ---------------------------------------------------------------------------- nested rows (DAPO-Math-17k)
DAPO_SAMPLE = Path(__file__).parents[2] / "configs" / "data" / "dapo-math-sample.jsonl"
DAPO = {"messages_field": "prompt", "answer_field": "reward_model.ground_truth", "system_prompt": ""}


def dapo_rows():
    return [json.loads(line) for line in DAPO_SAMPLE.read_text().splitlines()]


def test_dapo_rows_map_to_their_own_messages_and_nested_answers(tmp_path):
    rows = dapo_rows()
    assert set(rows[0]) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    from datasets import Dataset

    Dataset.from_list(rows).to_parquet(str(tmp_path / "dapo.parquet"))  # structs and a list of structs
    seen = {}
    for path in (DAPO_SAMPLE, tmp_path / "dapo.parquet"):
        task = make_task(MathTaskConfig(train_file=str(path), eval_file=str(path), **DAPO), seed=0)
        prompts = task.eval_prompts(100)
        seen[path.suffix] = [(p.messages, p.answer) for p in prompts]
        assert [p.answer for p in prompts] == [r["reward_model"]["ground_truth"] for r in rows]
        assert prompts[0].messages == ({"role": "user", "content": rows[0]["prompt"][0]["content"]},)
        assert task.score(prompts[0], "1 + 2 + ... + 20 = 210.\nAnswer: 210").correct
        assert (
            task.score(prompts[-1], "Answer: -4").correct and not task.score(prompts[-1], "Answer: 4").correct
        )
    assert seen[".jsonl"] == seen[".parquet"]


def test_a_system_prompt_goes_before_the_rows_messages(tmp_path):
    config = MathTaskConfig(
        train_file=str(DAPO_SAMPLE), eval_file=str(DAPO_SAMPLE), **{**DAPO, "system_prompt": "Be brief."}
    )
    first = make_task(config, seed=0).eval_prompts(1)[0]
    assert [m["role"] for m in first.messages] == ["system", "user"]
    assert first.messages[0]["content"] == "Be brief."
    own = [
        {
            "prompt": [{"role": "system", "content": "Mine."}, {"role": "user", "content": "1+1?"}],
            "a": {"b": 2},
        }
    ]
    f = write_jsonl(tmp_path / "own.jsonl", own)
    mapping = {"train_file": str(f), "eval_file": str(f), "messages_field": "prompt", "answer_field": "a.b"}
    kept = make_task(MathTaskConfig(**mapping, system_prompt=""), seed=0).eval_prompts(1)[0]
    assert kept.messages[0] == {"role": "system", "content": "Mine."} and kept.answer == "2"
    with pytest.raises(
        TaskFileError,
        match=r'own.jsonl:1: .*message 0: the row has its own system message; set task.system_prompt = ""',
    ):
        make_task(MathTaskConfig(**mapping), seed=0)


def test_dotted_paths_read_nested_columns_and_an_exact_name_comes_first(tmp_path):
    rows = [{"meta": {"q": "2+2?", "level": 1}, "gold": {"value": 4}, "gold.value": 5}]
    f = write_jsonl(tmp_path / "n.jsonl", rows)
    config = MathTaskConfig(
        train_file=str(f),
        eval_file=str(f),
        question_field="meta.q",
        answer_field="gold.value",
        prompt_template="{question} (level {meta[level]})",
    )
    p = make_task(config, seed=0).eval_prompts(1)[0]
    assert p.messages[-1]["content"] == "2+2? (level 1)" and p.answer == "5"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = {"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}


@pytest.mark.parametrize(
    ("bad", "where"),
    [
        ({"prompt": GOOD["prompt"]}, ":2: missing field 'reward_model.ground_truth'"),
        (
            {**GOOD, "reward_model": "2"},
            ":2: missing field 'reward_model.ground_truth' ('reward_model' is not an object)",
        ),
        ({**GOOD, "reward_model": {"ground_truth": ""}}, ":2: field 'reward_model.ground_truth' must be"),
        ({**GOOD, "prompt": "1+1?"}, ":2: field 'prompt' must be a non-empty list"),
        ({**GOOD, "prompt": []}, ":2: field 'prompt' must be a non-empty list"),
        (
            {**GOOD, "prompt": [{"role": "bot", "content": "x"}]},
            ":2: field 'prompt' message 0: must be {role",
        ),
        (
            {**GOOD, "prompt": [{"role": "user", "content": " "}]},
            ":2: field 'prompt' message 0: empty content",
        ),
        (
            {**GOOD, "prompt": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}]},
            "message 1: a system message may only come first",
        ),
        (
            {**GOOD, "prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            ":2: field 'prompt': the last message must be the user's",
        ),
    ],
)
def test_a_bad_nested_row_names_file_row_and_field(tmp_path, bad, where):
    f = write_jsonl(tmp_path / "bad.jsonl", [GOOD, bad])
    config = MathTaskConfig(train_file=str(f), eval_file=str(f), **DAPO)
    with pytest.raises(TaskFileError, match=re.escape(where)):
        make_task(config, seed=0)


@pytest.mark.parametrize("key", ["question_field", "prompt_template"])
def test_messages_field_refuses_the_keys_it_replaces(key):
    from echo2.config.files import build_config

    task = {"type": "math", "train_file": "x.jsonl", "messages_field": "prompt", key: "{problem}"}
    with pytest.raises(ConfigError, match=f"^task.{key}: not used with task.messages_field"):
        build_config({"task": task})


def test_a_file_under_home_is_found(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write_jsonl(tmp_path / "rows.jsonl", [GOOD])
    config = MathTaskConfig(train_file="~/rows.jsonl", eval_file="~/rows.jsonl", **DAPO)
    assert make_task(config, seed=0).eval_prompts(1)[0].answer == "2"
