"""rollout.engine: validation, and the factory choosing the engine (the vLLM side is in
tests/e2e/test_vllm_engine.py, which needs vllm installed)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from support import TINY

from echo2.cli import main
from echo2.config import Config, ConfigError, RolloutConfig, TinyModelConfig
from echo2.learning.engine import learner_engine
from echo2.rollout.engine import HFEngine
from echo2.rollout.vllm_engine import VLLMEngine


def test_unknown_engine_exits_2_naming_the_key(capsys):
    assert main(["run", TINY, "--rollout.engine=sglang", "--dry-run"]) == 2
    assert "rollout.engine" in capsys.readouterr().err


def test_default_engine_is_hf(tiny):
    model, tok = tiny
    cfg = RolloutConfig()
    assert cfg.engine == "hf"
    config = Config(model=TinyModelConfig(), rollout=cfg, learner={"device": "cpu"})
    engine = learner_engine(config, model=model, tokenizer=tok, version=3, device=torch.device("cpu"))
    assert isinstance(engine, HFEngine) and engine.version == 3 and engine.model is not model  # a copy


def test_vllm_engine_refuses_top_p_below_one_away_from_temperature_one(tiny):
    """vLLM's log-probs are raw (no temperature) or renormalised over the nucleus: with top_p < 1
    only T = 1 gives the learner's (rollout/vllm_args.py logprobs_mode). A worker's --engine vllm
    does not pass through the schema's check, so the engine refuses it itself."""
    _, tok = tiny
    unchecked = RolloutConfig.model_construct(
        **(RolloutConfig(temperature=0.8, sampling="multinomial").model_dump() | {"top_p": 0.9})
    )
    with pytest.raises(ConfigError, match="rollout.top_p"):
        VLLMEngine("unused", tok, unchecked)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="checks the refusal without vllm")
def test_vllm_engine_without_vllm_installed_exits_2_before_writing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["run", TINY, "--rollout.engine=vllm", f"--run.dir={run_dir}"]) == 2
    assert "rollout.engine: vllm is not installed" in capsys.readouterr().err
    assert not run_dir.exists()


def test_vllm_needs_top_p_one_unless_temperature_is_one(capsys):
    argv = [
        "run",
        TINY,
        "--rollout.engine=vllm",
        "--rollout.sampling=multinomial",
        "--rollout.top_p=0.9",
        "--dry-run",
    ]
    assert main([*argv, "--rollout.temperature=0.8"]) == 2
    assert "rollout.top_p" in capsys.readouterr().err
    assert main([*argv, "--rollout.temperature=1.0"]) == 0  # raw log-probs are the learner's at T = 1
