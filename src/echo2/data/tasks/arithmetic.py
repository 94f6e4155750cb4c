"""Synthetic arithmetic with a verified integer answer.

Problem i of seed s is a pure function of (s, i), so runs are reproducible and resumable.
Difficulty d: the first operand has up to d digits, the second one digit. The problem space is split
by a hash of the problem: a fixed share is held out, training never draws it, and evaluation uses
distinct held-out problems, so it measures generalisation, not recall.
"""

from __future__ import annotations

import random
import re

from echo2.config import ArithmeticTaskConfig
from echo2.data.tasks.base import Prompt, Score, full_loss_mask, stable_id

SYSTEM = "You are a calculator. Reply with the result only."
_INT = re.compile(r"-?\d[\d,]*")


def extract_integer(text: str) -> str | None:
    """The answer read from a response: the number after 'Answer:' if present, else the last one."""
    tail = text.rsplit("Answer:", 1)[-1] if "Answer:" in text else text
    found = _INT.findall(tail)
    return found[-1].replace(",", "") if found else None


class ArithmeticTask:
    def __init__(self, config: ArithmeticTaskConfig, *, seed: int) -> None:
        self.config = config
        self.seed = seed

    def _held_out(self, a: int, op: str, b: int) -> bool:
        return int(stable_id(a, op, b), 16) % 1000 < self.config.eval_fraction * 1000

    def _draw(self, rng: random.Random, *, held_out: bool) -> tuple[int, str, int]:
        while True:  # rejection sampling into the training or the held-out part of the space
            a, b = rng.randint(0, 10**self.config.difficulty - 1), rng.randint(0, 9)
            op = rng.choice(self.config.operations)
            if self._held_out(a, op, b) == held_out:
                return a, op, b

    def _prompt(self, group_id: str, a: int, op: str, b: int) -> Prompt:
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = f"{a} {op} {b} ="
        return Prompt(
            group_id=group_id,
            messages=({"role": "system", "content": SYSTEM}, {"role": "user", "content": question}),
            answer=str(value),
            metadata={"question": question},
        )

    def train_prompt(self, index: int) -> Prompt:
        rng = random.Random(stable_id("arith", self.seed, index, self.config.difficulty))
        return self._prompt(stable_id("arith", self.seed, index), *self._draw(rng, held_out=False))

    def eval_prompts(self, count: int) -> list[Prompt]:
        """Up to `count` distinct held-out problems, the same for every seed (fewer if the held-out
        part of the problem space is smaller)."""
        rng = random.Random(stable_id("arith-eval", self.config.difficulty))
        seen: dict[tuple[int, str, int], None] = {}
        for _ in range(50 * count):
            if len(seen) == count:
                break
            seen.setdefault(self._draw(rng, held_out=True))
        return [self._prompt(stable_id("arith-eval", *p), *p) for p in seen]

    def score(self, prompt: Prompt, response_text: str) -> Score:
        parsed = extract_integer(response_text)
        correct = parsed is not None and parsed.lstrip("+") == prompt.answer
        return Score(reward=1.0 if correct else 0.0, correct=correct, parsed=parsed)

    loss_mask = staticmethod(full_loss_mask)
    reward_range = (0.0, 1.0)
    verifiable = True
