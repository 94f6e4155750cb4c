"""A toy task for end-to-end tests, plugged in through `task.type = "custom"`.

Reward = share of the response's characters that are lowercase vowels. A random tiny model emits
random sub-words, so rewards vary inside each group, GRPO has signal, and a few steps with a large
learning rate visibly raise the reward.
"""

from __future__ import annotations

from echo2.data.tasks.base import Prompt, Score, full_loss_mask, stable_id


class Vowels:
    def __init__(self, *, seed: int, letters: str = "aeiou") -> None:
        self.seed = seed
        self.letters = set(letters)

    def _prompt(self, split: str, i: int) -> Prompt:
        return Prompt(
            group_id=stable_id("even", split, i),
            messages=({"role": "user", "content": f"Say something #{i}"},),
            answer="",
        )

    def train_prompt(self, index: int) -> Prompt:
        return self._prompt(f"train{self.seed}", index)

    def eval_prompts(self, count: int) -> list[Prompt]:
        return [self._prompt("eval", i) for i in range(count)]

    def score(self, prompt: Prompt, response_text: str) -> Score:
        share = sum(c in self.letters for c in response_text) / max(1, len(response_text))
        return Score(reward=share, correct=share > 0.5, parsed=None)

    loss_mask = staticmethod(full_loss_mask)
    reward_range = (0.0, 1.0)
