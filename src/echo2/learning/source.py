"""Where the learner's data come from: the `RolloutSource` seam and the one factory that builds it.

Owns the choice between the learner's own engine taking turns with it (`LocalRollout`, no workers)
and a coordinator fed by worker processes (`RemoteRollout`: remote hosts, or a `LocalFleet` on this
machine), and the glue each needs (starting local workers once the coordinator listens, handing the
fleet to the scheduler as its provider). The learner loop calls `make_source` once and from then on
only speaks the protocol; it does not know which source it drives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from echo2.config import Config, ConfigError
from echo2.data.buffer import ReplayBuffer
from echo2.data.tasks.base import Task
from echo2.records import Snapshot, Trajectory
from echo2.rollout.engine import Engine
from echo2.rollout.local import LocalRollout

if TYPE_CHECKING:
    from echo2.rollout.local_fleet import LocalFleet


class RolloutSource(Protocol):
    """Where the learner gets whole groups of admissible records. Implemented by `LocalRollout`
    (rollout/local.py, in process) and `RemoteRollout` (control/remote.py, coordinator + workers)."""

    def start(self, snapshot: Snapshot) -> None:
        """Serve rollouts from `snapshot` on (the weights the learner starts or resumes from)."""
        ...

    def next_groups(self, num_groups: int) -> tuple[list[list[Trajectory]], list[int], dict[str, float]]:
        """Whole groups, their records' staleness, and rollout metrics (`time/learner_wait`: how
        long the learner waited for them); blocks until available."""
        ...

    def advance(self, version: int) -> None:
        """The learner moved to `version`: evict what is now too stale."""
        ...

    def publish(self, snapshot: Snapshot) -> None:
        """Make `snapshot` the weights rollouts are generated with from now on."""
        ...

    def record_train_time(self, seconds: float) -> None:
        """The learner's step time, for T_train and the bubble ratio."""
        ...

    def record_metrics(self, row: dict[str, Any]) -> None:
        """The step's metrics row (the coordinator's GET /status shows its `offpolicy/*` keys)."""
        ...

    def flag(self, records: list[Trajectory], reason: str) -> list[str]:
        """The learner refused these records after taking them (learning/verify.py): count them,
        strike the workers that made them; returns those workers."""
        ...

    def timings(self) -> dict[str, Any]:
        """Measurements for the run summary (T_train, T_bcast, idle time, ...)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep: the prompt cursor, buffered records, prompts still owed."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


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
) -> RolloutSource:
    """The rollout source `spec` names, filling `buffer`. `engine` generates for the in-process
    source; a remote source serves a coordinator (listening when this returns)."""
    if not spec.remote and spec.fleet is None:
        return LocalRollout(
            engine=engine, task=task, buffer=buffer, config=config.rollout, seed=config.run.seed
        )
    if config.rollout.lag:
        raise ConfigError("rollout.lag: only the in-process loop (no workers) generates with a fixed lag")
    from echo2.control.remote import RemoteRollout  # aiohttp, the coordinator

    on_start = [hook for hook in (spec.fleet and spec.fleet.start, spec.on_ready) if hook]
    return RemoteRollout(
        config=config,
        task=task,
        buffer=buffer,
        vocab_size=vocab_size,
        tokenizer=tokenizer,
        provider=spec.fleet if config.scheduler.provider in ("local", "skypilot") else None,
        run_dir=run_dir,
        on_start=on_start,
    )
