"""Experiment tracking beside metrics.jsonl: TensorBoard and Weights & Biases (`run.report_to`),
and a sample of each step's completions in RUN_DIR/samples.jsonl.

Owns what leaves the learner for a human to read: every step's scalars go to each tracker, and
`run.samples_per_step` completions (prompt, completion text, reward, version, worker) go to
samples.jsonl and to each tracker as a table. Through the libraries themselves: TensorBoard event
files in RUN_DIR/tensorboard (torch.utils.tensorboard, needs the `tensorboard` package), a W&B run
in RUN_DIR/wandb (offline unless WANDB_MODE says otherwise or an API key is configured; `wandb sync`
uploads it later). Both are the optional extra `track`; asking for one that is not installed is a
`ConfigError` naming `run.report_to`, raised before the run directory is written. Also warns when
no group has had any reward variance for `WARN_AFTER` steps in a row (GRPO then has no gradient).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from echo2.config import Config, ConfigError
from echo2.records import Trajectory

logger = logging.getLogger(__name__)

WARN_AFTER = 5
"""Steps without reward variance in a row before the first warning: one such step is normal (every
sampled answer of a step right, or all wrong, happens late or early in a healthy run); a run stuck
there for several steps is not."""
WARN_EVERY = 25
"""Steps without reward variance in a row between two warnings, after the first."""

SAMPLE_COLUMNS = ("step", "prompt", "completion", "reward", "version", "worker")

_PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_trackers(report_to: list[str]) -> None:
    """Every tracker named in run.report_to is installed (pip install 'echo2[track]')."""
    for name in report_to:
        if importlib.util.find_spec(_PACKAGE[name]) is None:
            raise ConfigError(
                f"run.report_to: {name!r} needs the {_PACKAGE[name]} package (pip install 'echo2[track]')"
            )


def signal_stats(groups: list[list[Trajectory]]) -> dict[str, float]:
    """Share of a step's groups whose rewards are all equal: their GRPO advantages are all zero."""
    flat = sum(1 for g in groups if len({r.reward for r in g}) <= 1)
    return {"reward/zero_std_fraction": flat / len(groups) if groups else 0.0}


def pick_samples(groups: list[list[Trajectory]], count: int) -> list[Trajectory]:
    """`count` records spread over the groups: the first sample of each group, then the second..."""
    out: list[Trajectory] = []
    for i in range(max((len(g) for g in groups), default=0)):
        for g in groups:
            if len(out) >= count:
                return out
            if i < len(g):
                out.append(g[i])
    return out


def _wandb_mode() -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = Path.home() / ".netrc"
    logged_in = os.environ.get("WANDB_API_KEY") or (netrc.is_file() and "api.wandb.ai" in netrc.read_text())
    return "online" if logged_in else "offline"


class Tracker:
    """Per-step scalars and samples to samples.jsonl and the trackers of `run.report_to`."""

    def __init__(self, config: Config, run_dir: Path, tokenizer, *, resume_step: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.count = config.run.samples_per_step
        self.samples_path = run_dir / "samples.jsonl"
        if resume_step is not None and self.samples_path.exists():  # rows past the checkpoint are redone
            kept = [
                line
                for line in self.samples_path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] < resume_step
            ]
            self.samples_path.write_text("".join(line + "\n" for line in kept))
        self._samples = self.samples_path.open("a")
        self.tb = self.wandb = None
        self._flat_steps = 0
        if "tensorboard" in config.run.report_to:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if "wandb" in config.run.report_to:
            import wandb

            mode = _wandb_mode()
            self.wandb = wandb.init(
                project=config.run.wandb_project,
                name=run_dir.name,
                dir=str(run_dir),
                config=config.model_dump(mode="json"),
                mode=mode,
            )
            logger.info("wandb: %s run in %s", mode, self.wandb.dir)

    def log_step(self, step: int, row: dict[str, Any], groups: list[list[Trajectory]]) -> None:
        flat = row.get("reward/zero_std_fraction") == 1.0
        self._flat_steps = self._flat_steps + 1 if flat else 0
        if flat and self._flat_steps >= WARN_AFTER and (self._flat_steps - WARN_AFTER) % WARN_EVERY == 0:
            logger.warning(
                "step %d: every group's rewards are equal (mean %.3f), so GRPO has no gradient "
                "(%d step(s) in a row); a task with more varied rewards, larger groups or a higher "
                "temperature would help",
                step,
                row.get("reward/mean", float("nan")),
                self._flat_steps,
            )
        scalars = {k: float(v) for k, v in row.items() if isinstance(v, int | float) and math.isfinite(v)}
        samples = [self._sample(step, r) for r in pick_samples(groups, self.count)]
        for s in samples:
            self._samples.write(json.dumps(s) + "\n")
        self._samples.flush()
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
            if samples:
                self.tb.add_text("samples", _markdown(samples), step)
            self.tb.flush()
        if self.wandb is not None:
            import wandb

            payload: dict[str, Any] = dict(scalars)
            if samples:
                payload["samples"] = wandb.Table(
                    columns=list(SAMPLE_COLUMNS), data=[[s[c] for c in SAMPLE_COLUMNS] for s in samples]
                )
            self.wandb.log(payload, step=step)

    def _sample(self, step: int, record: Trajectory) -> dict[str, Any]:
        decode = self.tokenizer.decode
        return {
            "step": step,
            "prompt": decode(list(record.prompt_ids), skip_special_tokens=True),
            "completion": decode(list(record.response_ids), skip_special_tokens=True),
            "reward": record.reward,
            "version": record.version,
            "worker": str(record.metadata.get("worker", "learner")),
        }

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Idempotent; `summary`'s numbers (and held-out accuracy) go to the W&B run's summary."""
        if self._samples.closed:
            return
        self._samples.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            for key, value in _flat(summary or {}).items():
                self.wandb.summary[key] = value
            self.wandb.finish()


def _markdown(samples: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", " ")

    head = "| " + " | ".join(SAMPLE_COLUMNS) + " |\n|" + "---|" * len(SAMPLE_COLUMNS) + "\n"
    return head + "".join("| " + " | ".join(cell(s[c]) for c in SAMPLE_COLUMNS) + " |\n" for s in samples)


def _flat(summary: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}/")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[prefix + key] = value
    return out
