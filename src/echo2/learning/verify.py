"""What the learner verifies itself before a worker's record moves its weights.

Workers are untrusted: the coordinator's door (wire/validate.py) refuses what is malformed, and
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
  finite is not applied. With a `SamplingCheck` (rollout.sampling = "gumbel"), a record any of
  whose sampled tokens (an episode's: its loss-mask tokens) is not the arg-max of the keyed Gumbel scores (rollout/sampling.py) within
  `sampling.TOLERANCE`, or whose keys are missing or repeated, is left out and reported too.

Knows tasks, tokenizers and tensors; no network, no coordinator state (it returns problems and
lists; the caller counts them and strikes the workers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from echo2.data.tasks.base import Prompt, Task
from echo2.records import Trajectory
from echo2.rollout import sampling
from echo2.rollout.engine import encode_prompt
from echo2.wire.validate import Problem, printable

REWARD_TOLERANCE = 1e-6
"""Relative difference between a record's reward and the re-scored one that still agrees."""
PROMPTS_CACHED = 4096
"""Leased prompts whose token ids are kept (each is tokenized once, not once per record)."""


class TaskReferee:
    """Implements `wire.validate.Referee` with the task and the learner's tokenizer."""

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
STRIKE_FACTOR = 2.0
"""`SamplingCheck.strike_margin` by default: twice the tolerance (1.0 in bf16). The 1,000 honest
bf16 poker episodes' worst margin was 0.97 (docs/benchmarks.md); that figure was known when this
factor was chosen, so those episodes do not test it."""

TOKEN_LOGRATIO = 4.0
"""Bound on any one loss token's |learner log-prob - behaviour log-prob| for a fresh record (a
record s versions stale gets (1 + s) times it). Honest engines disagree with the fp32 learner by at
most 0.29 (HF in bf16, 1,374 tokens of SmolLM2-135M: `cd bench && python token_tolerance.py`) and
0.38 (vLLM in bf16, docs/benchmarks.md) per token; 4 nats (a probability off by 55x) is over ten
times that, and refuses one token forged 20 nats off however the record's other tokens compensate
in the mean."""


