"""The GRPO learner loop (`echo2 run`, `echo2 learner`).

Reads top to bottom: `run` is the whole run on one screen (build a `Learner`, `step` it, `finish`);
then `Learner` in the same order: `__init__` loads and checks task, tokenizer and model (nothing is
written to the run directory before they load), evaluates and starts the rollout source from the
current weights; `step` takes whole admissible groups from the source, trains, advances the version
and tells the source (it publishes a snapshot when its rule says); `finish` evaluates again and
checkpoints. The source
(learning/sources/__init__.py) is built once by `make_source` from what the caller chose: the learner's own
engine taking turns with it, or a coordinator fed by workers. The loop does not know which, and
speaks to it only through the `RolloutSource` protocol. Rollout engines only ever see snapshots.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from echo2.config import Config, EnvTaskConfig, LearnerConfig, dump_toml
from echo2.data.buffer import ReplayBuffer
from echo2.data.tasks import make_task
from echo2.learning import build, distributed
from echo2.learning.calibrate import time_train_step
from echo2.learning.checkpoint import save_checkpoint
from echo2.learning.device import DTYPES, resolve_device, resolved, resolved_learner, snapshot_state
from echo2.learning.engine import learner_engine
from echo2.learning.export import save_merged, write_hf_files
from echo2.learning.lora import adapter_state, is_lora
from echo2.learning.sources import SourceSpec, make_source
from echo2.learning.step import train_step
from echo2.learning.verify import StepCheck
from echo2.metrics import MetricsWriter, read_metrics
from echo2.preflight import removed_on_failure
from echo2.records import Snapshot, StepReport, Trajectory
from echo2.rollout.collect import evaluate
from echo2.rollout.episodes import episode_stats
from echo2.tracking import Tracker, signal_stats

logger = logging.getLogger(__name__)


def make_snapshot(model, version: int, config: LearnerConfig) -> Snapshot:
    """An immutable copy of the learner's weights in the snapshot dtype, learner.dtype (only the
    adapter under LoRA); the learner keeps training its own. Under torchrun a gather every rank
    takes part in."""
    config = resolved_learner(config)
    if is_lora(model):
        return Snapshot(version=version, state=adapter_state(model, dtype=DTYPES[config.dtype]))
    return Snapshot(version=version, state=snapshot_state(model, config))


def evaluate_now(engine, model, version: int, task, prompts, config: Config) -> dict[str, float]:
    """Held-out accuracy of the learner's current weights during training. The engine may be the
    in-process source's: it installs the snapshot a batch needs before generating it, so evaluating
    changes no rollout."""
    if engine.version != version:
        engine.install(make_snapshot(model, version, config.learner))
    return evaluate(engine, task, prompts, batch_size=config.run.eval_batch_size)


def metrics_row(
    *,
    step: int,
    version: int,
    groups: list[list[Trajectory]],
    staleness: list[int],
    histogram: dict[int, int],
    stats: dict[str, float],
    rollout_stats: dict[str, float],
    rejected_stale: int,
    t_step: float,
    t_train: float,
) -> dict[str, float]:
    """A step's row of metrics.jsonl: rewards, `train_step`'s `stats`, staleness (the step's and
    the run's cumulative `histogram`), records the buffer evicted as stale so far, step and train
    time, the source's rollout figures and the groups' learning signal."""
    records = [r for g in groups for r in g]
    return {
        "step": step,
        "version": version,
        "reward/mean": statistics.fmean(r.reward for r in records),
        "reward/accuracy": statistics.fmean(float(r.metadata.get("correct", False)) for r in records),
        "response/tokens_mean": statistics.fmean(len(r.response_ids) for r in records),
        **episode_stats(records),  # multi-turn tasks: malformed actions, turns, outcome
        **stats,
        "staleness/mean": statistics.fmean(staleness),
        "staleness/max": float(max(staleness)),
        **{f"staleness/count_{k}": float(v) for k, v in sorted(histogram.items())},
        "buffer/rejected_stale": float(rejected_stale),
        "time/step": t_step,
        "time/train": t_train,
        "time/wall": time.time(),  # when the step ended (Unix seconds): time to accuracy, across processes
        **rollout_stats,
        **signal_stats(groups),
        "throughput/train_tokens_per_s": stats["train/tokens"] / max(t_train, 1e-9),
    }


def run(
    config: Config,
    *,
    run_dir: Path,
    resume: bool = False,
    progress: bool = True,
    source_spec: SourceSpec | None = None,
) -> dict[str, Any]:
    """Train for `learner.steps` on rollouts from the source `source_spec` names (default: the
    learner's own engine). A config mistake (task, model path, tokenizer) raises `ConfigError`
    before anything is written to `run_dir`."""
    config = resolved(config)  # learner.dtype "auto" etc. -> this machine's values, as config.toml says
    torch.set_num_threads(config.run.threads or os.cpu_count() or 1)
    # torchrun: ranks > 0 obey rank 0 and write nothing
    if distributed.start(resolve_device(config.learner)) > 0:
        return build.follow(config)
    learner = Learner(config, run_dir=run_dir, resume=resume, source_spec=source_spec or SourceSpec())
    steps = range(learner.state.step, config.learner.steps)
    bar = tqdm(steps, initial=steps.start, total=steps.stop, desc="grpo", disable=not progress, unit="step")
    try:
        for step in bar:
            row = learner.step(step)
            bar.set_postfix(reward=f"{row['reward/mean']:.2f}", loss=f"{row['train/loss']:+.3f}")
    except BaseException:
        learner.tracker.close()
        raise
    finally:
        measured = learner.stop()  # a coordinator's T_train, T_bcast, idle time, ...
    return learner.finish(measured)


class Learner:
    """One run's learner, built by `__init__` (task, tokenizer, policy and reference loaded and
    checked, then the run directory, the engine, the placed model, the buffer and the started
    rollout source), then driven by `run`: `step` per step, `stop`, `finish`."""

    def __init__(self, config: Config, *, run_dir: Path, resume: bool, source_spec: SourceSpec) -> None:
        lcfg, rcfg = config.learner, config.rollout
        self.config, self.run_dir = config, run_dir
        # how advantages are normalised: the task config's word (env tasks may say "batch"), never a record's
        self.grouping = config.task.grouping if isinstance(config.task, EnvTaskConfig) else "state"
        # ---- task, tokenizer, policy (+ LoRA), reference, a resumed checkpoint: all loaded (and so
        # checked) before run_dir is touched (learning/build.py, the same builder every rank uses)
        self.task = make_task(config.task, seed=config.run.seed)
        self.eval_prompts = self.task.eval_prompts(config.run.eval_size)
        loaded = build.load(config, resume_from=run_dir if resume else None)
        self.tokenizer, self.state = tokenizer, state = loaded.tokenizer, loaded.state
        if resume:
            logger.info("resumed %s at step %d (version %d)", run_dir, state.step, state.version)
        # ---- the run directory, the rollout source (a coordinator binds its port): a failure here
        # removes the run directory again if this start created it
        with removed_on_failure(run_dir):
            self.config_toml = dump_toml(config)
            (run_dir / "config.toml").write_text(self.config_toml)
            # the engine copies the CPU policy before it is placed (under torchrun: hf on this GPU)
            self.engine = learner_engine(
                config,
                model=loaded.model,
                tokenizer=tokenizer,
                version=state.version,
                device=resolve_device(lcfg),
            )
            if lcfg.lora is not None:  # the engine holds the base weights; a resumed adapter goes on top
                self.engine.install(make_snapshot(loaded.model, state.version, lcfg))
            placed = build.place(loaded, config)
            self.model, self.optimizer, self.ref_model = placed.model, placed.optimizer, placed.ref_model
            self.buffer = ReplayBuffer(staleness=lcfg.staleness, group_size=rcfg.group_size)
            self.buffer.set_learner_version(state.version)
            self.source = make_source(
                config,
                spec=source_spec,
                task=self.task,
                buffer=self.buffer,
                engine=self.engine,
                vocab_size=len(tokenizer),
                run_dir=run_dir,
                tokenizer=tokenizer,
                time_train_step=partial(
                    time_train_step,
                    self.model,
                    config,
                    vocab_size=len(tokenizer),
                    pad_id=tokenizer.pad_token_id,
                ),
            )
            if placed.source_state is not None:
                self.source.load_state_dict(placed.source_state)
            if state.eval_before is None and self.eval_prompts:
                state.eval_before = self.evaluate()
                logger.info("held-out accuracy before training: %.3f", state.eval_before["eval/accuracy"])
            # rollouts start from the current weights
            self.source.start(make_snapshot(self.model, state.version, lcfg))
        metrics_path = run_dir / "metrics.jsonl"
        if resume and metrics_path.exists():  # drop rows past the checkpoint, they will be redone
            kept = [r for r in read_metrics(metrics_path) if r["step"] < state.step]
            metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.metrics = MetricsWriter(metrics_path)
        self.tracker = Tracker(config, run_dir, tokenizer, resume_step=state.step if resume else None)
        self.last_eval: tuple[int, dict[str, float] | None] = (-1, None)
        """(step, held-out accuracy) of the latest evaluation."""

    def step(self, step: int) -> dict[str, float]:
        """Take whole admissible groups from the source, train on them, advance the version and
        tell the source; evaluate and checkpoint when the run's rule says. Returns the metrics row."""
        config, lcfg, rcfg, state = self.config, self.config.learner, self.config.rollout, self.state
        t0 = time.perf_counter()
        groups, staleness, rollout_stats = self.source.next_groups(rcfg.prompts_per_step)
        assert all(s <= lcfg.staleness for s in staleness), "the buffer admits only version >= v - S"
        t1 = time.perf_counter()
        checks = self.source.checks_logprobs
        order = build.train_order(groups, staleness=staleness, checks=checks, version=state.version)
        distributed.lead(distributed.Order.TRAIN, order)
        check = build.step_check(
            config, checks=checks, learner_version=state.version, eos_id=self.tokenizer.eos_token_id
        )
        stats = train_step(
            self.model,
            self.optimizer,
            groups,
            lcfg,
            pad_id=self.tokenizer.pad_token_id,
            temperature=rcfg.temperature,
            ref_model=self.ref_model,
            staleness=staleness,
            check=check,
            grouping=self.grouping,
        )
        _warn_refused(check, step)
        t2 = time.perf_counter()
        state.step = step + 1
        state.version += 1
        state.staleness.update(staleness)
        self.source.advance(
            StepReport(
                step=step,
                version=state.version,
                snapshot=partial(make_snapshot, self.model, state.version, lcfg),
                train_s=t2 - t1,
                stats=stats,
                staleness=dict(state.staleness),
                refused={
                    "logprob_mismatch": check.refused,
                    "not_sampled": check.sampling.refused if check.sampling is not None else [],
                    "non_finite_step": [r for g in groups for r in g] if check.skipped else [],
                },
            )
        )
        row = metrics_row(
            step=step,
            version=state.version,
            groups=groups,
            staleness=staleness,
            histogram=state.staleness,
            stats=stats,
            rollout_stats=rollout_stats,
            rejected_stale=self.buffer.rejected["stale"],
            t_step=t2 - t0,
            t_train=t2 - t1,
        )
        if config.run.eval_every and self.eval_prompts and state.step % config.run.eval_every == 0:
            accuracy = evaluate_now(
                self.engine, self.model, state.version, self.task, self.eval_prompts, config
            )
            self.last_eval = (state.step, accuracy)
            row |= self.last_eval[1]
        self.metrics.write(row)
        self.tracker.log_step(step, row, groups)
        if config.run.checkpoint_every and state.step % config.run.checkpoint_every == 0:
            self.save()
        return row

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy of the weights the engine holds."""
        return evaluate(self.engine, self.task, self.eval_prompts, batch_size=self.config.run.eval_batch_size)

    def save(self) -> None:
        """A checkpoint of the model, optimizer, learner state and the source's state (and, unless
        LoRA, the HF files of the model)."""
        model, tokenizer = self.model, self.tokenizer
        full_model, full_optimizer = distributed.for_checkpoint(model, self.optimizer)
        save_checkpoint(
            self.run_dir,
            model=full_model,
            optimizer=full_optimizer,
            state=self.state,
            source_state=self.source.state_dict(),
            config_toml=self.config_toml,
            extra=None if is_lora(model) else lambda d: write_hf_files(model, tokenizer, d),
        )

    def stop(self) -> dict[str, Any]:
        """Close the metrics file and the source; returns what the source measured."""
        self.metrics.close()
        return self.source.close()

    def finish(self, measured: dict[str, Any]) -> dict[str, Any]:
        """The final evaluation and checkpoint, the run's summary.json (with the source's `measured`
        figures); returns the summary."""
        state, model = self.state, self.model
        self.engine.install(make_snapshot(model, state.version, self.config.learner))
        if self.last_eval[0] == state.step:  # the last step was just evaluated: greedy, so the same result
            eval_after = self.last_eval[1]
        else:
            eval_after = self.evaluate() if self.eval_prompts else None
        self.save()
        if is_lora(model):  # the checkpoint holds the peft-wrapped policy; hf/ the merged model
            save_merged(model, self.tokenizer, self.run_dir / "hf")
        distributed.stop()
        summary = {
            "steps": state.step,
            "version": state.version,
            "eval_before": state.eval_before,
            "eval_after": eval_after,
            "rejected": dict(self.buffer.rejected),
            "staleness_histogram": state.to_json()["staleness_histogram"],  # the learner's: survives a resume
            **measured,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.tracker.close(summary)
        if eval_after:
            logger.info(
                "held-out accuracy: before %.3f, after %.3f",
                (state.eval_before or {}).get("eval/accuracy", float("nan")),
                eval_after["eval/accuracy"],
            )
        return summary


def _warn_refused(check: StepCheck, step: int) -> None:
    """A step's records left out, or the step not applied, as warnings."""
    if check.refused:
        logger.warning("%d records left out of step %d: log-probs disagree", len(check.refused), step)
    if check.sampling is not None and check.sampling.refused:
        logger.warning("%d records left out of step %d: not sampled", len(check.sampling.refused), step)
    if check.sampling is not None and check.sampling.doubtful:
        logger.info(
            "%d records left out of step %d without a strike: a sampling margin over the tolerance, "
            "under the strike margin",
            len(check.sampling.doubtful),
            step,
        )
    if check.skipped:
        logger.warning("step %d not applied: loss or gradient not finite", step)
