from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from echo2.config import ArithmeticTaskConfig, MathTaskConfig
from echo2.data.tasks import make_task
from echo2.data.tasks.arithmetic import extract_integer
from echo2.data.tasks.rows import TaskFileError


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("12", "12"),
        ("The answer is 1,234.", "1234"),
        ("3 + 4 = 7", "7"),
        ("Answer: -5 because 2 - 7 is -5", "-5"),
        ("Answer: 8. Check: 4 + 4 = 8; also 9", "9"),
        ("I cannot compute that.", None),
        ("", None),
    ],
)
def test_extract_integer(text, want):
    assert extract_integer(text) == want


def test_arithmetic_scoring_including_malformed_answers():
    task = make_task(ArithmeticTaskConfig(), seed=0)
    prompt = task.train_prompt(0)
    right = task.score(prompt, f"The result is {prompt.answer}.")
    assert right.correct and right.reward == 1.0
    wrong = task.score(prompt, f"The result is {int(prompt.answer) + 1}.")
    assert not wrong.correct and wrong.reward == 0.0
    garbage = task.score(prompt, "banana")
    assert garbage.reward == 0.0 and garbage.parsed is None


def test_arithmetic_is_seeded_and_eval_is_held_out():
    a, b = make_task(ArithmeticTaskConfig(), seed=1), make_task(ArithmeticTaskConfig(), seed=1)
    assert [a.train_prompt(i) for i in range(20)] == [b.train_prompt(i) for i in range(20)]
    c = make_task(ArithmeticTaskConfig(), seed=2)
    assert [p.group_id for p in (a.train_prompt(i) for i in range(20))] != [
        p.group_id for p in (c.train_prompt(i) for i in range(20))
    ]
    evals = {p.metadata["question"] for p in a.eval_prompts(1000)}
    trains = {a.train_prompt(i).metadata["question"] for i in range(3000)}
    assert evals and not evals & trains
    assert len(evals) == len(a.eval_prompts(1000)), "eval problems are distinct"


def test_arithmetic_answers_are_right():
    task = make_task(ArithmeticTaskConfig(difficulty=3), seed=0)
    for i in range(50):
        p = task.train_prompt(i)
        a, op, b = p.metadata["question"].rstrip(" =").split()
        assert str(eval(f"{a}{op}{b}")) == p.answer  # noqa: S307 - test-only check


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_math_task_scores_with_math_verify(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(10)]
    rows.append({"question": "Half of one?", "answer": "\\frac{1}{2}"})
    f = write_jsonl(tmp_path / "t.jsonl", rows)
    task = make_task(MathTaskConfig(train_file=str(f), eval_fraction=0.2), seed=0)
    assert len(task.eval_prompts(100)) == 3
    half = task.eval_prompts(100)[-1]
    assert task.score(half, "So the answer is \\boxed{0.5}.").correct
    assert task.score(half, "The answer is $\\frac{2}{4}$").correct
    assert not task.score(half, "\\boxed{2}").correct
    malformed = task.score(half, "no idea")
    assert not malformed.correct and malformed.reward == 0.0


def test_math_task_reads_parquet(tmp_path):
    f = tmp_path / "t.parquet"
    pq.write_table(pa.table({"problem": ["1+1?", "2+2?"], "solution": [2, 4]}), f)
    task = make_task(
        MathTaskConfig(
            train_file=str(f), eval_file=str(f), question_field="problem", answer_field="solution"
        ),
        seed=0,
    )
    p = task.train_prompt(0)
    assert task.score(p, f"\\boxed{{{p.answer}}}").correct


@pytest.mark.parametrize(
    ("rows", "where"),
    [
        ([{"question": "q", "answer": "1"}, {"question": "q2"}], ":2: missing field 'answer'"),
        ([{"question": "q", "answer": "1"}, "{not json"], ":2: invalid JSON"),
        ([{"question": "", "answer": "1"}], ":1: field 'question' must be"),
        ([{"question": "q", "answer": None}], ":1: field 'answer' must be"),
        (["[1, 2]"], ":1: row is not an object"),
    ],
)
def test_bad_task_file_names_file_line_and_field(tmp_path, rows, where):
    f = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TaskFileError, match="bad.jsonl" + where.replace("(", r"\(")):
        make_task(MathTaskConfig(train_file=str(f), eval_file=str(f)), seed=0)


def test_bad_task_file_exits_2_from_the_cli(tmp_path, capsys):
    from echo2.cli import main

    f = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q"}])
    tiny_toml = Path(__file__).parents[2] / "configs" / "tiny.toml"
    code = main(
        [
            "run",
            str(tiny_toml),
            "--task.type=math",
            f"--task.train_file={f}",
            f"--run.dir={tmp_path / 'run'}",
            "-q",
        ]
    )
    assert code == 2
    assert "bad.jsonl:1: missing field 'answer'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "nothing starts"


def test_encode_prompt_gives_the_tokenizers_own_ids():
    """encode_prompt calls a fast tokenizer's Rust backend directly (the referee encodes one prompt
    per leased group); the ids must be those of `tokenizer(text)`, chat template and all, or the
    referee would refuse honest records as wrong_prompt."""
    from echo2.config import TinyModelConfig
    from echo2.data.tasks.base import Prompt
    from echo2.models import load_tokenizer
    from echo2.rollout.engine import encode_prompt

    tok = load_tokenizer(TinyModelConfig())
    task = make_task(ArithmeticTaskConfig(), seed=3)
    prompts = [task.train_prompt(i) for i in range(200)]
    odd = {"role": "user", "content": " spaces  \n\t naïve 東京 ✓"}
    prompts.append(Prompt(group_id="g", messages=(odd,), answer="0"))
    assert getattr(tok, "backend_tokenizer", None) is not None, "the fast path is what is tested"
    for p in prompts:
        text = tok.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=False)
        assert encode_prompt(tok, p) == tok(text, add_special_tokens=False).input_ids
