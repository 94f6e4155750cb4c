"""Checkpoints: model (safetensors), optimizer, counters, buffer contents and the resolved config.

A checkpoint records what was consumed (prompt cursor, buffered records, version), not only the
model, so a resumed run neither repeats nor loses accepted records. Written to a temporary directory
and renamed, so a crash mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from echo2.config import ConfigError


def save_checkpoint(run_dir: Path, *, model, optimizer, state: dict[str, Any], config_toml: str) -> Path:
    final = run_dir / "checkpoint"
    tmp = run_dir / "checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(state))
    (tmp / "config.toml").write_text(config_toml)
    old = run_dir / "checkpoint.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_dir(run_dir: Path) -> Path:
    ckpt = run_dir / "checkpoint"
    if not (ckpt / "state.json").is_file():
        raise ConfigError(f"{run_dir}: no checkpoint to resume from (expected {ckpt}/state.json)")
    return ckpt


def load_checkpoint(run_dir: Path, *, model, optimizer) -> dict[str, Any]:
    ckpt = checkpoint_dir(run_dir)
    load_model(model, str(ckpt / "model.safetensors"))
    optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
    return json.loads((ckpt / "state.json").read_text())
