"""GET /status shows the last step's off-policy diagnostics and the learner's staleness histogram,
as the learner reported them with the step (coordinator on 127.0.0.1 port 0)."""

from __future__ import annotations

import json
import urllib.request

from support import TINY

from echo2.config import load_config
from echo2.data.buffer import ReplayBuffer
from echo2.data.tasks import make_task
from echo2.learning.sources.remote import RemoteRollout
from echo2.records import Snapshot, StepReport


def test_status_shows_the_last_steps_offpolicy_metrics_and_the_learners_histogram(tmp_path):
    config = load_config(TINY, {"coordinator.token": "t", "learner.staleness": 2})
    source = RemoteRollout(
        config,
        task=make_task(config.task, seed=0),
        buffer=ReplayBuffer(staleness=2, group_size=config.rollout.group_size),
        vocab_size=100,
        run_dir=tmp_path,
    )
    try:
        source.start(Snapshot(version=0, state={}))
        source.advance(
            StepReport(
                step=3,
                version=4,
                snapshot=lambda: Snapshot(version=4, state={}),
                train_s=0.5,
                stats={"train/loss": 0.1, "offpolicy/ratio_p99": 1.7, "offpolicy/ratio_p99@s2": 2.5},
                staleness={0: 40, 1: 24},  # the whole run's, a resumed one's included
                refused={"logprob_mismatch": []},
            )
        )
        req = urllib.request.Request(source.url + "/status", headers={"Authorization": "Bearer t"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            status = json.loads(resp.read())
    finally:
        measured = source.close()
    assert status["offpolicy"] == {"step": 3, "offpolicy/ratio_p99": 1.7, "offpolicy/ratio_p99@s2": 2.5}
    assert status["staleness_histogram"] == {"0": 40, "1": 24} == measured["staleness_histogram"]
    assert measured["t_train"] == 0.5
