"""Issue 41 item 2: a sampled token's margin just over the tolerance (as honest bf16 engines reach
now and then) leaves the record out of the step without a strike; over the strike margin it is
refused for a strike (learning/verify.py: SamplingCheck.verdicts)."""

from __future__ import annotations

import torch

from echo2.learning.verify import STRIKE_FACTOR, SamplingCheck
from echo2.records import Trajectory
from echo2.rollout import sampling

SEED, VOCAB, T = 99, 11, 0.8


def _record(token: int) -> Trajectory:
    return Trajectory(
        group_id="g",
        prompt_ids=(1,),
        response_ids=(token,),
        behaviour_logprobs=(0.0,),
        loss_mask=(1,),
        reward=0.0,
        version=0,
        metadata={sampling.SEED_KEY: SEED, sampling.SAMPLE_KEY: 0},
    )


def _runner_up():
    """Logits [1, 1, V], the arg-max token of their keyed noise, the runner-up and its margin."""
    logits = torch.randn(1, 1, VOCAB, generator=torch.Generator().manual_seed(0))
    score = sampling.scores(
        logits[:, 0],
        seed=SEED,
        records=torch.tensor([sampling.record_key("g", 0)]),
        positions=0,
        temperature=T,
    )[0]
    order = score.argsort(descending=True)
    return logits, int(order[0]), int(order[1]), float(score[order[0]] - score[order[1]])


def _verdicts(token: int, logits, *, tolerance: float, strike_margin: float | None):
    check = SamplingCheck(
        temperature=T,
        top_p=1.0,
        group_size=1,
        max_new_tokens=1,
        eos_id=None,
        tolerance=tolerance,
        strike_margin=strike_margin,
    )
    refused, doubtful = check.verdicts(logits, torch.tensor([[token]]), [_record(token)], set())
    return bool(refused[0]), bool(doubtful[0])


def test_a_margin_over_the_tolerance_and_under_the_strike_margin_is_left_out_without_a_strike():
    logits, best, second, margin = _runner_up()
    assert margin > 0
    assert _verdicts(best, logits, tolerance=margin / 2, strike_margin=None) == (False, False)
    assert _verdicts(second, logits, tolerance=2 * margin, strike_margin=None) == (False, False)
    assert _verdicts(second, logits, tolerance=margin / 1.5, strike_margin=None) == (False, True)
    assert _verdicts(second, logits, tolerance=margin / 4, strike_margin=2 * margin) == (False, True)
    assert _verdicts(second, logits, tolerance=margin / 4, strike_margin=margin / 2) == (True, False)
    # the default strike margin is STRIKE_FACTOR x the tolerance; one under the tolerance counts as it
    assert _verdicts(second, logits, tolerance=margin / (STRIKE_FACTOR + 0.5), strike_margin=None) == (
        True,
        False,
    )
    assert _verdicts(second, logits, tolerance=margin / 1.5, strike_margin=margin / 100) == (True, False)


def test_bad_keys_and_tokens_outside_the_set_are_refused_whatever_the_strike_margin():
    logits, best, _, _ = _runner_up()
    check = SamplingCheck(
        temperature=T, top_p=1.0, group_size=1, max_new_tokens=1, eos_id=None, strike_margin=1e9
    )
    record = _record(best)
    refused, doubtful = check.verdicts(logits, torch.tensor([[best]]), [record], {record.record_id})
    assert refused.tolist() == [True] and doubtful.tolist() == [False]
    refused, doubtful = check.verdicts(logits, torch.tensor([[VOCAB + 3]]), [_record(VOCAB + 3)], set())
    assert refused.tolist() == [True] and doubtful.tolist() == [False]


def test_a_stale_record_over_the_tolerance_is_doubtful_whatever_its_margin():
    """Its margins are against the learner's newer weights, so they measure drift too: no strike."""
    logits, _, second, margin = _runner_up()
    check = SamplingCheck(
        temperature=T, top_p=1.0, group_size=1, max_new_tokens=1, eos_id=None, tolerance=margin / 4,
        strike_margin=margin / 2,
    )  # fmt: skip
    for stale, want in ((False, [True, False]), (True, [False, True])):
        refused, doubtful = check.verdicts(
            logits, torch.tensor([[second]]), [_record(second)], set(), stale=torch.tensor([stale])
        )
        assert [bool(refused[0]), bool(doubtful[0])] == want
    record = _record(second)  # bad keys are refused, stale or not
    refused, _ = check.verdicts(
        logits, torch.tensor([[second]]), [record], {record.record_id}, stale=torch.tensor([True])
    )
    assert refused.tolist() == [True]
