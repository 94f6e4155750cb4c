"""FSDP2 over NCCL on two GPUs: `torchrun --standalone --nproc-per-node 2 -m echo2.cli run` of the
tiny model with a bf16 learner on cuda (rank i on cuda:i) trains two finite steps and rank 0
writes the full checkpoint. The same run on two CPU processes (gloo) is tests/e2e/test_fsdp.py.
Skipped with its reason where fewer than two GPUs are visible."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TINY = Path(__file__).parents[2] / "configs" / "tiny.toml"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP2 over NCCL needs 2 GPUs"),
]


def test_two_gpu_ranks_train_over_nccl(tmp_path):
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "echo2.cli", "run", str(TINY), f"--run.dir={run_dir}", "--run.eval_size=4"]
    cmd += ["--learner.steps=2", "--learner.device=cuda", "--learner.dtype=bf16", "-q"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0,1"),
    }
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["train/loss"]) for r in rows)
    saved = load_file(run_dir / "checkpoint" / "model.safetensors")
    assert "model.embed_tokens.weight" in saved and all(v.dtype == torch.float32 for v in saved.values())
