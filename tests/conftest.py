from __future__ import annotations

import pytest
import torch

from echo2.config import RolloutConfig, TinyModelConfig


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the tiny random Llama; the tokenizer is SmolLM2's, from the GGUF."""
    from echo2.models import load_model, load_tokenizer

    torch.set_num_threads(2)
    cfg = TinyModelConfig()
    tok = load_tokenizer(cfg)
    return load_model(cfg, vocab_size=len(tok), seed=0), tok


@pytest.fixture
def rollout_cfg() -> RolloutConfig:
    return RolloutConfig(prompts_per_step=2, group_size=3, max_new_tokens=6, temperature=0.9)
