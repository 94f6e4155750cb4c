"""Where the learner's data come from: the `RolloutSource` seam and the one factory that builds it.

Owns the choice between the learner's own engine taking turns with it (`LocalRollout`, no workers)
and a coordinator fed by worker processes (`RemoteRollout`: remote hosts, or a `LocalFleet` on this
machine), and the glue each needs (starting local workers once the coordinator listens, handing the
fleet to the scheduler as its provider, timing a learner step for the scheduler). The learner loop
calls `make_source` once and from then on only speaks the protocol; it does not know which source it
drives. What only a coordinator needs (refused records, train time, the status page's figures, the
run summary's measurements) it takes from the `StepReport` and keeps behind its own door.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from echo2.config import Config, ConfigError
from echo2.data.buffer import ReplayBuffer
from echo2.data.tasks.base import Task
from echo2.learning import distributed
from echo2.learning.sources.local import LocalRollout
from echo2.records import Snapshot, StepReport, Trajectory
from echo2.rollout.engine import Engine

if TYPE_CHECKING:
    from echo2.fleet.providers.local import LocalFleet


class RolloutSource(Protocol):
    """Where the learner gets whole groups of admissible records. Implemented by `LocalRollout`
    (learning/sources/local.py, in process) and `RemoteRollout` (learning/sources/remote.py, coordinator + workers)."""

    checks_logprobs: bool
    """Its records' behaviour log-probs are a policy's, so the learner compares them with its own
    (False for emulated workers, whose log-probs are uniform)."""

    def start(self, snapshot: Snapshot) -> None:
        """Serve rollouts from `snapshot` on (the weights the learner starts or resumes from);
        a coordinator binds its port here (`ConfigError` if it cannot)."""
        ...

    def next_groups(self, num_groups: int) -> tuple[list[list[Trajectory]], list[int], dict[str, float]]:
        """Whole groups, their records' staleness, and rollout metrics (`time/learner_wait`: how
        long the learner waited for them); blocks until available."""
        ...

    def advance(self, report: StepReport) -> None:
        """The learner finished a step: evict what is now too stale, and publish `report.snapshot()`
        when the source's rule says (every `learner.publish_every` versions; every version under
        `rollout.lag`)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep: the prompt cursor, buffered records, prompts still owed."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what `state_dict` kept (before `start`)."""
        ...

    def close(self) -> dict[str, Any]:
        """Stop serving; returns the source's measurements for the run summary (T_train, T_bcast,
        idle time, ...; none for the in-process source, whose figures are the metrics rows')."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceSpec:
    """Where a run's rollouts come from, as the CLI (or a test) chose it. The default: the
    learner's own engine, taking turns with the learner."""

    remote: bool = False
    """Serve a coordinator and train on what workers push (`echo2 learner`)."""
    fleet: LocalFleet | None = None
    """Worker processes on this machine, started once the coordinator listens (`echo2 run
    --workers K`, `scheduler.provider = "local"`); implies `remote`. The caller stops it."""
    on_ready: Callable[[Any], None] | None = None
    """Called with the source once it serves the first snapshot (print the URL, start workers)."""


def make_source(
    config: Config,
    *,
    spec: SourceSpec,
    task: Task,
    buffer: ReplayBuffer,
    engine: Engine,
    vocab_size: int,
    run_dir: Path,
    tokenizer=None,
    time_train_step: Callable[[], float] | None = None,
) -> RolloutSource:
    """The rollout source `spec` names, filling `buffer`; nothing runs and nothing is written
    before its `start`. `engine` generates for the in-process source; `time_train_step` times one
    learner step for a scheduler that needs T_train before the first step (learning/calibrate.py;
    not under torchrun, where a step takes every rank)."""
    if not spec.remote and spec.fleet is None:
        return LocalRollout(
            engine=engine,
            task=task,
            buffer=buffer,
            config=config.rollout,
            seed=config.run.seed,
            publish_every=config.learner.publish_every,
        )
    if config.rollout.lag:
        raise ConfigError("rollout.lag: only the in-process loop (no workers) generates with a fixed lag")
    from echo2.learning.sources.remote import RemoteRollout  # aiohttp, the coordinator

    on_start = [hook for hook in (spec.fleet and spec.fleet.start, spec.on_ready) if hook]
    return RemoteRollout(
        config,
        task=task,
        buffer=buffer,
        vocab_size=vocab_size,
        tokenizer=tokenizer,
        provider=spec.fleet if config.scheduler.provider in ("local", "skypilot") else None,
        run_dir=run_dir,
        on_start=on_start,
        time_train_step=time_train_step if distributed.world_size() == 1 else None,
    )
