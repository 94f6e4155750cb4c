"""LoRA: the wrapped learner, the adapter snapshot, its merge into an engine and its trip on the wire."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load

from echo2.config import ArithmeticTaskConfig, ConfigError, LearnerConfig, LoraConfig, build_config
from echo2.data.tasks import make_task
from echo2.data.tasks.base import to_tensors
from echo2.learning.loop import make_snapshot
from echo2.learning.lora import adapter_state, apply_lora, engine_copy, is_lora
from echo2.learning.sources.remote import serialise
from echo2.learning.step import make_optimizer, response_logprobs
from echo2.models import merge_adapter
from echo2.records import Snapshot
from echo2.rollout.collect import collect
from echo2.rollout.engine import HFEngine


def wrapped(tiny, **lora):
    model, _ = tiny
    return apply_lora(copy.deepcopy(model), LoraConfig(**lora))


def randomise_adapter(policy, seed: int, scale: float = 0.5) -> None:
    """Give lora_B (zero at init) random values, as training would, so the adapter changes outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def greedy(engine, prompts) -> list[tuple[int, ...]]:
    return [g[0].response_ids for g in engine.generate(prompts, n=1, greedy=True)]


def test_config_section_and_dotted_override():
    cfg = build_config({}, {"learner.lora.rank": 4})
    assert cfg.learner.lora == LoraConfig(rank=4) and cfg.learner.lora.alpha == 16.0
    assert build_config({}).learner.lora is None
    with pytest.raises(ConfigError, match=r"learner\.lora\.rank"):
        build_config({}, {"learner.lora.rank": 0})
    with pytest.raises(ConfigError, match=r"learner\.lora\.target_modules"):
        build_config({}, {"learner.lora.target_modules": []})


def test_only_adapter_parameters_train(tiny):
    policy = wrapped(tiny, rank=4, target_modules=["q_proj", "v_proj"])
    assert is_lora(policy) and not is_lora(tiny[0])
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    optimizer = make_optimizer(policy, LearnerConfig())
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in policy.parameters() if p.requires_grad}


@pytest.mark.parametrize(
    ("targets", "why"),
    [
        (["q_proj", "nope_proj"], "'nope_proj' names no module"),
        (["mlp"], "not a linear layer"),
        (["lm_head"], "tie"),
    ],
)
def test_a_bad_target_is_a_config_error_naming_the_key(tiny, targets, why):
    with pytest.raises(ConfigError, match=r"^learner\.lora\.target_modules: .*" + why):
        wrapped(tiny, target_modules=targets)


def test_adapter_snapshot_is_small_and_keyed_by_base_layers(tiny):
    policy = wrapped(tiny)  # default targets: every attention and MLP projection
    full = serialise(Snapshot(version=1, state={k: v.clone() for k, v in tiny[0].state_dict().items()}))
    snap = make_snapshot(policy, 1, LearnerConfig())
    adapter = serialise(snap)
    assert snap.is_adapter and len(snap.state) == 2 * 7 * 2
    assert len(adapter) * 20 <= len(full), (len(adapter), len(full))
    base_names = {n for n, _ in tiny[0].named_modules()}
    assert {k.rsplit(".", 1)[0] for k in snap.state} <= base_names
    assert not Snapshot(version=1, state=tiny[0].state_dict()).is_adapter
    assert not Snapshot(version=1, state={}).is_adapter


def test_adapter_state_folds_the_scale_into_b(tiny):
    policy = wrapped(tiny, rank=4, alpha=12.0, target_modules=["q_proj"])
    randomise_adapter(policy, seed=1)
    state = adapter_state(policy)
    layer = policy.get_base_model().model.layers[0].self_attn.q_proj
    expected = layer.lora_B["default"].weight * 3.0  # alpha / rank
    assert torch.equal(state["model.layers.0.self_attn.q_proj.lora_B"], expected)
    state["model.layers.0.self_attn.q_proj.lora_B"].zero_()  # a copy: the learner's own is untouched
    assert layer.lora_B["default"].weight.abs().sum() > 0


