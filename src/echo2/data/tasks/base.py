"""The task adapter seam: prompts in, rewards out, records to training tensors.

A task owns what a problem looks like, how a response is scored and which response tokens carry
loss. It knows nothing of models, engines, buffers or the network: the rollout plane calls
`score` on the worker, the learner calls `to_tensors`. A task of your own needs no change to
echo2 (`task.type = "custom"`, docs/tasks.md); a built-in one is a module in data/tasks/, a
`*TaskConfig` section in config/schema.py and a branch of `make_task`. The learner and the rollout code
do not change.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from echo2.records import Trajectory


@dataclass(frozen=True, slots=True, kw_only=True)
class Prompt:
    group_id: str
    """Stable id of this problem (same for every sample of it)."""
    messages: tuple[dict[str, str], ...]
    """Chat messages; the engine renders them with the tokenizer's chat template."""
    answer: str
    """Reference answer the reward is checked against."""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Score:
    reward: float
    correct: bool
    parsed: str | None
    """What was read from the response as its answer (None if nothing could be)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainBatch:
    """Left-padded tensors for one micro-batch: B rows, T = longest prompt + response, K = longest
    response. Left padding puts every response at the end, so the learner computes logits only for
    the last K + 1 positions."""

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    position_ids: torch.Tensor  # [B, T] long, counted from each row's first real token
    targets: torch.Tensor  # [B, K] long: the last K tokens of each row
    loss_mask: torch.Tensor  # [B, K] float: 1 where the target is a loss-carrying response token
    behaviour_logprobs: torch.Tensor  # [B, K] float, aligned with targets
    advantages: torch.Tensor  # [B] float

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


class Task(Protocol):
    """Implemented by every task adapter (`ArithmeticTask`, `MathTask`, ...)."""

    def train_prompt(self, index: int) -> Prompt:
        """The index-th training problem; deterministic, so a resumed run continues the sequence."""
        ...

    def eval_prompts(self, count: int) -> list[Prompt]:
        """Held-out problems, disjoint from training ones."""
        ...

    def score(self, prompt: Prompt, response_text: str) -> Score:
        """Reward of one response; runs on the rollout side."""
        ...

    def loss_mask(self, response_ids: tuple[int, ...]) -> tuple[int, ...]:
        """Which response tokens carry loss."""
        ...

    reward_range: tuple[float, float]
    """(low, high): every reward `score` can give. The coordinator refuses records outside it.
    Optional: a task without it gets wire/validate.py's DEFAULT_REWARD_RANGE."""
    verifiable: bool
    """Whether `score` is a deterministic function of prompt and response text, so the learner
    re-scores each record and refuses those whose reward disagrees. Optional (default True); a
    task scored by a judge model or a live opponent sets it False."""


def stable_id(*parts: object) -> str:
    return hashlib.sha1("/".join(map(str, parts)).encode()).hexdigest()[:16]


def full_loss_mask(response_ids: tuple[int, ...]) -> tuple[int, ...]:
    return (1,) * len(response_ids)


def to_tensors(records: list[Trajectory], *, pad_id: int, advantages: list[float]) -> TrainBatch:
    """Left-pad prompt+response rows; response tokens (and their masks) end every row."""
    seqs = [r.prompt_ids + r.response_ids for r in records]
    width = max(len(s) for s in seqs)
    k = max(len(r.response_ids) for r in records)
    rows = len(records)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    loss_mask = torch.zeros((rows, k))
    old_lp = torch.zeros((rows, k))
    for i, (rec, seq) in enumerate(zip(records, seqs, strict=True)):
        input_ids[i, width - len(seq) :] = torch.tensor(seq)
        attention[i, width - len(seq) :] = 1
        n = len(rec.response_ids)
        loss_mask[i, k - n :] = torch.tensor(rec.loss_mask, dtype=torch.float)
        old_lp[i, k - n :] = torch.tensor(rec.behaviour_logprobs)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
        targets=input_ids[:, width - k :],
        loss_mask=loss_mask,
        behaviour_logprobs=old_lp,
        advantages=torch.tensor(advantages, dtype=torch.float),
    )
