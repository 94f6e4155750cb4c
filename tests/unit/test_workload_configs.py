"""configs/qwen3-{4b,8b}-math.toml, the paper's workload (ECHO-2 5.1): `echo2 run CONFIG --dry-run`
validates them (exit 0), they hold the paper's settings, and their task reads the DAPO-shaped sample
file through the nested mapping."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from echo2.cli import main
from echo2.config import load_config
from echo2.config.files import build_config
from echo2.data.tasks import make_task

CONFIGS = Path(__file__).parents[2] / "configs"


@pytest.mark.parametrize("size", ["4b", "8b"])
def test_the_paper_workload_configs_validate_with_the_papers_settings(size, tmp_path, capsys):
    path = CONFIGS / f"qwen3-{size}-math.toml"
    assert main(["run", str(path), "--dry-run", f"--run.dir={tmp_path / 'run'}"]) == 0
    config = build_config(tomllib.loads(capsys.readouterr().out))
    model, task, rollout, learner = config.model, config.task, config.rollout, config.learner
    assert model.type == "hf" and model.path == f"~/models/Qwen3-{size.upper()}"  # local, never the hub
    assert model.chat_template_kwargs == {"enable_thinking": False}  # chain of thought off
    assert task.type == "math" and task.messages_field == "prompt"
    assert task.answer_field == "reward_model.ground_truth" and task.system_prompt == ""
    assert Path(task.train_file) == CONFIGS / "data" / "dapo-math-sample.jsonl"
    assert rollout.engine == "vllm"
    assert (rollout.prompts_per_step, rollout.group_size) == (128, 16)  # global batch 128, n = 16
    assert (rollout.max_new_tokens, rollout.max_prompt_tokens) == (8192, 1024)
    assert (rollout.temperature, rollout.top_p) == (1.0, 0.95)
    assert (learner.staleness, learner.publish_every) == (3, 2)  # S = 3, kappa = S - 1
    assert learner.correction == "clip" and learner.kl_beta == 0
    assert (learner.device, learner.dtype, learner.gradient_checkpointing) == ("cuda", "bf16", True)
    assert learner.micro_batch_tokens == 16384 >= rollout.max_prompt_tokens + rollout.max_new_tokens


def test_their_task_reads_the_dapo_shaped_rows():
    config = load_config(CONFIGS / "qwen3-4b-math.toml")
    task = make_task(config.task, seed=config.run.seed)
    prompts = [task.train_prompt(i) for i in range(len(task.train_rows))] + task.eval_prompts(100)
    assert len(prompts) == 12
    for p in prompts:
        (message,) = p.messages  # DAPO's one user message, no system prompt added
        assert message["role"] == "user" and 'own line after "Answer:"' in message["content"]
        assert task.score(p, f"Answer: {p.answer}").correct


def test_without_the_downloaded_model_a_run_stops_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/models/Qwen3-4B here
    run_dir = tmp_path / "run"
    assert main(["run", str(CONFIGS / "qwen3-4b-math.toml"), f"--run.dir={run_dir}", "-q"]) == 2
    assert f"model.path: {tmp_path}/models/Qwen3-4B: no such directory" in capsys.readouterr().err
    assert not run_dir.exists(), "nothing starts"
