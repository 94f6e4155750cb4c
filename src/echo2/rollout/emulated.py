"""EMULATION: an engine that produces responses at a configured rate without running a model.

For capacity experiments only (`echo2 worker --emulate RATE`): it lets the scheduler and the overlap
rule be exercised at controlled throughputs on a small machine. Each call sleeps so that it yields
`rate` trajectories per second, and returns short random responses (random digits, so an arithmetic
reward is occasionally 1) with the uniform log-prob of their tokens. It is never a training engine:
the records it makes are real records of a fake policy.
"""

from __future__ import annotations

import math
import random
import time

from echo2.data.tasks.base import Prompt
from echo2.records import Snapshot
from echo2.rollout.engine import Sample, encode_prompt


class EmulatedEngine:
    def __init__(
        self, tokenizer, *, rate: float, response_tokens: int = 4, seed: int = 0, sleep=time.sleep
    ) -> None:
        assert rate > 0
        self.tokenizer = tokenizer
        self.rate = rate
        self.version = -1
        self.rng = random.Random(seed)
        self.sleep = sleep
        self.digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
        self.response_tokens = response_tokens
        self.logprob = -math.log(len(tokenizer))

    def install(self, snapshot: Snapshot) -> None:
        self.version = snapshot.version  # weights are not used: this engine emulates throughput only

    def generate(
        self, prompts: list[Prompt], *, n: int, greedy: bool = False, keys=None
    ) -> list[list[Sample]]:
        """`keys` (a lease's sampling keys under rollout.sampling = "gumbel") are ignored: no model,
        no noise; a run of emulated workers sets scheduler.emulate, which skips the learner's checks."""
        started = time.monotonic()
        out = []
        for prompt in prompts:
            ids = tuple(encode_prompt(self.tokenizer, prompt))
            group = []
            for _ in range(n):
                resp = tuple(self.rng.choice(self.digits) for _ in range(self.response_tokens))
                group.append(
                    Sample(
                        prompt_ids=ids,
                        response_ids=resp,
                        logprobs=(self.logprob,) * len(resp),
                        text=self.tokenizer.decode(resp),
                    )
                )
            out.append(group)
        remaining = len(prompts) * n / self.rate - (time.monotonic() - started)
        if remaining > 0:
            self.sleep(remaining)
        return out
