"""Checkpoints: the learner's state round-trips, and a crash mid-swap still leaves one to resume."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from echo2.config import ConfigError
from echo2.learning.checkpoint import LearnerState, checkpoint_dir, load_checkpoint, save_checkpoint


def test_learner_state_round_trips_through_json():
    state = LearnerState(
        step=3, version=3, eval_before={"eval/accuracy": 0.5}, staleness=Counter({0: 8, 2: 1})
    )
    again = LearnerState.from_json(json.loads(json.dumps(state.to_json())))
    assert again == state and again.staleness[1] == 0


def test_a_checkpoint_without_a_histogram_resumes_with_an_empty_one():
    old = {"step": 2, "version": 2, "eval_before": None}
    assert LearnerState.from_json(old) == LearnerState(step=2, version=2)


def test_save_then_load_and_the_fallback_after_a_crash_between_the_renames(tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    state = LearnerState(step=1, version=1, staleness=Counter({0: 4}))
    save_checkpoint(
        tmp_path, model=model, optimizer=optimizer, state=state, source_state={"n": 1}, config_toml=""
    )
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.old")  # crashed after the first rename
    assert checkpoint_dir(tmp_path) == tmp_path / "checkpoint.old"
    fresh = torch.nn.Linear(2, 2)
    loaded, source_state = load_checkpoint(
        tmp_path, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters())
    )
    assert loaded == state and source_state == {"n": 1}
    assert torch.equal(fresh.weight, model.weight)


def test_no_checkpoint_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint to resume from"):
        checkpoint_dir(tmp_path)
