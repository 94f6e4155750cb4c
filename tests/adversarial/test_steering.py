"""Forged behaviour log-probs inside the learner's bounds (issue 41 item 1): one token of each wrong
answer lowered by 3.9 nats x (1 + staleness), the rest raised to keep the mean. Every record passes
the check. As before issue 41 (reported log-probs trained on, no cap) the step follows the forged
group alone (cosine > 0.98) and its targets move over 5x more than with its honest log-probs. Now a
fresh record is trained on the learner's own log-probs (forging changes nothing), and a stale one's
can give a token a ratio of at most `learner.ratio_cap`.

The measurement is bench/steering.py's, on the suite's tiny model with random tokens as responses
and alternating rewards (the step needs no task)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from echo2.config import LearnerConfig, TinyModelConfig
from echo2.models import load_model
from echo2.records import Trajectory

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from steering import attack, drift  # noqa: E402


def groups_of(seed: int, *, groups: int = 4, n: int = 4, k: int = 8) -> list[list[Trajectory]]:
    rng = random.Random(seed)
    return [
        [
            Trajectory(
                group_id=f"s{seed}g{g}",
                prompt_ids=tuple(rng.randrange(2, 128) for _ in range(6)),
                response_ids=tuple(rng.randrange(2, 128) for _ in range(k)),
                behaviour_logprobs=(0.0,) * k,  # replaced by the behaviour model's own
                loss_mask=(1,) * k,
                reward=float(j % 2),
                version=0,
            )
            for j in range(n)
        ]
        for g in range(groups)
    ]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model(TinyModelConfig(), vocab_size=128, seed=0)


@pytest.mark.parametrize("staleness", [0, 4])
def test_forged_logprobs_inside_the_bounds_steer_the_step_no_more_than_honest_ones(model, staleness: int):
    groups = groups_of(0)
    later = model
    if staleness:  # the learner 4 honest steps on from the weights that generated the records
        later = drift(
            model, [groups_of(10 + j) for j in range(staleness)], LearnerConfig(lr=1e-3), temperature=1.0
        )
    legacy = LearnerConfig(lr=1e-3, ratio_cap=None, staleness=staleness)
    before = attack(later, model, groups, 0, legacy, temperature=1.0, staleness=staleness, legacy=True)
    config = LearnerConfig(lr=1e-3, staleness=staleness)
    after = attack(later, model, groups, 0, config, temperature=1.0, staleness=staleness)
    assert before["targets"] == 2 and before["forged"]["refused"] == after["forged"]["refused"] == 0
    assert before["honest"]["refused"] == 0
    # the attack as reported: uncapped, the step is the forged group's and its targets move far more
    assert before["forged"]["cosine"] > 0.98 and before["displacement"] > 5
    if staleness == 0:  # a fresh record is trained on the learner's own log-probs: forging does nothing
        assert after["forged"] == after["honest"] and after["ratio"] == 1.0
    else:  # a stale one's reported log-probs can give a token a weight of at most ratio_cap: the
        # forgery moves its targets less than the honest step itself does, and pulls the step less
        assert after["displacement"] < 1.0
        assert after["forged"]["cosine"] <= after["honest"]["cosine"]
