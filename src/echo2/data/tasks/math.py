"""Math word problems from a JSONL or Parquet file, answers checked with math-verify.

Rows are validated when the task is built: a missing field or a bad row raises `TaskFileError`
naming the file, the line (row) and the field, before any model is loaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from echo2.config import ConfigError, MathTaskConfig
from echo2.data.tasks.base import Prompt, Score, full_loss_mask, stable_id

SYSTEM = "Solve the problem step by step. Put the final answer in \\boxed{}."


class TaskFileError(ConfigError):
    """A task data file the user must fix; the message names file, line and field."""


def read_rows(path: str | Path, *, question_field: str, answer_field: str) -> list[tuple[str, str]]:
    """(question, answer) pairs; line numbers are 1-based (JSONL line, or Parquet row + 1)."""
    path = Path(path)
    if not path.is_file():
        raise TaskFileError(f"{path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        raw: list[tuple[int, Any]] = list(enumerate(pq.read_table(path).to_pylist(), start=1))
    else:
        raw = []
        with path.open() as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    raw.append((lineno, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise TaskFileError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
    rows = []
    for lineno, row in raw:
        if not isinstance(row, dict):
            raise TaskFileError(f"{path}:{lineno}: row is not an object")
        values = []
        for fld in (question_field, answer_field):
            if fld not in row:
                raise TaskFileError(f"{path}:{lineno}: missing field {fld!r}")
            value = row[fld]
            if (
                isinstance(value, bool)
                or not isinstance(value, str | int | float)
                or str(value).strip() == ""
            ):
                raise TaskFileError(f"{path}:{lineno}: field {fld!r} must be a non-empty string or number")
            values.append(str(value))
        rows.append((values[0], values[1]))
    if not rows:
        raise TaskFileError(f"{path}: no rows")
    return rows


class MathTask:
    def __init__(self, config: MathTaskConfig, *, seed: int) -> None:
        self.config = config
        self.seed = seed
        fields = {"question_field": config.question_field, "answer_field": config.answer_field}
        rows = read_rows(config.train_file, **fields)
        if config.eval_file:
            self.train_rows, self.eval_rows = rows, read_rows(config.eval_file, **fields)
        else:
            cut = max(1, int(len(rows) * (1 - config.eval_fraction)))
            if cut >= len(rows):
                raise TaskFileError(f"{config.train_file}: too few rows to hold out an eval split")
            self.train_rows, self.eval_rows = rows[:cut], rows[cut:]
        self._order = list(range(len(self.train_rows)))
        random.Random(seed).shuffle(self._order)

    def _prompt(self, split: str, i: int, question: str, answer: str) -> Prompt:
        return Prompt(
            group_id=stable_id("math", split, i),
            messages=({"role": "system", "content": SYSTEM}, {"role": "user", "content": question}),
            answer=answer,
        )

    def train_prompt(self, index: int) -> Prompt:
        epoch, pos = divmod(index, len(self._order))
        row = self._order[pos]
        q, a = self.train_rows[row]
        return self._prompt(f"train{epoch}", row, q, a)

    def eval_prompts(self, count: int) -> list[Prompt]:
        return [self._prompt("eval", i, q, a) for i, (q, a) in enumerate(self.eval_rows[:count])]

    def score(self, prompt: Prompt, response_text: str) -> Score:
        from math_verify import parse, verify

        gold = parse(prompt.answer if "$" in prompt.answer else f"${prompt.answer}$")
        pred = parse(response_text)
        if not pred:
            return Score(reward=0.0, correct=False, parsed=None)
        correct = bool(verify(gold, pred))
        return Score(reward=1.0 if correct else 0.0, correct=correct, parsed=str(pred[-1]))

    loss_mask = staticmethod(full_loss_mask)
    reward_range = (0.0, 1.0)
    verifiable = True
