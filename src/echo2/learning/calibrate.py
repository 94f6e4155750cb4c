"""T_train before the first step: time one learner step on a synthetic batch of the run's shape.

The scheduler sizes the pool from T_train (planning/capacity.py), but the first real step needs
rollouts, and rollouts need workers the scheduler has not activated yet. So, unless
`scheduler.t_train` is configured, the learner times one calibration step before serving: the
forward and backward pass of a GRPO step on `prompts_per_step` x `group_size` random records of
the longest allowed response (a prompt of `CALIBRATION_PROMPT_TOKENS` tokens), through the very
`train_step` the loop runs, with an optimizer that updates nothing; the gradients are cleared
after. Responses of the full `max_new_tokens` make it an upper estimate of T_train (a lower
throughput target); measured steps replace it as soon as there are any.
"""

from __future__ import annotations

import random
import time

import torch

from echo2.config import Config
from echo2.learning.step import train_step
from echo2.records import Trajectory

CALIBRATION_PROMPT_TOKENS = 64


class _NoUpdate:
    """An optimizer that changes nothing (the calibration step must leave the weights as they are)."""

    def __init__(self, model) -> None:
        self.model = model

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        pass


def synthetic_groups(config: Config, vocab_size: int, seed: int = 0) -> list[list[Trajectory]]:
    """`prompts_per_step` groups of `group_size` random records of the run's largest shape."""
    rng = random.Random(seed)
    rcfg = config.rollout
    prompt_len = min(CALIBRATION_PROMPT_TOKENS, rcfg.max_prompt_tokens)
    groups = []
    for g in range(rcfg.prompts_per_step):
        prompt = tuple(rng.randrange(vocab_size) for _ in range(prompt_len))
        group = []
        for _ in range(rcfg.group_size):
            response = tuple(rng.randrange(vocab_size) for _ in range(rcfg.max_new_tokens))
            n = len(response)
            group.append(
                Trajectory(
                    group_id=f"calibration-{g}",
                    prompt_ids=prompt,
                    response_ids=response,
                    behaviour_logprobs=(-1.0,) * n,
                    loss_mask=(1,) * n,
                    reward=float(rng.random() < 0.5),
                    version=0,
                )
            )
        groups.append(group)
    return groups


def time_train_step(model, config: Config, *, vocab_size: int, pad_id: int) -> float:
    """Seconds of one learner step of the run's shape; the model's weights are left unchanged."""
    groups = synthetic_groups(config, vocab_size, seed=config.run.seed)
    noop = _NoUpdate(model)
    start = time.perf_counter()
    train_step(model, noop, groups, config.learner, pad_id=pad_id, temperature=config.rollout.temperature)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    noop.zero_grad()
    return seconds
