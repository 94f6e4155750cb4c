"""In-process rollout source: the learner's own engine generates when the learner asks for data.

Learner and rollout take turns (the foundation loop): the learner's wait for data is the rollout
time. Implements the `RolloutSource` seam (learning/source.py) as `echo2.control.remote.RemoteRollout`
does, so the learner loop does not know which one it drives. Knows nothing of training.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from echo2.config import RolloutConfig
from echo2.data.buffer import ReplayBuffer
from echo2.data.tasks.base import Task
from echo2.records import Snapshot, Trajectory
from echo2.rollout.collect import collect, rollout_seed
from echo2.rollout.engine import Engine


class LocalRollout:
    def __init__(
        self, *, engine: Engine, task: Task, buffer: ReplayBuffer, config: RolloutConfig, seed: int
    ) -> None:
        self.engine, self.task, self.buffer, self.config, self.seed = engine, task, buffer, config, seed
        self.next_prompt = 0

    def next_groups(self, num_groups: int):
        start_time = time.perf_counter()
        tokens = 0
        while self.buffer.num_ready_groups() < num_groups:
            start = self.next_prompt
            prompts = [self.task.train_prompt(i) for i in range(start, start + self.config.prompts_per_step)]
            self.next_prompt = start + self.config.prompts_per_step
            torch.manual_seed(rollout_seed(self.seed, start))
            groups = collect(self.engine, self.task, prompts, n=self.config.group_size)
            self.buffer.add(r for g in groups for r in g)
            tokens += sum(len(r.response_ids) for g in groups for r in g)
        elapsed = time.perf_counter() - start_time
        groups, staleness = self.buffer.take(num_groups)
        return (
            groups,
            staleness,
            {
                "time/learner_wait": elapsed,
                "throughput/rollout_tokens_per_s": tokens / max(elapsed, 1e-9),
            },
        )

    def start(self, snapshot: Snapshot) -> None:
        self.engine.install(snapshot)

    def advance(self, version: int) -> None:
        self.buffer.set_learner_version(version)

    def publish(self, snapshot: Snapshot) -> None:
        self.engine.install(snapshot)

    def record_train_time(self, seconds: float) -> None:
        pass  # learner and rollout take turns: there is no idle time to set it against

    def timings(self) -> dict[str, Any]:
        return {}

    def flag(self, records: list[Trajectory], reason: str) -> list[str]:
        return []  # the learner's own engine made them: there is no worker to strike

    def state_dict(self) -> dict[str, Any]:
        return {"next_prompt": self.next_prompt, "buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_prompt = state["next_prompt"]
        self.buffer.load_state_dict(state["buffer"])

    def close(self) -> None:
        pass
