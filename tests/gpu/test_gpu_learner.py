"""On a CUDA machine: the start-up check finds CUDA usable, `auto` picks the GPU with its GPU
defaults, and a bf16 learner step runs there (the step against the CPU fp32 step is
tests/unit/test_device.py::test_bf16_step_on_cuda_matches_the_cpu_step). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from echo2.config import LearnerConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)"),
]


def test_cuda_is_usable_and_auto_takes_the_gpu():
    """diagnose() is None where torch can use the GPU; learner.device = auto resolves to cuda:0
    (the old code could quietly fall back to the CPU beside a GPU torch could not use)."""
    from echo2.gpu_env import diagnose
    from echo2.learning.device import resolve_device

    assert diagnose() is None
    assert resolve_device(LearnerConfig(device="auto")) == torch.device("cuda", 0)


def test_auto_learner_gets_the_gpu_defaults():
    """learner.dtype/gradient_checkpointing/micro_batch_tokens left to "auto"/None become bf16 (on a
    GPU that supports it), checkpointing on and 16384-token micro-batches on CUDA."""
    from echo2.learning.device import resolved_learner

    got = resolved_learner(LearnerConfig(device="auto"))
    assert got.dtype == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")
    assert got.gradient_checkpointing is True and got.micro_batch_tokens == 16384
