"""Synthetic arithmetic with a verified integer answer.

Problem i of seed s is a pure function of (s, i), so runs are reproducible and resumable.
Difficulty = digits per operand. The problem space is split by a hash of the problem: one problem in
ten is held out, and training never draws it, so evaluation measures generalisation, not recall.
"""

from __future__ import annotations

import random
import re

from echo2.config import ArithmeticTask as ArithmeticConfig
from echo2.data.tasks.base import Prompt, Score, full_loss_mask, stable_id

SYSTEM = "You are a calculator. Reply with the result only."
_INT = re.compile(r"-?\d[\d,]*")


def extract_integer(text: str) -> str | None:
    """The answer read from a response: the number after 'Answer:' if present, else the last one."""
    tail = text.rsplit("Answer:", 1)[-1] if "Answer:" in text else text
    found = _INT.findall(tail)
    return found[-1].replace(",", "") if found else None


class ArithmeticTask:
    def __init__(self, config: ArithmeticConfig, *, seed: int) -> None:
        self.config = config
        self.seed = seed

    def _problem(self, stream: int, index: int, *, held_out: bool) -> Prompt:
        rng = random.Random(stable_id("arith", stream, index, self.config.difficulty))
        lo, hi = 10 ** (self.config.difficulty - 1), 10**self.config.difficulty - 1
        while True:  # rejection sampling into the train or held-out part of the problem space
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            op = rng.choice(self.config.operations)
            if (int(stable_id(a, op, b), 16) % 10 == 0) == held_out:
                break
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = f"{a} {op} {b} ="
        return Prompt(
            group_id=stable_id("arith", stream, index),
            messages=({"role": "system", "content": SYSTEM}, {"role": "user", "content": question}),
            answer=str(value),
            metadata={"question": question},
        )

    def train_prompt(self, index: int) -> Prompt:
        return self._problem(self.seed, index, held_out=False)

    def eval_prompts(self, count: int) -> list[Prompt]:
        # The same held-out problems for every seed, so runs compare on one set.
        return [self._problem(-1, i, held_out=True) for i in range(count)]

    def score(self, prompt: Prompt, response_text: str) -> Score:
        parsed = extract_integer(response_text)
        correct = parsed is not None and parsed.lstrip("+") == prompt.answer
        return Score(reward=1.0 if correct else 0.0, correct=correct, parsed=parsed)

    loss_mask = staticmethod(full_loss_mask)
