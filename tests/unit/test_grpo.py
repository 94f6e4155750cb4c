from __future__ import annotations

import math

import pytest
import torch

from echo2.learning.grpo import group_advantages, grpo_loss
from echo2.models import token_logprobs


def test_group_advantages_hand_computed():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]), eps=1e-6)
    s = math.sqrt(1 / 3) + 1e-6  # unbiased std of (1, 0, 0, 1), plus eps
    assert adv[0].tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], rel=1e-6)
    assert adv[1].tolist() == [0.0] * 4  # a flat group carries no signal
    centred = group_advantages(torch.tensor([[3.0, 1.0]]), scale_by_std=False)
    assert centred.tolist() == [[1.0, -1.0]]


def ln(x: float) -> float:
    return math.log(x)


def test_loss_hand_computed_with_clipping_and_kl():
    logp = torch.tensor([[ln(0.5), ln(0.5)], [ln(0.3), 0.0]])
    old = torch.tensor([[ln(0.25), ln(0.5)], [ln(0.2), 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    # row 0 tok 0: ratio 2.0, A=+1 -> clipped at 1.28 -> -1.28
    # row 0 tok 1: ratio 1.0 -> -1.0
    # row 1 tok 0: ratio 1.5, A=-1 -> min(-1.5, -1.28) = -1.5 -> +1.5 (pessimistic, not clipped)
    loss, stats = grpo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, num_tokens=3)
    assert loss.item() == pytest.approx((-1.28 - 1.0 + 1.5) / 3)
    assert stats.clip_fraction == pytest.approx(1 / 3)
    assert stats.ratio_mean == pytest.approx((2.0 + 1.0 + 1.5) / 3)

    ref = torch.tensor([[ln(0.25), ln(0.5)], [ln(0.3), 0.0]])  # differs from logp in one token
    k3 = 0.5 - ln(0.5) - 1  # exp(d) - d - 1 with d = ln 0.25 - ln 0.5
    loss_kl, stats_kl = grpo_loss(
        logp, old, adv, mask, eps_low=0.2, eps_high=0.28, num_tokens=3, ref_logp=ref, beta=0.1
    )
    assert stats_kl.kl == pytest.approx(k3 / 3)
    assert loss_kl.item() == pytest.approx((-1.28 - 1.0 + 1.5) / 3 + 0.1 * k3 / 3)


def test_low_clip_for_negative_advantage_and_gradient_stops_when_clipped():
    logp = torch.tensor([[ln(0.1)]], requires_grad=True)
    old = torch.tensor([[ln(0.5)]])  # ratio 0.2 < 0.8
    loss, stats = grpo_loss(
        logp, old, torch.tensor([-1.0]), torch.ones(1, 1), eps_low=0.2, eps_high=0.2, num_tokens=1
    )
    assert loss.item() == pytest.approx(0.8) and stats.clip_fraction == 1.0
    loss.backward()
    assert logp.grad.item() == 0.0


def test_token_logprobs_matches_log_softmax_at_temperature():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)
    targets = torch.randint(0, 7, (2, 3))
    got = token_logprobs(logits, targets, temperature=0.7)
    want = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[..., None])[..., 0]
    assert torch.allclose(got, want, atol=1e-6)


def test_ratio_cap_bounds_the_weight_a_behaviour_log_prob_gives_a_negative_advantage_token():
    """A behaviour log-prob 3.9 nats under the learner's on a token with A < 0: uncapped its
    gradient is e^3.9 times an honest token's, capped ratio_cap times; a positive advantage's
    large ratio stays clipped (no gradient) under the cap."""

    def grad(behaviour: float, adv: float, cap: float | None) -> float:
        logp = torch.tensor([[-1.0]], requires_grad=True)
        loss, _ = grpo_loss(
            logp,
            torch.tensor([[behaviour]]),
            torch.tensor([adv]),
            torch.ones(1, 1),
            eps_low=0.2,
            eps_high=0.28,
            num_tokens=1,
            ratio_cap=cap,
        )
        loss.backward()
        return float(logp.grad)

    assert grad(-4.9, -1.0, None) == pytest.approx(math.exp(3.9), rel=1e-5)
    assert grad(-4.9, -1.0, 1.28) == pytest.approx(1.28, rel=1e-5)
    assert grad(-1.1, -1.0, 1.28) == pytest.approx(math.exp(0.1), rel=1e-5)  # under the cap: as it was
    assert grad(-4.9, 1.0, 1.28) == 0.0


def test_a_fresh_row_is_trained_on_the_learners_own_log_probs():
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]], requires_grad=True)
    forged = torch.tensor([[-4.9, -0.5], [-4.9, -0.5]])
    loss, _ = grpo_loss(
        logp,
        forged,
        torch.tensor([-1.0, -1.0]),
        torch.ones(2, 2),
        eps_low=0.2,
        eps_high=0.28,
        num_tokens=4,
        fresh=torch.tensor([True, False]),
    )
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.25, 0.25])  # ratio 1: |A| / num_tokens
    assert logp.grad[1, 0].item() == pytest.approx(math.exp(3.9) / 4, rel=1e-5)
