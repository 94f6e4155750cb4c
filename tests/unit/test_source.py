"""make_source: the default spec is the in-process source, which starts no coordinator and writes
nothing; `start` installs the learner's weights in the engine; the source publishes every
`learner.publish_every` versions and generates every batch from what it published, whatever else
the engine ran in between (the learner's evaluation)."""

from __future__ import annotations

from support import TINY

from echo2.config import load_config
from echo2.data.buffer import ReplayBuffer
from echo2.data.tasks import make_task
from echo2.learning.sources import SourceSpec, make_source
from echo2.learning.sources.local import LocalRollout
from echo2.records import Snapshot, StepReport
from echo2.rollout.engine import Sample


class RecordingEngine:
    version = 0

    def __init__(self) -> None:
        self.installed: list[int] = []
        self.generated_by: list[int] = []

    def install(self, snapshot: Snapshot) -> None:
        self.installed.append(snapshot.version)
        self.version = snapshot.version

    def generate(self, prompts, *, n, greedy=False):
        self.generated_by.append(self.version)
        return [
            [Sample(prompt_ids=(1, 2), response_ids=(3,), logprobs=(-0.5,), text="7")] * n for _ in prompts
        ]


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


def test_the_in_process_source_publishes_every_kappa_and_generates_from_what_it_published(tmp_path):
    config = load_config(TINY, {"learner.kappa": 2, "learner.staleness": 3})
    engine = RecordingEngine()
    source = make_source(
        config,
        spec=SourceSpec(),
        task=make_task(config.task, seed=0),
        buffer=ReplayBuffer(staleness=3, group_size=config.rollout.group_size),
        engine=engine,
        vocab_size=10,
        run_dir=tmp_path,
    )
    made: list[int] = []

    def snapshot(version: int):
        def make() -> Snapshot:
            made.append(version)
            return Snapshot(version=version, state={})

        return make

    source.start(Snapshot(version=0, state={}))
    for version in range(4):
        source.next_groups(config.rollout.prompts_per_step)
        engine.install(Snapshot(version=100 + version, state={}))  # the learner evaluates its weights
        report = StepReport(
            step=version,
            version=version + 1,
            snapshot=snapshot(version + 1),
            train_s=0.0,
            stats={},
            staleness={},
            refused={},
        )
        source.advance(report)
    assert made == [2, 4], "a snapshot every kappa = 2 versions, made only then"
    assert engine.generated_by == [0, 0, 2, 2], "every batch from the last published snapshot"
    assert source.close() == {}
