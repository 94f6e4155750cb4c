"""vLLM's CUDA build on the GPU in bf16, as `echo2 run --rollout.engine=vllm` builds it on a GPU
(learning/engine.py `learner_engine`, dtype from learner.dtype): its behaviour log-probs agree with
the bf16 learner's recomputation on the same GPU, a bf16 snapshot installs in place, and the same
torch seed gives the same samples (vLLM's GPU sampler ignores torch's generator; echo2 hands it
per-request seeds). The fp32 engine's checks are tests/e2e/test_vllm_engine.py. Skipped without
CUDA or vllm. Measured figures are printed (`MEASURED ...`) into gpu_check.sh's section log."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)"),
]

MEAN_LOGRATIO = 0.05
"""Mean |log ratio| per token between vLLM bf16 and the learner's bf16-autocast forward: bf16 has an
8-bit mantissa, so per-token log-probs differ by about 1e-2; an unchanged policy must stay far inside
the PPO clip (log 1.2 = 0.18)."""
MAX_LOGRATIO = 1.0
"""The learner's own admission bound on a record's mean log ratio (learner.max_logratio default)."""


@pytest.fixture(scope="module")
def bf16():
    """(config, vLLM engine in bf16 on cuda:0, the fp32 CPU policy, tokenizer, task, prompts)."""
    pytest.importorskip("vllm")
    from support import TINY

    from echo2.config import load_config
    from echo2.data.tasks import make_task
    from echo2.learning.engine import learner_engine
    from echo2.models import load_model, load_tokenizer
    from echo2.rollout.vllm_engine import VLLMEngine

    quickstart = TINY.replace("tiny.toml", "quickstart.toml")
    overrides = {"rollout.engine": "vllm", "learner.device": "cuda", "learner.dtype": "bf16"}
    config = load_config(quickstart, overrides)
    tok = load_tokenizer(config.model)
    model = load_model(config.model, vocab_size=len(tok), seed=0).eval()
    device = torch.device("cuda", 0)
    engine = learner_engine(config, model=model, tokenizer=tok, version=0, device=device)
    assert isinstance(engine, VLLMEngine)
    task = make_task(config.task, seed=0)
    prompts = [task.train_prompt(i) for i in range(config.rollout.prompts_per_step)]
    return config, engine, model, tok, task, prompts


def test_bf16_engine_logprobs_agree_with_the_bf16_learner(bf16):
    from echo2.data.tasks.base import to_tensors
    from echo2.learning.device import on_device, precision
    from echo2.learning.step import response_logprobs
    from echo2.rollout.collect import collect

    config, engine, model, tok, task, prompts = bf16
    torch.manual_seed(0)
    groups = collect(engine, task, prompts, n=config.rollout.group_size)
    records = [r for g in groups for r in g]
    batch = to_tensors(records, pad_id=tok.pad_token_id, advantages=[0.0] * len(records))
    learner = copy.deepcopy(model).to("cuda")
    with torch.no_grad(), precision(learner, config.learner):
        logp = response_logprobs(learner, on_device(batch, learner), temperature=config.rollout.temperature)
    mask = batch.loss_mask.to(logp.device) > 0
    ratio = (logp.float() - batch.behaviour_logprobs.to(logp.device))[mask].abs()
    print(
        f"MEASURED bf16 |log ratio| per token: mean {ratio.mean():.2e} max {ratio.max():.2e} ({mask.sum()} tokens)"
    )
    assert ratio.mean().item() < MEAN_LOGRATIO
    assert ratio.max().item() < MAX_LOGRATIO


def test_same_torch_seed_same_samples_on_the_gpu(bf16):
    """On the old engine (no per-request seed) the V2 GPU runner seeded each request from numpy,
    so this failed (docs/gpu.md, B5)."""
    _, engine, _, _, _, prompts = bf16
    torch.manual_seed(7)
    first = engine.generate(prompts[:2], n=4)
    torch.manual_seed(7)
    assert engine.generate(prompts[:2], n=4) == first
    torch.manual_seed(8)
    assert engine.generate(prompts[:2], n=4) != first, "another seed, other samples"


def test_a_bf16_snapshot_installs_in_place(bf16):
    """The snapshot a bf16 learner publishes (learning/device.py `snapshot_state`), installed into
    the running engine: perturbed weights change the greedy outputs, the originals restore them."""
    from echo2.learning.device import snapshot_state
    from echo2.records import Snapshot

    config, engine, model, _, _, prompts = bf16
    before = engine.generate(prompts, n=1, greedy=True)
    original = snapshot_state(model, config.learner)
    assert all(v.dtype == torch.bfloat16 for v in original.values() if v.is_floating_point())
    gen = torch.Generator().manual_seed(0)
    noisy = {
        k: v + (0.05 * v.float().std() * torch.randn(v.shape, generator=gen)).to(v.dtype)
        for k, v in original.items()
    }
    engine.install(Snapshot(version=1, state=noisy))
    assert engine.generate(prompts, n=1, greedy=True) != before
    engine.install(Snapshot(version=2, state=original))
    assert engine.version == 2 and engine.generate(prompts, n=1, greedy=True) == before
