"""make_source: the default spec is the in-process source, which starts no coordinator and writes
nothing; `start` installs the learner's weights in the engine."""

from __future__ import annotations

from support import TINY

from echo2.config import load_config
from echo2.data.buffer import ReplayBuffer
from echo2.data.tasks import make_task
from echo2.learning.source import SourceSpec, make_source
from echo2.records import Snapshot
from echo2.rollout.local import LocalRollout


class RecordingEngine:
    version = 0

    def __init__(self) -> None:
        self.installed: list[int] = []

    def install(self, snapshot: Snapshot) -> None:
        self.installed.append(snapshot.version)
        self.version = snapshot.version

    def generate(self, prompts, *, n, greedy=False):
        raise AssertionError("not called here")


def test_the_default_spec_is_the_in_process_source(tmp_path):
    config = load_config(TINY, {})
    engine = RecordingEngine()
    source = make_source(
        config,
        spec=SourceSpec(),
        task=make_task(config.task, seed=0),
        buffer=ReplayBuffer(staleness=0, group_size=config.rollout.group_size),
        engine=engine,
        vocab_size=10,
        run_dir=tmp_path,
    )
    assert isinstance(source, LocalRollout)
    source.start(Snapshot(version=3, state={}))
    assert engine.installed == [3]
    assert source.state_dict()["next_prompt"] == 0
    assert list(tmp_path.iterdir()) == [], "the in-process source writes nothing to the run dir"