@dataclass(slots=True, kw_only=True)
class SamplingCheck:
    """Verifiable sampling at the learner: were a record's tokens the arg-max of its keyed noise?

    A record's seed is the one the coordinator attached when it accepted it (`sampling.SEED_KEY`,
    from the lease); its record key is its group id and its index in the group
    (`sampling.SAMPLE_KEY`), which must be an int in [0, group_size) and unique in its group, so a
    worker gets exactly group_size noise draws per leased prompt. An environment episode
    (`episodes`: several generate calls per record, env tokens between them) is checked on its
    loss-mask tokens only, each at its position in the whole response (rollout/episodes.py keys the
    replies so); its env tokens are the replay's to check (rollout/replay.py)."""

    temperature: float
    top_p: float
    group_size: int
    max_new_tokens: int
    eos_id: int | None
    episodes: bool = False
    """Records are environment episodes: only loss-mask (sampled) tokens are checked, and each
    reply (a run of them) must end as a generate call ends one."""
    tolerance: float = sampling.TOLERANCE
    strike_margin: float | None = None
    """A record whose worst margin is over `tolerance` but at most this is *doubtful*: left out of
    the step, no strike (honest bf16 engines reach such margins now and then: 4 of 1,000 poker
    episodes, docs/benchmarks.md). Over it, or with bad keys, the record is refused with a strike.
    None: `STRIKE_FACTOR` times the tolerance."""
    refused: list[Trajectory] = field(default_factory=list)
    """Records left out of the step with a strike: not sampled with their noise (a margin over
    `strike_margin`), or their keys are bad."""
    doubtful: list[Trajectory] = field(default_factory=list)
    """Records left out of the step without a strike: a margin in (tolerance, strike_margin]."""
    tokens: int = 0
    """Tokens checked."""
    margin_max: float = 0.0
    """The largest finite margin (arg-max score - the sampled token's score) seen."""

    def bad_keys(self, groups: list[list[Trajectory]]) -> set[str]:
        """Record ids whose seed or sample index is missing, out of range or repeated in the group,
        or whose response does not end as the engines end one (at its first EOS, or else at
        max_new_tokens): a response cut short, or continued after EOS, was chosen."""
        bad: set[str] = set()
        for group in groups:
            seen: dict[int, int] = {}
            for r in group:
                seed, j = r.metadata.get(sampling.SEED_KEY), r.metadata.get(sampling.SAMPLE_KEY)
                replies = _replies(r) if self.episodes else [r.response_ids]
                ends = bool(replies) and all(self._ends(resp) for resp in replies)
                if not ends or not _int_in(seed, 0, 2**63) or not _int_in(j, 0, self.group_size):
                    bad.add(r.record_id)
                else:
                    seen[j] = seen.get(j, 0) + 1
            bad.update(r.record_id for r in group if seen.get(r.metadata.get(sampling.SAMPLE_KEY), 0) > 1)
        return bad

    def _ends(self, resp: tuple[int, ...]) -> bool:
        """Does `resp` end as a generate call ends one: at its only EOS, or at max_new_tokens?"""
        if self.eos_id is not None and self.eos_id in resp[:-1]:
            return False
        return len(resp) == self.max_new_tokens or (self.eos_id is not None and resp[-1:] == (self.eos_id,))

    @property
    def strike_at(self) -> float:
        """The margin over which a record is refused with a strike."""
        return max(
            self.tolerance,
            self.strike_margin if self.strike_margin is not None else STRIKE_FACTOR * self.tolerance,
        )

    def unsampled(
        self, logits: torch.Tensor, targets: torch.Tensor, records: list[Trajectory], bad_keys: set[str]
    ) -> torch.Tensor:
        """Rows [B] of `records` (right-aligned responses, as `to_tensors` lays them out) whose
        tokens `targets` [B, K] were not sampled from `logits` [B, K, V] with their noise, or whose
        keys are in `bad_keys`: the rows `verdicts` refuses or finds doubtful."""
        refused, doubtful = self.verdicts(logits, targets, records, bad_keys)
        return refused | doubtful

    def verdicts(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        records: list[Trajectory],
        bad_keys: set[str],
        *,
        stale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(refused, doubtful) rows [B] of `records`: refused, a margin over `strike_at` or keys in
        `bad_keys`; doubtful, a worst margin in (tolerance, strike_at]. Both are left out of a step.

        `stale` [B] bool: rows sampled by an older version than the one whose `logits` these are.
        Their margins measure the policy's drift as well as the noise, so a stale row over the
        tolerance is doubtful whatever its margin, never a strike (at S = 3 and lr 1e-5, 4-15 of 32
        honest records a step went over; bench/headline.py's docstring). Checking them against their
        own version's snapshot would keep both the strike and the records; not done."""
        num_pos = targets.shape[1]
        bad = torch.tensor([r.record_id in bad_keys for r in records])
        starts = torch.tensor([num_pos - len(r.response_ids) for r in records])
        mask = torch.arange(num_pos)[None, :] >= starts[:, None]
        if self.episodes:  # the sampled tokens only: env tokens were never drawn from the noise
            for i, r in enumerate(records):
                mask[i, num_pos - len(r.loss_mask) :] &= torch.tensor(r.loss_mask) != 0
        mask &= ~bad[:, None]
        verdict = sampling.check(
            logits.detach(),
            targets,
            mask,
            starts=starts,
            seed=[
                int(r.metadata[sampling.SEED_KEY]) if not b else 0
                for r, b in zip(records, bad.tolist(), strict=True)
            ],
            records=torch.tensor(
                [
                    sampling.record_key(r.group_id, int(r.metadata[sampling.SAMPLE_KEY])) if not b else 0
                    for r, b in zip(records, bad.tolist(), strict=True)
                ]
            ),
            temperature=self.temperature,
            top_p=self.top_p,
            tolerance=self.tolerance,
        )
        checked = verdict.margins[mask.to(verdict.margins.device)]
        finite = checked[torch.isfinite(checked)]
        self.tokens += checked.numel()
        self.margin_max = max(self.margin_max, float(finite.max()) if finite.numel() else 0.0)
        worst = (
            verdict.margins.amax(dim=1).cpu() if num_pos else torch.zeros(len(records), dtype=torch.float64)
        )
        over = worst > self.strike_at
        refused = bad | (over if stale is None else over & ~stale.cpu())
        return refused, ~verdict.ok.cpu() & ~refused


def sampling_check(
    rollout, *, is_env: bool, eos_id: int | None, snapshot_dtype: str = "bf16"
) -> SamplingCheck | None:
    """The learner's check of `rollout.sampling = "gumbel"` (a `RolloutConfig`), or None: sampled
    otherwise. `is_env`: the records are episodes (several generate calls each). `snapshot_dtype`
    (learner.dtype, resolved) sets the tolerance when rollout.sampling_tolerance is unset."""
    if rollout.sampling != "gumbel":
        return None
    return SamplingCheck(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        group_size=rollout.group_size,
        max_new_tokens=rollout.max_new_tokens,
        eos_id=eos_id,
        episodes=is_env,
        tolerance=rollout.sampling_tolerance or sampling.default_tolerance(snapshot_dtype),
        strike_margin=rollout.sampling_strike_margin,
    )


def _replies(record: Trajectory) -> list[tuple[int, ...]]:
    """The runs of loss-mask tokens of an episode record: its replies, one per generate call."""
    runs, start = [], None
    for k, m in enumerate((*record.loss_mask, 0)):
        if m and start is None:
            start = k
        elif not m and start is not None:
            runs.append(record.response_ids[start:k])
            start = None
    return runs


def _int_in(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


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
    sampling: SamplingCheck | None = None
    """Verifiable sampling (rollout.sampling = "gumbel" with workers); None: not checked."""
    refused: list[Trajectory] = field(default_factory=list)
    """Records left out of the step: their log-probs disagree with the learner's."""
    skipped: bool = False
    """The step was not applied (loss or gradient not finite)."""

    def scales(self, records: list[Trajectory], newest: int) -> torch.Tensor:
        """Per-record factor [B] of the bounds: 1 + the record's staleness. A record's version is
        never older than the one its lease was issued for (coordinator/leases.py), so a worker cannot
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
