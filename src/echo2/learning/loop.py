"""The GRPO learner loop (`echo2 run`, `echo2 learner`).

Reads top to bottom: load and check task, tokenizer and model (nothing is written to the run
directory before they load); evaluate; start the rollout source from the current weights; then per
step take whole admissible groups from the source, train, advance the version and tell the source
(it publishes a snapshot when its rule says); evaluate again and checkpoint. The source
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
from echo2.learning.verify import StepCheck, sampling_check
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
    lcfg, rcfg = config.learner, config.rollout
    # how advantages are normalised: the task config's word (env tasks may say "batch"), never a record's
    grouping = config.task.grouping if isinstance(config.task, EnvTaskConfig) else "state"
    if distributed.start(resolve_device(lcfg)) > 0:  # torchrun: ranks > 0 obey rank 0, write nothing
        return build.follow(config)

    # ---- task, tokenizer, policy (+ LoRA), reference, a resumed checkpoint: all loaded (and so
    # checked) before run_dir is touched (learning/build.py, the same builder every rank uses)
    task = make_task(config.task, seed=config.run.seed)
    eval_prompts = task.eval_prompts(config.run.eval_size)
    learner = build.load(config, resume_from=run_dir if resume else None)
    tokenizer, state = learner.tokenizer, learner.state
    if resume:
        logger.info("resumed %s at step %d (version %d)", run_dir, state.step, state.version)
    # ---- the run directory, the rollout source (a coordinator binds its port): a failure here
    # removes the run directory again if this start created it
    with removed_on_failure(run_dir):
        config_toml = dump_toml(config)
        (run_dir / "config.toml").write_text(config_toml)

        # the engine copies the CPU policy before it is placed (under torchrun: hf on this GPU)
        engine = learner_engine(
            config,
            model=learner.model,
            tokenizer=tokenizer,
            version=state.version,
            device=resolve_device(lcfg),
        )
        if lcfg.lora is not None:  # the engine holds the base weights; a resumed adapter goes on top
            engine.install(make_snapshot(learner.model, state.version, lcfg))
        learner = build.place(learner, config)
        model, optimizer, ref_model = learner.model, learner.optimizer, learner.ref_model
        buffer = ReplayBuffer(staleness=lcfg.staleness, group_size=rcfg.group_size)
        buffer.set_learner_version(state.version)
        source = make_source(
            config,
            spec=source_spec or SourceSpec(),
            task=task,
            buffer=buffer,
            engine=engine,
            vocab_size=len(tokenizer),
            run_dir=run_dir,
            tokenizer=tokenizer,
            time_train_step=partial(
                time_train_step, model, config, vocab_size=len(tokenizer), pad_id=tokenizer.pad_token_id
            ),
        )
        if learner.source_state is not None:
            source.load_state_dict(learner.source_state)
        if state.eval_before is None and eval_prompts:
            state.eval_before = evaluate(engine, task, eval_prompts, batch_size=config.run.eval_batch_size)
            logger.info("held-out accuracy before training: %.3f", state.eval_before["eval/accuracy"])
        source.start(make_snapshot(model, state.version, lcfg))  # rollouts start from the current weights

    metrics_path = run_dir / "metrics.jsonl"
    if resume and metrics_path.exists():  # drop rows past the checkpoint, they will be redone
        kept = [r for r in read_metrics(metrics_path) if r["step"] < state.step]
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    metrics = MetricsWriter(metrics_path)
    tracker = Tracker(config, run_dir, tokenizer, resume_step=state.step if resume else None)

    def save() -> None:
        full_model, full_optimizer = distributed.for_checkpoint(model, optimizer)
        save_checkpoint(
            run_dir,
            model=full_model,
            optimizer=full_optimizer,
            state=state,
            source_state=source.state_dict(),
            config_toml=config_toml,
            extra=None if is_lora(model) else lambda d: write_hf_files(model, tokenizer, d),
        )

    last_eval: tuple[int, dict[str, float] | None] = (-1, None)  # (step, held-out accuracy) of the latest
    try:
        # ---- the loop
        bar = tqdm(
            range(state.step, lcfg.steps),
            initial=state.step,
            total=lcfg.steps,
            desc="grpo",
            disable=not progress,
            unit="step",
        )
        for step in bar:
            t0 = time.perf_counter()
            groups, staleness, rollout_stats = source.next_groups(rcfg.prompts_per_step)
            assert all(s <= lcfg.staleness for s in staleness), "the buffer admits only version >= v - S"
            records = [r for g in groups for r in g]
            t1 = time.perf_counter()
            distributed.lead(distributed.Order.TRAIN, groups)
            check = StepCheck(
                max_logratio=lcfg.max_logratio if source.checks_logprobs else None,
                learner_version=state.version,
                sampling=sampling_check(
                    rcfg, is_env=isinstance(config.task, EnvTaskConfig), eos_id=tokenizer.eos_token_id
                )
                if source.checks_logprobs
                else None,  # a fresh one each step
            )
            stats = train_step(
                model,
                optimizer,
                groups,
                lcfg,
                pad_id=tokenizer.pad_token_id,
                temperature=rcfg.temperature,
                ref_model=ref_model,
                staleness=staleness,
                check=check,
                grouping=grouping,
            )
            if check.refused:
                logger.warning("%d records left out of step %d: log-probs disagree", len(check.refused), step)
            if check.sampling is not None and check.sampling.refused:
                logger.warning("%d records left out of step %d: not sampled", len(check.sampling.refused), step)
            if check.skipped:
                logger.warning("step %d not applied: loss or gradient not finite", step)
            t2 = time.perf_counter()
            state.step = step + 1
            state.version += 1
            state.staleness.update(staleness)
            source.advance(
                StepReport(
                    step=step,
                    version=state.version,
                    snapshot=partial(make_snapshot, model, state.version, lcfg),
                    train_s=t2 - t1,
                    stats=stats,
                    staleness=dict(state.staleness),
                    refused={
                        "logprob_mismatch": check.refused,
                        "not_sampled": check.sampling.refused if check.sampling is not None else [],
                        "non_finite_step": records if check.skipped else [],
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
                rejected_stale=buffer.rejected["stale"],
                t_step=t2 - t0,
                t_train=t2 - t1,
            )
            if config.run.eval_every and eval_prompts and state.step % config.run.eval_every == 0:
                last_eval = (state.step, evaluate_now(engine, model, state.version, task, eval_prompts, config))
                row |= last_eval[1]
            metrics.write(row)
            tracker.log_step(step, row, groups)
            bar.set_postfix(reward=f"{row['reward/mean']:.2f}", loss=f"{row['train/loss']:+.3f}")
            if config.run.checkpoint_every and state.step % config.run.checkpoint_every == 0:
                save()
    except BaseException:
        tracker.close()
        raise
    finally:
        metrics.close()
        measured = source.close()  # a coordinator's T_train, T_bcast, idle time, ...

    # ---- final evaluation and checkpoint
    engine.install(make_snapshot(model, state.version, lcfg))
    if last_eval[0] == state.step:  # the last step was just evaluated: greedy, so the same result
        eval_after = last_eval[1]
    else:
        eval_after = (
            evaluate(engine, task, eval_prompts, batch_size=config.run.eval_batch_size) if eval_prompts else None
        )
    save()
    if is_lora(model):  # the checkpoint holds the peft-wrapped policy; hf/ the merged model
        save_merged(model, tokenizer, run_dir / "hf")
    distributed.stop()
    summary = {
        "steps": state.step,
        "version": state.version,
        "eval_before": state.eval_before,
        "eval_after": eval_after,
        "rejected": dict(buffer.rejected),
        "staleness_histogram": state.to_json()["staleness_histogram"],  # the learner's: survives a resume
        **measured,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    tracker.close(summary)
    if eval_after:
        logger.info(
            "held-out accuracy: before %.3f, after %.3f",
            (state.eval_before or {}).get("eval/accuracy", float("nan")),
            eval_after["eval/accuracy"],
        )
    return summary