def test_the_adapter_is_published_in_the_learners_snapshot_dtype(tiny):
    """S2: a bf16 learner publishes its adapter in bf16 (half the bytes), an fp32 one in fp32; the
    learner's own adapter weights stay fp32 either way."""
    policy = wrapped(tiny)
    randomise_adapter(policy, seed=4)
    half = make_snapshot(policy, 1, LearnerConfig(dtype="bf16", device="cpu"))
    full = make_snapshot(policy, 1, LearnerConfig(dtype="fp32", device="cpu"))
    assert set(half.state) == set(full.state) and half.is_adapter
    assert all(v.dtype == torch.bfloat16 and v.device.type == "cpu" for v in half.state.values())
    assert all(v.dtype == torch.float32 for v in full.state.values())
    assert all(torch.allclose(half.state[k].float(), v, rtol=1e-2, atol=1e-3) for k, v in full.state.items())
    assert all(p.dtype == torch.float32 for p in policy.parameters())


def test_install_changes_outputs_and_the_zero_adapter_restores_the_base_exactly(tiny, rollout_cfg):
    model, tok = tiny
    prompts = [make_task(ArithmeticTaskConfig(), seed=0).train_prompt(i) for i in range(3)]
    engine = HFEngine(copy.deepcopy(model), tok, rollout_cfg)
    base_out, base_weights = greedy(engine, prompts), copy.deepcopy(engine.model.state_dict())

    policy = wrapped(tiny)
    zero = make_snapshot(policy, 1, LearnerConfig())
    randomise_adapter(policy, seed=2)
    trained = make_snapshot(policy, 2, LearnerConfig())
    engine.install(trained)
    assert engine.version == 2 and greedy(engine, prompts) != base_out
    once = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.install(trained)  # recomputed from the base, not accumulated
    assert all(torch.equal(v, once[k]) for k, v in engine.model.state_dict().items())

    engine.install(zero)
    assert engine.version == 1 and greedy(engine, prompts) == base_out
    assert all(torch.equal(v, base_weights[k]) for k, v in engine.model.state_dict().items())


def test_install_after_the_wire_equals_install_in_process(tiny, rollout_cfg):
    """An adapter snapshot is bytes like any other: serialise (broadcast) -> load (worker) -> install."""
    model, tok = tiny
    policy = wrapped(tiny, target_modules=["o_proj", "down_proj"])
    randomise_adapter(policy, seed=3)
    snap = make_snapshot(policy, 4, LearnerConfig())
    received = Snapshot(version=4, state=load(serialise(snap)))
    assert received.is_adapter
    a, b = HFEngine(copy.deepcopy(model), tok, rollout_cfg), HFEngine(copy.deepcopy(model), tok, rollout_cfg)
    a.install(snap)
    b.install(received)
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())


def test_engine_logprobs_match_the_lora_learner(tiny, rollout_cfg):
    """Engine (merged weights) vs learner (peft forward) on the same adapter: ratio 1 on-policy."""
    _, tok = tiny
    policy = wrapped(tiny)
    randomise_adapter(policy, seed=4, scale=0.2)
    engine = HFEngine(engine_copy(policy), tok, rollout_cfg)
    assert not is_lora(engine.model)
    engine.install(make_snapshot(policy, 1, LearnerConfig()))
    task = make_task(ArithmeticTaskConfig(), seed=0)
    torch.manual_seed(0)
    groups = collect(engine, task, [task.train_prompt(i) for i in range(2)], n=rollout_cfg.group_size)
    records = [r for g in groups for r in g]
    batch = to_tensors(records, pad_id=tok.pad_token_id, advantages=[0.0] * len(records))
    with torch.no_grad():
        logp = response_logprobs(policy.eval(), batch, temperature=rollout_cfg.temperature)
        base_logp = response_logprobs(tiny[0].eval(), batch, temperature=rollout_cfg.temperature)
    diff = ((logp - batch.behaviour_logprobs) * batch.loss_mask).abs().max().item()
    assert diff < 1e-4
    assert ((base_logp - batch.behaviour_logprobs) * batch.loss_mask).abs().max().item() > 1e-2


def test_a_malformed_adapter_is_refused_before_anything_changes(tiny):
    model = copy.deepcopy(tiny[0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    base: dict[str, torch.Tensor] = {}
    good = {"model.layers.0.self_attn.q_proj.lora_A": torch.ones(2, 32)}
    bad_cases = [
        good,  # no B
        {**good, "model.layers.0.self_attn.q_proj.lora_B": torch.ones(32, 3)},  # rank mismatch
        {"model.nope.lora_A": torch.ones(2, 32), "model.nope.lora_B": torch.ones(32, 2)},
    ]
    for state in bad_cases:
        with pytest.raises(ValueError, match="adapter snapshot"):
            merge_adapter(model, state, base)
    assert base == {} and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
