from __future__ import annotations

import torch

from echo2.config import Config
from echo2.learning.calibrate import synthetic_groups, time_train_step


def test_calibration_step_times_a_step_and_changes_no_weight(tiny):
    model, tok = tiny
    config = Config.model_validate(
        {"model": {"type": "tiny"}, "rollout": {"prompts_per_step": 2, "group_size": 3, "max_new_tokens": 5}}
    )
    groups = synthetic_groups(config, len(tok))
    assert [len(g) for g in groups] == [3, 3] and all(len(r.response_ids) == 5 for g in groups for r in g)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seconds = time_train_step(model, config, vocab_size=len(tok), pad_id=tok.pad_token_id)
    assert 0 < seconds < 60
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
