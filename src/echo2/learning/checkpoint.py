"""Checkpoints: model (safetensors), optimizer, the learner's state, the rollout source's state and
the resolved config.

Owns `LearnerState`, the loop's mutable counters, and the on-disk layout of RUN_DIR/checkpoint. A
checkpoint records what was consumed (prompt cursor, buffered records, version), not only the model,
so a resumed run neither repeats nor loses accepted records. Knows nothing of what the source's
state means. A save is written to checkpoint.tmp and swapped in by two renames; a crash between
them leaves checkpoint.old, which `checkpoint_dir` falls back to, so some complete checkpoint is
always on disk once one was saved.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from echo2.config import ConfigError


@dataclass(slots=True, kw_only=True)
class LearnerState:
    """What the learner loop changes as it runs; saved with every checkpoint."""

    step: int = 0
    """Learner steps done, each one optimizer step."""
    version: int = 0
    """Policy version: +1 per step; snapshots carry it, records carry the version they came from."""
    eval_before: dict[str, float] | None = None
    """Held-out metrics before the first step (kept across resumes)."""
    staleness: Counter[int] = field(default_factory=Counter)
    """Consumed records by staleness k (learner version - record version), cumulative over the run."""

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "version": self.version,
            "eval_before": self.eval_before,
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LearnerState:
        hist = data.get("staleness_histogram", {})  # absent in checkpoints written before it was kept
        return cls(
            step=data["step"],
            version=data["version"],
            eval_before=data["eval_before"],
            staleness=Counter({int(k): v for k, v in hist.items()}),
        )


def save_checkpoint(
    run_dir: Path,
    *,
    model,
    optimizer,
    state: LearnerState,
    source_state: dict[str, Any],
    config_toml: str,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """`extra(dir)` adds files to the new checkpoint before it is swapped in (the Hugging Face
    config and tokenizer files that make a full model's checkpoint loadable by from_pretrained)."""
    final = run_dir / "checkpoint"
    tmp = run_dir / "checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))
    if extra is not None:
        extra(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({**state.to_json(), "source": source_state}))
    (tmp / "config.toml").write_text(config_toml)
    old = run_dir / "checkpoint.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_dir(run_dir: Path) -> Path:
    """The checkpoint to resume from: checkpoint/, or checkpoint.old/ after a crash mid-swap."""
    for name in ("checkpoint", "checkpoint.old"):
        if (run_dir / name / "state.json").is_file():
            return run_dir / name
    raise ConfigError(
        f"{run_dir}: no checkpoint to resume from (expected {run_dir / 'checkpoint'}/state.json)"
    )


def load_checkpoint(run_dir: Path, *, model, optimizer) -> tuple[LearnerState, dict[str, Any]]:
    """Restore model and optimizer in place; return the learner's state and the source's state."""
    ckpt = checkpoint_dir(run_dir)
    load_model(model, str(ckpt / "model.safetensors"))
    optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
    data = json.loads((ckpt / "state.json").read_text())
    return LearnerState.from_json(data), data["source"]
