"""The Python API (paper F.2): build a run from a config object or file, change it, run it, read
its metrics. `echo2 run` and `echo2 learner` are this class behind a command line.

    from echo2.api import Echo2

    run = Echo2("configs/tiny.toml", {"learner.steps": 2, "run.dir": "runs/api-demo"})
    run.set(staleness=1, task="poker:heads_up?opponent=call_station")
    summary = run.run(workers=0)
    print(run.metrics()[-1]["reward/mean"], summary["eval_after"])

Owns nothing of training itself (learning/loop.py does that): it resolves the config, refuses a
mistake with `ConfigError` naming the key before anything is written, chooses the rollout source
(in process, K local worker processes, a coordinator for remote workers, the scheduler's local
provider) and stops what it started. Importing it is light; torch loads when `run` is called.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from echo2.config import Config, ConfigError, build_config, load_config, read_toml


class Echo2:
    def __init__(
        self,
        config: Config | dict[str, Any] | str | Path | None = None,
        overrides: dict[str, Any] | None = None,
        *,
        run_dir: str | Path | None = None,
    ) -> None:
        """`config`: a `Config`, a dict shaped like the TOML file, a TOML file's path, or None for
        the defaults; `overrides`: dotted keys as on the command line ({"learner.lr": 1e-6});
        `run_dir`: where the run writes (default: the config's run.dir)."""
        if isinstance(config, str | Path):
            self.config = load_config(config, overrides)
        elif isinstance(config, Config):
            tree = config.model_dump(mode="json", exclude_none=True)
            self.config = build_config(tree, overrides) if overrides else config
        else:
            self.config = build_config(dict(config or {}), overrides)
        self._run_dir = Path(run_dir) if run_dir is not None else None
        self.summary: dict[str, Any] | None = None

    @classmethod
    def resume(cls, run_dir: str | Path, overrides: dict[str, Any] | None = None) -> Echo2:
        """The run saved in `run_dir`, to continue from its checkpoint with `run(resume=True)`."""
        saved = Path(run_dir) / "config.toml"
        if not saved.is_file():
            raise ConfigError(f"{run_dir}: not a run directory (no config.toml)")
        return cls(read_toml(saved), overrides, run_dir=run_dir)

    # ------------------------------------------------------------------ configuring
    def set(
        self,
        updates: dict[str, Any] | None = None,
        *,
        staleness: int | None = None,
        task: str | dict[str, Any] | None = None,
    ) -> Echo2:
        """Change the run before it starts; returns self. `staleness`: S (learner.staleness);
        `task`: an environment spec ("poker:heads_up?opponent=random", task.type = "env") or a whole
        task section as a dict; `updates`: any dotted keys. Only the task section changes with the
        task."""
        tree = self.config.model_dump(mode="json", exclude_none=True)
        if task is not None:
            tree["task"] = {"type": "env", "env": task} if isinstance(task, str) else dict(task)
        dotted = dict(updates or {})
        if staleness is not None:
            dotted["learner.staleness"] = staleness
        self.config = build_config(tree, dotted)
        return self

    @property
    def run_dir(self) -> Path:
        return self._run_dir if self._run_dir is not None else self.config.run_dir()

    # ------------------------------------------------------------------ running
    def run(
        self,
        *,
        workers: int = 0,
        emulate: float | None = None,
        serve: bool = False,
        on_ready: Callable[[Any], None] | None = None,
        resume: bool = False,
        progress: bool = False,
    ) -> dict[str, Any]:
        """Train for learner.steps and return the summary (also in RUN_DIR/summary.json).

        `workers`: start K worker processes on loopback (0: learner and rollout take turns in this
        process); `emulate`: those workers run no model and yield this many trajectories/s each;
        `serve`: train on what remote workers push to this learner's coordinator (`echo2 learner`),
        `on_ready(source)` is called once it listens; `resume`: continue the checkpoint in run_dir.
        The scheduler's local provider (scheduler.provider = "local") starts its own workers."""
        if self._run_dir is None and not resume:  # runs never collide: runs/NAME-seedN, then -2, -3...
            from echo2.preflight import fresh_run_dir

            self._run_dir = fresh_run_dir(self.config)
        config, run_dir = self.config, self.run_dir
        if workers < 0:
            raise ConfigError("--workers: must be >= 0")
        if resume:
            from echo2.learning.checkpoint import checkpoint_dir

            checkpoint_dir(run_dir)
        elif (run_dir / "checkpoint").exists():
            raise ConfigError(f"{run_dir}: already holds a run; use --resume {run_dir} or another run.dir")
        from echo2.learning.device import check_start
        from echo2.learning.loop import run as train  # heavy: torch, transformers
        from echo2.learning.sources import SourceSpec
        from echo2.rollout.vllm_engine import check_available

        check_start(config.learner, resume=resume)  # learner.device/dtype, torchrun
        check_available(config.rollout)  # rollout.engine = vllm needs vllm installed
        fleet = None
        if config.scheduler.provider == "local":
            fleet = _local_provider(config, workers=workers, emulate=emulate, serve=serve)
        elif config.scheduler.provider == "skypilot":
            from echo2.fleet.providers.skypilot.provider import make_fleet

            if not serve or workers or emulate:
                raise ConfigError(
                    "scheduler.provider = skypilot: use `echo2 learner` (rented workers dial in)"
                )
            fleet = make_fleet(config, initial=config.scheduler.initial_workers)
        elif workers:
            from echo2.fleet.providers.local import LocalFleet

            fleet = LocalFleet.identical(workers, threads=config.run.threads, emulate=emulate)
        if fleet:
            config = config.model_copy(
                update={"run": config.run.model_copy(update={"threads": fleet.learner_threads})}
            )
            spec = SourceSpec(fleet=fleet, on_ready=on_ready)
        elif serve:
            spec = SourceSpec(remote=True, on_ready=on_ready)
        else:
            spec = SourceSpec()
        try:
            self.summary = train(config, run_dir=run_dir, resume=resume, progress=progress, source_spec=spec)
        finally:
            if fleet:
                fleet.stop()
        if config.scheduler.provider == "skypilot":  # the bill, teardowns included
            self.summary.update(fleet.metrics())
            (run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))
        return self.summary

    # ------------------------------------------------------------------ reading
    def metrics(self) -> list[dict[str, Any]]:
        """One dict per learner step (RUN_DIR/metrics.jsonl): reward, loss, KL, staleness, times,
        and for environment tasks episode/malformed_frac, episode/outcome_mean, ..."""
        from echo2.metrics import read_metrics

        path = self.run_dir / "metrics.jsonl"
        return read_metrics(path) if path.exists() else []

    def read_summary(self) -> dict[str, Any] | None:
        """RUN_DIR/summary.json (held-out evaluation before and after, rejections, timings)."""
        path = self.run_dir / "summary.json"
        return json.loads(path.read_text()) if path.exists() else None


def _local_provider(config: Config, *, workers: int, emulate: float | None, serve: bool):
    """The `local` provider's slots: one per worker of each type in scheduler.pool."""
    from echo2.fleet.providers.local import LocalFleet
    from echo2.fleet.selection import WorkerOffer
    from echo2.planning.plan import load_pool

    if serve or workers or emulate:
        raise ConfigError(
            "scheduler.provider = local: use `echo2 run` without --workers/--emulate "
            "(the pool file lists the workers; scheduler.emulate emulates them)"
        )
    path = Path(config.scheduler.pool).expanduser()
    if not path.is_file():
        raise ConfigError(f"scheduler.pool: no such file {path}")
    pool = load_pool(path)
    offers = [
        WorkerOffer(name=f"{w.name}-{i}", throughput=w.throughput, price=w.price)
        for w in pool.workers
        for i in range(w.count)
    ]
    return LocalFleet(
        offers,
        initial=config.scheduler.initial_workers,
        threads=config.run.threads,
        emulate=config.scheduler.emulate,
    )
