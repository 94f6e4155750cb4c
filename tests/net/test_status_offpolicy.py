"""GET /status shows the last step's off-policy diagnostics (coordinator on 127.0.0.1 port 0)."""

from __future__ import annotations

import json
import urllib.request

from support import TINY

from echo2.config import load_config
from echo2.control.remote import RemoteRollout
from echo2.data.buffer import ReplayBuffer
from echo2.data.tasks import make_task


def test_status_shows_the_last_steps_offpolicy_metrics(tmp_path):
    config = load_config(TINY, {"coordinator.token": "t", "learner.staleness": 2})
    source = RemoteRollout(
        config=config,
        task=make_task(config.task, seed=0),
        buffer=ReplayBuffer(staleness=2, group_size=config.rollout.group_size),
        vocab_size=100,
        provider=None,
        run_dir=tmp_path,
        on_start=[],
    )
    try:
        source.record_metrics(
            {"step": 3, "reward/mean": 0.5, "offpolicy/ratio_p99": 1.7, "offpolicy/ratio_p99@s2": 2.5}
        )
        req = urllib.request.Request(source.url + "/status", headers={"Authorization": "Bearer t"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            status = json.loads(resp.read())
    finally:
        source.close()
    assert status["offpolicy"] == {"step": 3, "offpolicy/ratio_p99": 1.7, "offpolicy/ratio_p99@s2": 2.5}
