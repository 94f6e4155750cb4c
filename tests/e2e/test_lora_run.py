"""`echo2 run --learner.lora.rank=8` end to end on the tiny model: only the adapter trains, the engine
follows it exactly (ratio 1 every step), the run resumes, and a missing target exits 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from support import TINY

from echo2.cli import main
from echo2.config import TinyModelConfig
from echo2.metrics import read_metrics
from echo2.models import load_model, load_tokenizer

TOY = ["--task.type=custom", "--task.factory=toy_task:Vowels"]  # rewards that vary on a random model


def base_name(peft_key: str) -> str:
    return peft_key.removeprefix("base_model.model.").replace(".base_layer.", ".")


def test_three_step_lora_run_trains_only_the_adapter(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    run_dir = tmp_path / "lora"
    args = ["run", TINY, f"--run.dir={run_dir}", *TOY, "--learner.lora.rank=8", "--learner.lr=1e-2", "-q"]
    assert main(args) == 0
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    # records of every step came from the engine's merged adapter; the learner's peft forward agrees
    assert all(abs(r["train/ratio_mean"] - 1) < 1e-3 for r in rows), [r["train/ratio_mean"] for r in rows]

    saved = load_file(run_dir / "checkpoint" / "model.safetensors")
    tok = load_tokenizer(TinyModelConfig())
    base = load_model(TinyModelConfig(), vocab_size=len(tok), seed=0).state_dict()
    adapter = {k: v for k, v in saved.items() if ".lora_" in k}
    frozen = {base_name(k): v for k, v in saved.items() if ".lora_" not in k}
    assert len(adapter) == 2 * 7 * 2 and frozen and frozen.keys() <= base.keys()
    assert all(torch.equal(v, base[k]) for k, v in frozen.items()), "base weights changed"
    assert all(v.abs().sum() > 0 for k, v in adapter.items() if ".lora_B." in k), "B left at zero"

    assert main(["run", "--resume", str(run_dir), "--learner.steps=4", "-q"]) == 0
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert abs(rows[-1]["train/ratio_mean"] - 1) < 1e-3, "the resumed engine carries the adapter"
    assert json.loads((run_dir / "summary.json").read_text())["version"] == 4


def test_lora_run_over_a_worker_process(tmp_path, monkeypatch):
    """The adapter snapshot crosses the broadcast as bytes; the worker merges it into the base it
    loaded, so its behaviour log-probs equal the learner's (ratio 1 at S = 0, every step)."""
    here = Path(__file__).parent
    monkeypatch.syspath_prepend(str(here))
    monkeypatch.setenv("PYTHONPATH", str(here) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run_dir = tmp_path / "remote"
    args = [*TOY, "--learner.lora.rank=8", "--learner.lr=1e-2", "--run.eval_size=0", "--run.threads=1", "-q"]
    assert main(["run", TINY, f"--run.dir={run_dir}", "--workers=1", *args]) == 0
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) == 3 and all(r["staleness/max"] == 0 for r in rows)
    assert all(abs(r["train/ratio_mean"] - 1) < 1e-3 for r in rows), [r["train/ratio_mean"] for r in rows]


def test_a_target_module_that_does_not_exist_exits_2(tmp_path, capsys):
    args = ["run", TINY, f"--run.dir={tmp_path / 'bad'}", "--learner.lora.target_modules=['qkv_proj']", "-q"]
    assert main(args) == 2
    assert "learner.lora.target_modules: 'qkv_proj' names no module" in capsys.readouterr().err
