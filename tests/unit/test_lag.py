"""rollout.lag: the in-process source generates every batch with the snapshot exactly `lag`
versions older than the learner (version 0 until that many steps exist), and workers refuse it."""

from __future__ import annotations

import pytest
from support import TINY

from echo2.config import ConfigError, load_config
from echo2.data.buffer import ReplayBuffer
from echo2.data.tasks import make_task
from echo2.learning.sources import SourceSpec, make_source
from echo2.learning.sources.local import LocalRollout
from echo2.records import Snapshot, StepReport
from echo2.rollout.engine import Sample


class VersionEngine:
    """Answers every prompt with one token; remembers which version generated each batch."""

    version = 0

    def __init__(self) -> None:
        self.generated_by: list[int] = []

    def install(self, snapshot: Snapshot) -> None:
        self.version = snapshot.version

    def generate(self, prompts, *, n, greedy=False):
        self.generated_by.append(self.version)
        return [
            [Sample(prompt_ids=(1, 2), response_ids=(3,), logprobs=(-0.5,), text="7")] * n for _ in prompts
        ]


def step_done(version: int) -> StepReport:
    """What the learner loop reports after the step that reached `version`."""
    return StepReport(
        step=version - 1,
        version=version,
        snapshot=lambda: Snapshot(version=version, state={}),
        train_s=0.0,
        stats={},
        staleness={},
        refused={},
    )


def lagged_source(lag: int, engine: VersionEngine) -> LocalRollout:
    config = load_config(TINY, {"rollout.lag": lag, "learner.staleness": lag})
    buffer = ReplayBuffer(staleness=lag, group_size=config.rollout.group_size)
    return LocalRollout(
        engine=engine,
        task=make_task(config.task, seed=0),
        buffer=buffer,
        config=config.rollout,
        seed=0,
        publish_every=config.learner.publish_every,
    )


@pytest.mark.parametrize("lag", [1, 3])
def test_every_batch_comes_from_the_snapshot_lag_versions_old(lag):
    engine = VersionEngine()
    source = lagged_source(lag, engine)
    source.start(Snapshot(version=0, state={}))
    seen = []
    for version in range(8):  # what the learner loop does: take, train, report the step
        groups, staleness, _ = source.next_groups(source.config.prompts_per_step)
        seen.append(staleness[0])
        assert set(staleness) == {version - engine.generated_by[-1]}
        source.advance(step_done(version + 1))  # a lag takes a snapshot every step, whatever kappa
    assert engine.generated_by == [max(0, v - lag) for v in range(8)]
    assert seen == [min(v, lag) for v in range(8)]


def test_workers_refuse_a_lag(tmp_path):
    config = load_config(TINY, {"rollout.lag": 2, "learner.staleness": 2})
    with pytest.raises(ConfigError, match="rollout.lag"):
        make_source(
            config,
            spec=SourceSpec(remote=True),
            task=make_task(config.task, seed=0),
            buffer=ReplayBuffer(staleness=2, group_size=config.rollout.group_size),
            engine=VersionEngine(),
            vocab_size=10,
            run_dir=tmp_path,
        )
