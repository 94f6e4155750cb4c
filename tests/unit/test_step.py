"""The learner's tensors against the engine's: alignment, log-prob agreement, micro-batching."""

from __future__ import annotations

import copy

import torch

from echo2.config import ArithmeticTaskConfig, LearnerConfig
from echo2.data.tasks import make_task
from echo2.data.tasks.base import to_tensors
from echo2.learning.step import micro_batches, response_logprobs, train_step
from echo2.records import Trajectory
from echo2.rollout.collect import collect
from echo2.rollout.engine import HFEngine


def make_groups(tiny, rollout_cfg, seed=0):
    model, tok = tiny
    task = make_task(ArithmeticTaskConfig(), seed=seed)
    engine = HFEngine(copy.deepcopy(model), tok, rollout_cfg)
    torch.manual_seed(seed)
    prompts = [task.train_prompt(i) for i in range(rollout_cfg.prompts_per_step)]
    return collect(engine, task, prompts, n=rollout_cfg.group_size)


def test_collect_tags_version_groups_and_scores(tiny, rollout_cfg):
    groups = make_groups(tiny, rollout_cfg)
    assert len(groups) == 2 and all(len(g) == 3 for g in groups)
    for g in groups:
        assert len({r.group_id for r in g}) == 1 and len({r.prompt_ids for r in g}) == 1
        for r in g:
            assert r.version == 0 and 1 <= len(r.response_ids) <= rollout_cfg.max_new_tokens
            assert r.reward in (0.0, 1.0) and all(lp <= 0 for lp in r.behaviour_logprobs)


def test_engine_logprobs_match_learner_recomputation(tiny, rollout_cfg):
    """Behaviour log-probs from generation equal the learner's forward pass: ratio 1 on-policy."""
    model, tok = tiny
    records = [r for g in make_groups(tiny, rollout_cfg) for r in g]
    batch = to_tensors(records, pad_id=tok.pad_token_id, advantages=[0.0] * len(records))
    with torch.no_grad():
        logp = response_logprobs(model.eval(), batch, temperature=rollout_cfg.temperature)
    diff = ((logp - batch.behaviour_logprobs) * batch.loss_mask).abs().max().item()
    assert diff < 1e-4


def test_to_tensors_left_pads_and_aligns():
    recs = [
        Trajectory(
            group_id="g",
            prompt_ids=(5, 6, 7),
            response_ids=(8, 9),
            behaviour_logprobs=(-1.0, -2.0),
            loss_mask=(1, 1),
            reward=1.0,
            version=0,
        ),
        Trajectory(
            group_id="g",
            prompt_ids=(5,),
            response_ids=(4, 3, 2),
            behaviour_logprobs=(-3.0, -4.0, -5.0),
            loss_mask=(1, 0, 1),
            reward=0.0,
            version=0,
        ),
    ]
    b = to_tensors(recs, pad_id=0, advantages=[0.5, -0.5])
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [0, 5, 4, 3, 2]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 1, 2, 3]]
    assert b.targets.tolist() == [[7, 8, 9], [4, 3, 2]]
    assert b.loss_mask.tolist() == [[0, 1, 1], [1, 0, 1]]
    assert b.behaviour_logprobs.tolist() == [[0, -1, -2], [-3, -4, -5]]
    assert b.num_loss_tokens == 4


def test_micro_batches_respect_the_token_budget(tiny, rollout_cfg):
    records = [r for g in make_groups(tiny, rollout_cfg) for r in g]
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in records]
    budget = 2 * max(lengths)
    batches = list(micro_batches(records, budget))
    assert sorted(i for b in batches for i in b) == list(range(len(records)))
    assert all(len(b) * max(lengths[i] for i in b) <= budget for b in batches)
    assert len(batches) >= len(records) // 2


def test_micro_batching_does_not_change_the_update(tiny, rollout_cfg):
    model, tok = tiny
    groups = make_groups(tiny, rollout_cfg)
    groups[0] = [
        Trajectory.from_dict({**r.to_dict(), "reward": float(i % 2)}) for i, r in enumerate(groups[0])
    ]
    results = []
    for budget in (10_000, 40):
        m = copy.deepcopy(model)
        cfg = LearnerConfig(micro_batch_tokens=budget, lr=1e-3)
        # SGD: the weights move by lr x the gradient (Adam's first step is about lr x its sign, which
        # float noise flips on near-zero entries whatever the micro-batching)
        sgd = torch.optim.SGD(m.parameters(), lr=cfg.lr)
        stats = train_step(m, sgd, groups, cfg, pad_id=tok.pad_token_id, temperature=0.9)
        results.append((stats, m.state_dict()))
    (s1, w1), (s2, w2) = results
    assert abs(s1["train/loss"] - s2["train/loss"]) < 1e-5
    assert abs(s1["train/grad_norm"] - s2["train/grad_norm"]) < 1e-4 and s1["train/grad_norm"] > 0
    assert all(torch.allclose(w1[k], w2[k], atol=1e-6) for k in w1)
    assert any(not torch.equal(w1[k], model.state_dict()[k]) for k in w1), "the step changed weights"


def test_shared_prefill_gives_the_same_greedy_samples(tiny, rollout_cfg):
    """n samples share one prefill of their prompt; greedily they must equal a single generation."""
    model, tok = tiny
    task = make_task(ArithmeticTaskConfig(), seed=0)
    engine = HFEngine(copy.deepcopy(model), tok, rollout_cfg)
    prompts = [task.train_prompt(i) for i in range(3)] + task.eval_prompts(1)  # different lengths
    single = engine.generate(prompts, n=1, greedy=True)
    shared = engine.generate(prompts, n=3, greedy=True)
    for (one,), group in zip(single, shared, strict=True):
        assert len(group) == 3
        for s in group:
            assert s.response_ids == one.response_ids and s.prompt_ids == one.prompt_ids
            assert max(abs(a - b) for a, b in zip(s.logprobs, one.logprobs, strict=True)) < 1e-5
