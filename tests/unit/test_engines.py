"""Engines on a device in a dtype (HFEngine's placement, the learner's and a worker's engine from
echo2.rollout.engines), checked on the CPU through the meta device and bf16."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from echo2.config import Config, LearnerConfig, RolloutConfig, TinyModelConfig
from echo2.rollout.engine import HFEngine
from echo2.rollout.engines import engine_dtype, hf_dtype, learner_engine


class _Handed(Exception):
    """Raised by a stand-in `generate` once it has seen its inputs."""


def _capture_generate(engine) -> dict:
    seen: dict = {}

    def generate(**kwargs):
        seen.update(kwargs)
        raise _Handed

    engine.model.generate = generate
    return seen


def test_hf_engine_moves_its_model_and_builds_inputs_on_its_device(tiny, rollout_cfg):
    model, tok = tiny
    engine = HFEngine(copy.deepcopy(model), tok, rollout_cfg, device="meta", dtype=torch.bfloat16)
    params = list(engine.model.parameters())
    assert {p.device.type for p in params} == {"meta"} and {p.dtype for p in params} == {torch.bfloat16}
    seen = _capture_generate(engine)
    with pytest.raises(_Handed):
        engine.generate_ids([[1, 2, 3], [4, 5]], n=1)
    assert seen["input_ids"].device.type == "meta" and seen["attention_mask"].device.type == "meta"


def test_hf_engine_in_bf16_returns_cpu_float_logprobs(tiny, rollout_cfg):
    model, tok = tiny
    engine = HFEngine(copy.deepcopy(model), tok, rollout_cfg, device="cpu", dtype=torch.bfloat16)
    torch.manual_seed(0)
    (group,) = engine.generate_ids([[1, 2, 3]], n=2)
    for sample in group:
        assert len(sample.logprobs) == len(sample.response_ids) > 0
        assert all(type(x) is float and x <= 0 for x in sample.logprobs)


def test_hf_engine_without_device_keeps_the_model_where_it_is(tiny, rollout_cfg):
    model, tok = tiny
    own = copy.deepcopy(model)
    engine = HFEngine(own, tok, rollout_cfg)
    assert engine.model is own and engine.device == torch.device("cpu")
    assert next(own.parameters()).dtype == torch.float32


def test_engine_dtype_is_the_snapshot_dtype_and_hf_keeps_fp32_on_the_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert engine_dtype(LearnerConfig(dtype="bf16"), cuda) == torch.bfloat16
    assert engine_dtype(LearnerConfig(dtype="fp32"), cuda) == torch.float32
    assert engine_dtype(LearnerConfig(dtype="bf16"), cpu) == torch.bfloat16  # vLLM on CPU: as before
    assert hf_dtype(LearnerConfig(dtype="bf16"), cuda) == torch.bfloat16
    assert hf_dtype(LearnerConfig(dtype="bf16"), cpu) == torch.float32


def _tiny_config(**rollout) -> Config:
    return Config(model=TinyModelConfig(), rollout=RolloutConfig(max_new_tokens=4, **rollout))


def test_learner_engine_is_an_hf_engine_on_the_learners_device(tiny):
    model, tok = tiny
    engine = learner_engine(
        _tiny_config(), model=model, tokenizer=tok, version=2, device=torch.device("meta")
    )
    assert isinstance(engine, HFEngine) and engine.version == 2
    assert engine.model is not model, "a copy: the learner's policy stays as it was"
    assert {p.device.type for p in engine.model.parameters()} == {"meta"}
    assert next(model.parameters()).device.type == "cpu"


def test_learner_engine_never_builds_vllm_under_torchrun(tiny, monkeypatch, caplog):
    """B2: an in-process vLLM on rank 0 would join echo2's NCCL world and hang; the learner
    evaluates with the HF engine on its own device instead, and says why."""
    model, tok = tiny
    monkeypatch.setenv("WORLD_SIZE", "2")

    def no_vllm(*args, **kwargs):
        raise AssertionError("vLLM built under torchrun")

    monkeypatch.setattr("echo2.rollout.vllm_engine.VLLMEngine", no_vllm)
    with caplog.at_level(logging.WARNING, logger="echo2.rollout.engines"):
        engine = learner_engine(
            _tiny_config(engine="vllm"), model=model, tokenizer=tok, version=0, device=torch.device("cpu")
        )
    assert isinstance(engine, HFEngine)
    assert "torchrun" in caplog.text and "hang" in caplog.text
