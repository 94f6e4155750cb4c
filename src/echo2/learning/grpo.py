"""GRPO math: group-normalised advantages and the clipped token-level policy loss. Pure tensors.

Shapes: G groups of n samples; B rows in a micro-batch; K response positions; V vocabulary.
Nothing here knows models, tasks or I/O, so the tests check it against hand-computed numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from echo2.learning.corrections import LOG_RATIO_CLAMP, Correction, policy_loss


def group_advantages(rewards: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, n] -> advantages [G, n]: (r - mean_group) / (std_group + eps).

    std is the unbiased sample std (as in the GRPO paper's reference code); a group whose rewards
    are all equal gets advantage 0 and so no gradient.
    """
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def batch_advantages(rewards: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, n] -> advantages [G, n] normalised over the whole batch, not per group (grouping
    by batch, paper F.5.2: episodes of different initial states share one baseline)."""
    flat = group_advantages(rewards.reshape(1, -1), scale_by_std=scale_by_std, eps=eps)
    return flat.reshape(rewards.shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class LossStats:
    loss: float
    pg_loss: float
    kl: float
    clip_fraction: float
    """Share of loss tokens the correction clipped or truncated."""
    ratio_mean: float
    token_log_ratio: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """log(pi / mu) of each loss token (1-D, detached), for the step's ratio diagnostics."""
    token_corrected: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    """Whether the correction clipped or truncated each loss token (1-D, same order)."""


def grpo_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    num_tokens: int,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    correction: Correction = "clip",
    dual_clip_delta: float = 4.0,
    is_cap: float = 2.0,
    proximal_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Policy loss under `correction` (learning/corrections.py; default the clipped ratio), summed
    over loss tokens and divided by `num_tokens`.

    logp, behaviour_logp, ref_logp, mask: [B, K]; advantages: [B]. `num_tokens` is the number of
    loss tokens in the whole optimizer step (not this micro-batch), so the micro-batch losses add up
    to the token-level mean of the step. KL uses the k3 estimator exp(ref - logp) - (ref - logp) - 1.
    """
    adv = advantages.unsqueeze(1)
    per_token, was_clipped = policy_loss(
        logp,
        behaviour_logp,
        adv,
        correction=correction,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip_delta=dual_clip_delta,
        is_cap=is_cap,
        proximal_logp=proximal_logp,
    )
    pg = (per_token * mask).sum() / num_tokens
    kl = torch.zeros((), dtype=logp.dtype)
    if ref_logp is not None and beta > 0:
        delta = ref_logp - logp
        kl = ((torch.exp(delta) - delta - 1) * mask).sum() / num_tokens
    loss = pg + beta * kl
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        log_ratio = (logp - behaviour_logp).nan_to_num(nan=0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)
        live = mask > 0
        stats = LossStats(
            loss=loss.item(),
            pg_loss=pg.item(),
            kl=kl.item(),
            clip_fraction=((was_clipped.float() * mask).sum() / n).item(),
            ratio_mean=((ratio * mask).sum() / n).item(),
            token_log_ratio=log_ratio[live].float(),
            token_corrected=was_clipped.expand_as(mask)[live],
        )
    return loss, stats
