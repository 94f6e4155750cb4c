"""What the learner verifies itself before a worker's record moves its weights.

Workers are untrusted: the coordinator's door (control/validate.py) refuses what is malformed, and
this module checks what only the learner's side can.

- `TaskReferee` (run by the coordinator state at ingestion, in the learner's process): a record's
  prompt ids must be the tokens of the prompt leased for its group, its loss mask the task's, and
  its reward (and `correct` flag) what the task's own reward function gives the decoded response.
  A task that cannot be re-scored (a judge model, a game against a live opponent) declares
  `verifiable = False`; its prompts and masks are still checked. An environment task's episode is
  replayed against the env (rollout/replay.py): env tokens, masks, return and outcome.
- `StepCheck` (run inside `train_step`): a record whose behaviour log-probs disagree with the
  learner's own recomputation, beyond what its staleness explains, in the mean over its tokens or
  in any one token, is left out of the step and reported; a step whose loss or gradient is not
  finite is not applied.

Knows tasks, tokenizers and tensors; no network, no coordinator state (it returns problems and
lists; the caller counts them and strikes the workers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from echo2.control.validate import Problem, printable
from echo2.data.tasks.base import Prompt, Task
from echo2.records import Trajectory
from echo2.rollout.engine import encode_prompt

REWARD_TOLERANCE = 1e-6
"""Relative difference between a record's reward and the re-scored one that still agrees."""
PROMPTS_CACHED = 4096
"""Leased prompts whose token ids are kept (each is tokenized once, not once per record)."""


class TaskReferee:
    """Implements `control.validate.Referee` with the task and the learner's tokenizer."""

    def __init__(self, task: Task, tokenizer, *, max_new_tokens: int | None = None) -> None:
        """`max_new_tokens`: an episode's per-reply limit (`rollout.max_new_tokens`; rollout/replay.py)."""
        self.task = task
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.verifiable = bool(getattr(task, "verifiable", True))
        self._prompt = lru_cache(maxsize=PROMPTS_CACHED)(self._encode)

    def _encode(self, index: int) -> tuple[Prompt, tuple[int, ...]]:
        prompt = self.task.train_prompt(index)
        return prompt, tuple(encode_prompt(self.tokenizer, prompt))

    def check(self, record: Trajectory, index: int) -> Problem | None:
        where = f"record {printable(record.record_id, 64)}"
        prompt, ids = self._prompt(index)
        if record.prompt_ids != ids:
            return Problem(
                reason="wrong_prompt", detail=f"{where}: prompt ids are not those of the leased prompt"
            )
        if getattr(self.task, "is_env", False):  # an episode: replayed against the env
            from echo2.rollout.replay import replay_problem

            found = replay_problem(
                self.task, prompt, record, self.tokenizer, max_new_tokens=self.max_new_tokens
            )
            return Problem(reason=found[0], detail=f"{where}: {found[1]}") if found else None
        if tuple(record.loss_mask) != tuple(self.task.loss_mask(record.response_ids)):
            return Problem(reason="bad_mask", detail=f"{where}: loss mask is not the task's")
        if not self.verifiable:
            return None
        score = self.task.score(prompt, self.tokenizer.decode(record.response_ids, skip_special_tokens=True))
        if not math.isclose(score.reward, record.reward, rel_tol=REWARD_TOLERANCE, abs_tol=REWARD_TOLERANCE):
            return Problem(
                reason="reward_mismatch",
                detail=f"{where}: reward {record.reward:g}, the task gives {score.reward:g}",
            )
        claimed = record.metadata.get("correct")
        if claimed is not None and claimed != score.correct:
            return Problem(
                reason="reward_mismatch",
                detail=f"{where}: correct={claimed!r}, the task says {score.correct}",
            )
        return None


# ---------------------------------------------------------------------------- inside the step
TOKEN_LOGRATIO = 4.0
"""Bound on any one loss token's |learner log-prob - behaviour log-prob| for a fresh record (a
record s versions stale gets (1 + s) times it). Honest engines disagree with the fp32 learner by at
most 0.29 (HF in bf16, 1,374 tokens of SmolLM2-135M: `cd bench && python token_tolerance.py`) and
0.38 (vLLM in bf16, docs/benchmarks.md) per token; 4 nats (a probability off by 55x) is over ten
times that, and refuses one token forged 20 nats off however the record's other tokens compensate
in the mean."""


@dataclass(slots=True, kw_only=True)
class StepCheck:
    """What `train_step` verifies, and what it refused."""

    max_logratio: float | None
    """Bound on |mean over a record's loss tokens of (learner log-prob - behaviour log-prob)| for a
    fresh record; a record s versions stale gets (1 + s) times it. None: no check."""
    max_token_logratio: float = TOKEN_LOGRATIO
    """Bound on each loss token's |learner log-prob - behaviour log-prob|, scaled as the mean's."""
    learner_version: int | None = None
    """The version the step trains from (None: the newest record's version + `staleness`, the
    loosest admissible, as ranks > 0 under torchrun see it)."""
    staleness: int = 0
    refused: list[Trajectory] = field(default_factory=list)
    """Records left out of the step: their log-probs disagree with the learner's."""
    skipped: bool = False
    """The step was not applied (loss or gradient not finite)."""

    def scales(self, records: list[Trajectory], newest: int) -> torch.Tensor:
        """Per-record factor [B] of the bounds: 1 + the record's staleness. A record's version is
        never older than the one its lease was issued for (control/leases.py), so a worker cannot
        widen its bounds by claiming an older one."""
        version = self.learner_version if self.learner_version is not None else newest + self.staleness
        return torch.tensor([1.0 + max(0, version - r.version) for r in records])

    def bounds(self, records: list[Trajectory], newest: int) -> torch.Tensor:
        """Per-record bound [B] on the mean log-ratio."""
        assert self.max_logratio is not None
        return self.max_logratio * self.scales(records, newest)

    def outliers(
        self,
        logp: torch.Tensor,
        behaviour: torch.Tensor,
        mask: torch.Tensor,
        records: list[Trajectory],
        newest: int,
    ) -> torch.Tensor:
        """Rows [B] of `records` whose mean or any one token's log-ratio is out of bounds."""
        assert self.max_logratio is not None
        scales = self.scales(records, newest)
        return logratio_outliers(
            logp, behaviour, mask, self.max_logratio * scales, token_bounds=self.max_token_logratio * scales
        )


def logratio_outliers(
    logp: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    bounds: torch.Tensor,
    *,
    token_bounds: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows [B] whose |mean over loss tokens of (logp - behaviour)| exceeds their bound, or one of
    whose loss tokens' |logp - behaviour| exceeds its token bound, or whose log-ratio is not finite.
    logp, behaviour, mask: [B, K]; bounds, token_bounds: [B]."""
    with torch.no_grad():
        n = mask.sum(dim=1).clamp(min=1)
        diff = ((logp.detach().float() - behaviour.float()) * mask).nan_to_num(nan=math.inf)
        mean = diff.sum(dim=1) / n
        bad = ~(mean.abs() <= bounds.to(mean.device))
        if token_bounds is not None:
            worst = diff.abs().amax(dim=1) if diff.numel() else torch.zeros_like(mean)
            bad |= ~(worst <= token_bounds.to(mean.device))
        return bad


def finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)
