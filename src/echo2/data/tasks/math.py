"""Math word problems from a local file (JSONL, or through `datasets`: Parquet, Arrow, CSV, JSON;
rows.py), flat or nested as DAPO-Math-17k's rows, answers checked with math-verify.

Rows are validated when the task is built: a missing field or a bad row raises `TaskFileError`
naming the file, the line (row) and the field, before any model is loaded (both live in rows.py).
"""

from __future__ import annotations

import random

from echo2.config import MathTaskConfig
from echo2.data.tasks.base import Prompt, Score, full_loss_mask, stable_id
from echo2.data.tasks.rows import Messages, TaskFileError, read_rows


class MathTask:
    def __init__(self, config: MathTaskConfig, *, seed: int) -> None:
        self.config = config
        self.seed = seed
        fields = {
            "question_field": config.question_field,
            "answer_field": config.answer_field,
            "template": config.prompt_template,
            "messages_field": config.messages_field,
            "system_prompt": config.system_prompt,
        }
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

    def _prompt(self, split: str, i: int, messages: Messages, answer: str) -> Prompt:
        return Prompt(group_id=stable_id("math", split, i), messages=messages, answer=answer)

    def train_prompt(self, index: int) -> Prompt:
        epoch, pos = divmod(index, len(self._order))
        row = self._order[pos]
        messages, answer = self.train_rows[row]
        return self._prompt(f"train{epoch}", row, messages, answer)

    def eval_prompts(self, count: int) -> list[Prompt]:
        return [self._prompt("eval", i, m, a) for i, (m, a) in enumerate(self.eval_rows[:count])]

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
