"""What passes the door but not the learner: fabricated log-probs are left out of the step and
strike their worker; a step whose loss or gradient is not finite is never applied."""

from __future__ import annotations

import copy

import torch
from hostile import PROMPTS, Door, HostileWorker

from echo2.learning.step import train_step
from echo2.learning.verify import StepCheck


def fabricated(door: Door, mallory: HostileWorker) -> None:
    """Honest responses and rewards, with log-probs made up (plausible: the door lets them in)."""
    lease_id, records = door.honest_lease(mallory)
    for r in records:
        r["behaviour_logprobs"] = [-0.01] * len(r["response_ids"])
    status, body = mallory.push(lease_id, records)
    assert status == 200, body


def test_fabricated_logprobs_are_left_out_and_strike_their_worker(door: Door, mallory: HostileWorker):
    weights = copy.deepcopy(door.model.state_dict())
    fabricated(door, mallory)
    check = StepCheck(max_logratio=door.config.max_logratio, learner_version=0)
    stats = door.train(PROMPTS, check)
    assert len(check.refused) == 2 * PROMPTS and stats["train/refused_records"] == 2 * PROMPTS
    assert all(torch.equal(weights[k], v) for k, v in door.model.state_dict().items()), (
        "nothing was trained on"
    )
    assert door.state.intake.flag(check.refused, "logprob_mismatch") == [mallory.worker_id]
    assert door.state.intake.integrity.strikes[mallory.worker_id] == 1
    door.learner_trains()


def test_a_worker_whose_records_keep_failing_is_quarantined(door: Door, mallory: HostileWorker):
    for _ in range(door.state.intake.integrity.quarantine_after):
        fabricated(door, mallory)
        check = StepCheck(max_logratio=door.config.max_logratio, learner_version=0)
        door.train(PROMPTS, check)
        door.state.intake.flag(check.refused, "logprob_mismatch")
    status, body = mallory.lease()
    assert (status, body["error"]) == (403, "quarantined")
    door.learner_trains()


def test_a_non_finite_step_is_not_applied(door: Door):
    """Records that slipped past every check (here: no check at all) with a NaN reward (an
    overflowing or NaN log-ratio is already made finite by learning/corrections.py): the advantages
    and so the loss are not finite, the step is skipped and every weight stays as it was."""
    groups = door.generate([0, 1])
    poisoned = [[copy.copy(r) for r in g] for g in groups]
    for r in (r for g in poisoned for r in g):  # Trajectory refuses a NaN reward: go around it
        object.__setattr__(r, "reward", float("nan"))
    weights = copy.deepcopy(door.model.state_dict())
    stats = train_step(door.model, door.optimizer, poisoned, door.config, pad_id=0, temperature=1.0)
    assert stats["train/skipped_step"] == 1.0
    assert all(torch.equal(weights[k], v) for k, v in door.model.state_dict().items())
    door.learner_trains()
