"""Off-policy corrections against hand-computed numbers, the log-ratio guard, and the diagnostics."""

from __future__ import annotations

import math

import pytest
import torch

from echo2.learning.corrections import policy_loss, ratio_diagnostics, safe_ratio
from echo2.learning.grpo import grpo_loss

ln = math.log
KW = {"eps_low": 0.2, "eps_high": 0.28, "dual_clip_delta": 4.0, "is_cap": 2.0}


def loss_and_grad(correction: str, ratio: float, adv: float, **extra) -> tuple[float, float]:
    """Per-token loss and d loss / d log pi of one token whose ratio pi/mu is `ratio`."""
    logp = torch.tensor([[ln(0.5)]], requires_grad=True)
    behaviour = torch.tensor([[ln(0.5) - ln(ratio)]])
    loss, _ = policy_loss(logp, behaviour, torch.tensor([[adv]]), correction=correction, **(KW | extra))
    loss.sum().backward()
    return loss.item(), logp.grad.item()


@pytest.mark.parametrize(
    ("correction", "ratio", "adv", "want_loss", "want_grad"),
    [
        # clip: -min(rA, clip(r, 0.8, 1.28)A); gradient -rA unless the clip took effect
        ("clip", 2.0, 1.0, -1.28, 0.0),
        ("clip", 1.5, -1.0, 1.5, 1.5),
        ("clip", 0.5, -1.0, 0.8, 0.0),
        # dual_clip: for A < 0 at most -4A
        ("dual_clip", 3.0, -1.0, 3.0, 3.0),
        ("dual_clip", 5.0, -1.0, 4.0, 0.0),
        ("dual_clip", 2.0, 1.0, -1.28, 0.0),  # A > 0: the ordinary clip
        # tis: value -min(r, 2)A, gradient -min(r, 2)A
        ("tis", 0.5, 1.0, -0.5, -0.5),
        ("tis", 3.0, 1.0, -2.0, -2.0),
        ("tis", 3.0, -0.5, 1.0, 1.0),
        # decoupled with the proximal policy = the current one (one update per step): u = 1, weight min(r, 2)
        ("decoupled", 1.5, 1.0, -1.5, -1.5),
        ("decoupled", 3.0, -1.0, 2.0, 2.0),
    ],
)
def test_corrections_hand_computed(correction, ratio, adv, want_loss, want_grad):
    got_loss, got_grad = loss_and_grad(correction, ratio, adv)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert got_grad == pytest.approx(want_grad, rel=1e-5, abs=1e-7)


def test_decoupled_clips_against_the_proximal_policy_and_weights_by_prox_over_behaviour():
    logp = torch.tensor([[ln(0.5), ln(0.5)]], requires_grad=True)
    prox = torch.tensor([[ln(0.25), ln(0.25)]])  # u = pi / pi_prox = 2
    behaviour = torch.tensor([[ln(0.2), ln(0.05)]])  # pi_prox / mu = 1.25, then 5 (truncated to 2)
    for adv, want in [(1.0, [-1.28 * 1.25, -1.28 * 2.0]), (-1.0, [2.0 * 1.25, 2.0 * 2.0])]:
        loss, corrected = policy_loss(
            logp, behaviour, torch.tensor([[adv]]), correction="decoupled", proximal_logp=prox, **KW
        )
        assert loss[0].tolist() == pytest.approx(want, rel=1e-5)
        # A > 0: u = 2 is clipped on both tokens; A < 0: only the truncated weight of token 2 counts
        assert corrected[0].tolist() == ([True, True] if adv > 0 else [False, True])


def test_ratio_1000_on_a_negative_advantage_is_bounded_by_dual_clip_and_tis():
    clip_loss, clip_grad = loss_and_grad("clip", 1000.0, -1.0)
    assert clip_loss == pytest.approx(1000.0, rel=1e-4) and clip_grad == pytest.approx(1000.0, rel=1e-4)
    dual_loss, dual_grad = loss_and_grad("dual_clip", 1000.0, -1.0)
    assert dual_loss == pytest.approx(4.0) and dual_grad == 0.0
    tis_loss, tis_grad = loss_and_grad("tis", 1000.0, -1.0)
    assert tis_loss == pytest.approx(2.0, rel=1e-5) and tis_grad == pytest.approx(2.0, rel=1e-5)
    dec_loss, dec_grad = loss_and_grad("decoupled", 1000.0, -1.0)
    assert dec_loss == pytest.approx(2.0, rel=1e-5) and dec_grad == pytest.approx(2.0, rel=1e-5)


@pytest.mark.parametrize("correction", ["clip", "dual_clip", "tis", "decoupled"])
def test_a_stale_batch_that_overflowed_the_ratio_now_gives_a_finite_loss(correction):
    # The behaviour policy gave these tokens (almost) no mass: log mu = -1e4 (or -inf), so the
    # unguarded ratio exp(log pi - log mu) is inf, and inf * A is inf (A < 0) or NaN (A = 0).
    logp = torch.tensor([[ln(0.5), ln(0.5)], [ln(0.5), ln(0.5)]], requires_grad=True)
    behaviour = torch.tensor([[-1e4, -float("inf")], [-1e4, ln(0.5)]])
    adv = torch.tensor([-1.0, 0.0])
    unguarded = -torch.minimum(torch.exp(logp - behaviour) * adv[:, None], torch.ones(2, 2) * adv[:, None])
    assert not torch.isfinite(unguarded.sum()), "the old formula overflows on this batch"
    loss, stats = grpo_loss(
        logp,
        behaviour,
        adv,
        torch.ones(2, 2),
        eps_low=0.2,
        eps_high=0.28,
        num_tokens=4,
        correction=correction,
    )
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
    assert math.isfinite(stats.ratio_mean) and stats.token_log_ratio.max().item() == 20.0


def test_safe_ratio_clamps_the_log_ratio():
    r = safe_ratio(
        torch.tensor([0.0, 0.0, -1e4, float("nan")]), torch.tensor([-1e4, 1e4, -float("inf"), 0.0])
    )
    assert r.tolist() == pytest.approx([math.exp(20), math.exp(-20), math.exp(20), 1.0], rel=1e-6)


def test_ratio_diagnostics_overall_and_by_staleness():
    log_ratio = torch.tensor([0.0, ln(2), ln(0.5), ln(4)])
    corrected = torch.tensor([False, True, False, True])
    staleness = torch.tensor([0, 0, 1, 1])
    d = ratio_diagnostics(log_ratio, corrected, staleness, max_staleness=2)
    k3 = [0.0, 1 - ln(2), -0.5 + ln(2), 3 - ln(4)]  # (r - 1) - ln r
    assert d["offpolicy/ratio_mean"] == pytest.approx(7.5 / 4)
    assert d["offpolicy/ratio_max"] == pytest.approx(4.0)
    assert d["offpolicy/corrected_fraction"] == 0.5
    assert d["offpolicy/kl_behaviour"] == pytest.approx(sum(k3) / 4)
    assert d["offpolicy/ratio_mean@s0"] == pytest.approx(1.5)
    assert d["offpolicy/ratio_p99@s0"] == pytest.approx(1.99)  # linear interpolation between 1 and 2
    assert d["offpolicy/kl_behaviour@s1"] == pytest.approx((k3[2] + k3[3]) / 2)
    assert d["offpolicy/tokens@s1"] == 2.0
    assert "offpolicy/ratio_mean@s2" not in d  # no token had staleness 2


def test_unknown_correction_is_refused():
    with pytest.raises(ValueError, match="learner.correction"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), correction="ppo")  # type: ignore[arg-type]
