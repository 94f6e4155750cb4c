"""One GRPO optimizer step over whole groups of trajectories.

Owns micro-batching by token budget, the forward pass (logits only for response positions), the
backward pass, gradient clipping and the AdamW step. Knows nothing of where the records came from.
With a `StepCheck` (learning/verify.py) it leaves out records whose behaviour log-probs disagree
with its own, and never applies a step whose loss or gradient is not finite.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import torch

from echo2.config import LearnerConfig
from echo2.data.tasks.base import TrainBatch, to_tensors
from echo2.learning import distributed
from echo2.learning.corrections import ratio_diagnostics
from echo2.learning.device import on_device, precision, resolved_learner
from echo2.learning.grpo import batch_advantages, group_advantages, grpo_loss
from echo2.learning.verify import StepCheck, finite
from echo2.models import token_logprobs
from echo2.records import Trajectory

logger = logging.getLogger(__name__)


def micro_batches(records: list[Trajectory], budget: int) -> Iterator[list[int]]:
    """Row indices in order, packed so rows x longest row (padded tokens) stays within budget."""
    batch: list[int] = []
    longest = 0
    for i, rec in enumerate(records):
        length = len(rec.prompt_ids) + len(rec.response_ids)
        if batch and (len(batch) + 1) * max(longest, length) > budget:
            yield batch
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, length)
    if batch:
        yield batch


def response_logits(model, batch: TrainBatch) -> torch.Tensor:
    """The logits [B, K, V] that predict the response tokens; the lm head runs only on the last
    K + 1 positions."""
    k = batch.targets.shape[1]
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=k + 1,
        use_cache=False,
    )
    return out.logits[:, :-1]


def response_logprobs(model, batch: TrainBatch, *, temperature: float) -> torch.Tensor:
    """log pi(response tokens) [B, K]."""
    return token_logprobs(response_logits(model, batch), batch.targets, temperature=temperature)


def train_step(
    model,
    optimizer: torch.optim.Optimizer,
    groups: list[list[Trajectory]],
    config: LearnerConfig,
    *,
    pad_id: int,
    temperature: float,
    ref_model=None,
    staleness: list[int] | None = None,
    check: StepCheck | None = None,
    grouping: str = "state",
) -> dict[str, float]:
    """One optimizer update on `groups`. `staleness` (per record, in order: the learner's version
    less the record's) splits the `offpolicy/*` ratio diagnostics by staleness, and a record of
    staleness 0 is trained on the learner's own log-probs (a worker's are only checked:
    `grpo_loss`'s `fresh`); None: unknown, every record trained on its reported log-probs (under
    `learner.ratio_cap`), diagnostics as staleness 0. `grouping`: the task's
    (`task.grouping`, paper F.5.2), "batch" normalises advantages over the whole step; it comes from
    the learner's config, never from a record's metadata, which a worker writes.

    Proximal log-probs (correction "decoupled") cost no extra forward pass: the step takes exactly
    one optimizer update, so the learner's weights at the start of the step are those of this
    forward pass and log pi_prox is its detached log pi_theta.
    """
    config = resolved_learner(config)  # a config built in code may still say "auto"/None
    rewards = torch.tensor([[r.reward for r in g] for g in groups])
    normalise = batch_advantages if grouping == "batch" else group_advantages
    advantages = normalise(rewards, scale_by_std=config.scale_adv_by_std, eps=config.adv_eps)
    records = [r for g in groups for r in g]
    adv_flat = advantages.flatten().tolist()
    num_tokens = max(1, sum(sum(r.loss_mask) for r in records))
    newest = max(r.version for r in records)

    model.train()
    optimizer.zero_grad(set_to_none=True)
    totals = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "ratio_mean": 0.0}
    record_staleness = staleness or [0] * len(records)
    bad_keys = check.sampling.bad_keys(groups) if check is not None and check.sampling is not None else set()
    token_log_ratio, token_corrected, token_staleness = [], [], []
    for rows, live in distributed.share(micro_batches(records, config.micro_batch_tokens), records):
        batch = to_tensors([records[i] for i in rows], pad_id=pad_id, advantages=[adv_flat[i] for i in rows])
        batch = on_device(batch, model)
        if batch.num_loss_tokens == 0:
            continue
        with precision(model, config):
            logits = response_logits(model, batch)
            logp = token_logprobs(logits, batch.targets, temperature=temperature)
            if check is not None:
                stale = torch.tensor([record_staleness[i] > 0 for i in rows])
                batch = _leave_out(
                    batch, logits, logp, [records[i] for i in rows], check, newest, bad_keys, stale
                )
            del logits
            ref_logp = None
            if ref_model is not None:
                with torch.no_grad():
                    ref_logp = response_logprobs(ref_model, batch, temperature=temperature)
        loss, stats = grpo_loss(
            logp,
            batch.behaviour_logprobs,
            batch.advantages,
            batch.loss_mask,
            eps_low=config.clip_eps_low,
            eps_high=config.clip_eps_high,
            num_tokens=num_tokens,
            ref_logp=ref_logp,
            beta=config.kl_beta,
            correction=config.correction,
            dual_clip_delta=config.dual_clip_delta,
            is_cap=config.is_cap,
            ratio_cap=config.ratio_cap,
            fresh=None if staleness is None else torch.tensor([staleness[i] == 0 for i in rows]),
        )
        (loss if live else loss * 0).backward()  # a dead micro-batch only keeps ranks in step
        if not live:
            continue
        share = batch.num_loss_tokens / num_tokens  # loss/kl are already step-normalised sums
        totals["loss"] += stats.loss
        totals["pg_loss"] += stats.pg_loss
        totals["kl"] += stats.kl
        totals["clip_fraction"] += stats.clip_fraction * share
        totals["ratio_mean"] += stats.ratio_mean * share
        token_log_ratio.append(stats.token_log_ratio.cpu())
        token_corrected.append(stats.token_corrected.cpu())
        row_staleness = torch.tensor([record_staleness[i] for i in rows]).unsqueeze(1)
        token_staleness.append(row_staleness.expand_as(batch.loss_mask)[batch.loss_mask.cpu() > 0])
    totals = distributed.sum_stats(totals)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    applied = finite(totals["loss"], distributed.scalar(grad_norm))
    if applied:
        optimizer.step()
    else:  # a NaN or inf would reach every weight and every worker: drop the step whole
        optimizer.zero_grad(set_to_none=True)
        if check is not None:
            check.skipped = True
        logger.warning(
            "step skipped: loss %s, gradient norm %s", totals["loss"], distributed.scalar(grad_norm)
        )
    diagnostics = {}
    if token_log_ratio:  # this rank's tokens (under torchrun: rank 0's share of the step)
        diagnostics = ratio_diagnostics(
            torch.cat(token_log_ratio),
            torch.cat(token_corrected),
            torch.cat(token_staleness),
            max_staleness=max(record_staleness),
        )
    return {
        **{f"train/{k}": v for k, v in totals.items()},
        **diagnostics,
        "train/grad_norm": distributed.scalar(grad_norm),
        "train/tokens": float(sum(len(r.prompt_ids) + len(r.response_ids) for r in records)),
        "train/loss_tokens": float(num_tokens),
        "train/adv_abs_mean": float(advantages.abs().mean()),
        "train/skipped_step": 0.0 if applied else 1.0,
        "train/refused_records": float(len(check.refused)) if check is not None else 0.0,
        **_sampling_stats(check),
    }


def _leave_out(
    batch,
    logits: torch.Tensor,
    logp: torch.Tensor,
    rows: list[Trajectory],
    check: StepCheck,
    newest: int,
    bad_keys,
    stale: torch.Tensor,
):
    """`batch` without the rows whose log-probs disagree with `logp`, or (with `check.sampling`)
    whose tokens were not sampled with their noise from `logits`: their mask is zeroed and their
    behaviour log-probs replaced by the learner's (a ratio of 1), so not even an overflowing ratio
    multiplied by zero reaches the loss. A row is reported once, under the log-prob reason first."""
    bad = torch.zeros(len(rows), dtype=torch.bool, device=logp.device)
    if check.max_logratio is not None:
        bad = check.outliers(logp, batch.behaviour_logprobs, batch.loss_mask, rows, newest)
        check.refused.extend(r for r, b in zip(rows, bad.tolist(), strict=True) if b)
    if check.sampling is not None:
        refused, doubtful = check.sampling.verdicts(logits, batch.targets, rows, bad_keys, stale=stale)
        refused, doubtful = refused.to(bad.device) & ~bad, doubtful.to(bad.device) & ~bad
        check.sampling.refused.extend(r for r, b in zip(rows, refused.tolist(), strict=True) if b)
        check.sampling.doubtful.extend(r for r, b in zip(rows, doubtful.tolist(), strict=True) if b)
        bad = bad | refused | doubtful
    if not bool(bad.any()):
        return batch
    keep = (~bad).to(batch.loss_mask.dtype).unsqueeze(1)
    own = logp.detach().to(batch.behaviour_logprobs.dtype)
    return dataclasses.replace(
        batch,
        loss_mask=batch.loss_mask * keep,
        behaviour_logprobs=torch.where(bad.unsqueeze(1), own, batch.behaviour_logprobs),
    )


def _sampling_stats(check: StepCheck | None) -> dict[str, float]:
    if check is None or check.sampling is None:
        return {}
    return {
        "train/unsampled_records": float(len(check.sampling.refused)),
        "train/doubtful_records": float(len(check.sampling.doubtful)),
        "train/sampling_margin_max": check.sampling.margin_max,
    }


def make_optimizer(model, config: LearnerConfig) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]  # only the adapter under LoRA
    return torch.optim.AdamW(trainable, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
