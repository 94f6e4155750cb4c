"""Off-policy corrections for stale rollouts, and the importance-ratio diagnostics. Pure tensors.

r = pi_theta / mu per token, where mu is the behaviour policy (the snapshot that generated the
record) and pi_theta the learner's current weights. Every correction computes r from a log-ratio
clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp, so a very stale (or corrupted) record
gives a large but finite ratio instead of inf (and inf * 0 = NaN). Formulas in docs/config.md.

Shapes: B rows, K response positions. `adv` is [B, 1] (broadcast over tokens).
"""

from __future__ import annotations

from typing import Literal

import torch

Correction = Literal["clip", "dual_clip", "tis", "decoupled"]
CORRECTIONS: tuple[str, ...] = ("clip", "dual_clip", "tis", "decoupled")
LOG_RATIO_CLAMP = 20.0
"""|log r| is clamped to this before exp (as verl does): r stays within [2e-9, 4.9e8]."""


def safe_ratio(logp: torch.Tensor, base_logp: torch.Tensor) -> torch.Tensor:
    """exp(clamp(logp - base_logp)): finite even when base_logp is -inf or -1e4."""
    log_ratio = torch.nan_to_num(logp - base_logp, nan=0.0, posinf=LOG_RATIO_CLAMP, neginf=-LOG_RATIO_CLAMP)
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _ppo_clip(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float):
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) and where the clip took effect."""
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    was_clipped = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
    return loss, was_clipped


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    adv: torch.Tensor,
    *,
    correction: Correction = "clip",
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip_delta: float = 4.0,
    is_cap: float = 2.0,
    proximal_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token policy loss [B, K] under `correction`, and a bool mask of the tokens the
    correction clipped or truncated.

    clip:      -min(r A, clip(r, 1-el, 1+eh) A)
    dual_clip: as clip, but for A < 0 at most -delta A (Ye et al. 2020): the loss of a token with a
               huge ratio on a negative advantage is bounded, and its gradient is 0 beyond r = delta.
    tis:       -sg(min(r, C) / r) r A: value -min(r, C) A, gradient min(r, C) A grad log pi
               (truncated importance sampling against the behaviour policy, no trust region).
    decoupled: -sg(min(pi_prox / mu, C)) min(u A, clip(u, 1-el, 1+eh) A), u = pi_theta / pi_prox
               (AReaL): the clip is taken against the proximal policy (the learner's weights at
               the start of the step), the behaviour/proximal ratio is a truncated weight.
               `proximal_logp` defaults to logp.detach() (the weights of this forward pass).
    """
    ratio = safe_ratio(logp, behaviour_logp)
    if correction == "clip":
        return _ppo_clip(ratio, adv, eps_low, eps_high)
    if correction == "dual_clip":
        loss, was_clipped = _ppo_clip(ratio, adv, eps_low, eps_high)
        bound = -dual_clip_delta * adv  # > 0 where adv < 0
        capped = (adv < 0) & (loss > bound)
        return torch.where(adv < 0, torch.minimum(loss, bound), loss), was_clipped | capped
    if correction == "tis":
        weight = torch.clamp(is_cap / ratio, max=1.0).detach()  # min(r, C) / r
        return -(weight * ratio * adv), ratio > is_cap
    if correction == "decoupled":
        prox = logp.detach() if proximal_logp is None else proximal_logp.detach()
        behav_weight = safe_ratio(prox, behaviour_logp)
        loss, was_clipped = _ppo_clip(safe_ratio(logp, prox), adv, eps_low, eps_high)
        return torch.clamp(behav_weight, max=is_cap) * loss, was_clipped | (behav_weight > is_cap)
    raise ValueError(f"learner.correction: unknown {correction!r} (one of {', '.join(CORRECTIONS)})")


def ratio_diagnostics(
    log_ratio: torch.Tensor, corrected: torch.Tensor, staleness: torch.Tensor, *, max_staleness: int
) -> dict[str, float]:
    """Importance-ratio diagnostics over a step's loss tokens (1-D tensors of equal length:
    log(pi/mu) per token, whether the correction clipped/truncated it, its record's staleness).

    `offpolicy/ratio_mean|ratio_p99|ratio_max`, `offpolicy/corrected_fraction` and
    `offpolicy/kl_behaviour` (the k3 estimate of KL(mu || pi) on behaviour samples:
    mean of (r - 1) - log r), then the same for each staleness 0..max_staleness with the suffix
    `@s<k>` (absent when no token had that staleness).
    """
    out: dict[str, float] = {}
    log_ratio = log_ratio.detach().double().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    for k in [None, *range(max_staleness + 1)]:
        sel = torch.ones_like(staleness, dtype=torch.bool) if k is None else staleness == k
        if not bool(sel.any()):
            continue
        lr = log_ratio[sel]
        r = torch.exp(lr)
        suffix = "" if k is None else f"@s{k}"
        out[f"offpolicy/ratio_mean{suffix}"] = float(r.mean())
        out[f"offpolicy/ratio_p99{suffix}"] = float(torch.quantile(r, 0.99))
        out[f"offpolicy/ratio_max{suffix}"] = float(r.max())
        out[f"offpolicy/corrected_fraction{suffix}"] = float(corrected[sel].double().mean())
        out[f"offpolicy/kl_behaviour{suffix}"] = float(((r - 1) - lr).mean())
        out[f"offpolicy/tokens{suffix}"] = float(sel.sum())
    return out
