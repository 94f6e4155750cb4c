"""Issue 22 case 4: a chosen response carrying the model's own log-probs was trained as if sampled.

With rollout.sampling = "gumbel" the learner regenerates each record's keyed noise and leaves out,
for a strike, a record any of whose tokens is not the arg-max (learning/verify.py: SamplingCheck)."""

from __future__ import annotations

import copy
import dataclasses

import torch

from echo2.config import ArithmeticTaskConfig, LearnerConfig, RolloutConfig
from echo2.data.tasks import make_task
from echo2.data.tasks.base import to_tensors
from echo2.learning.step import make_optimizer, response_logprobs, train_step
from echo2.learning.verify import SamplingCheck, StepCheck
from echo2.records import Trajectory
from echo2.rollout import sampling
from echo2.rollout.collect import collect
from echo2.rollout.engine import HFEngine

SEED = 1234


def _setup(tiny):
    model, tok = tiny
    cfg = RolloutConfig(group_size=3, max_new_tokens=6, temperature=0.9, top_p=0.95, sampling="gumbel")
    task = make_task(ArithmeticTaskConfig(), seed=0)
    engine = HFEngine(copy.deepcopy(model), tok, cfg)
    prompts = [task.train_prompt(i) for i in range(2)]
    groups = collect(engine, task, prompts, n=cfg.group_size, sampling_seed=SEED)
    assert all(r.metadata[sampling.SEED_KEY] == SEED for g in groups for r in g)  # the coordinator's
    return model, tok, cfg, groups


def _step(model, tok, cfg, groups):
    model = copy.deepcopy(model)
    lcfg = LearnerConfig(lr=1e-4, micro_batch_tokens=4096)
    check = StepCheck(
        max_logratio=1.0,
        learner_version=0,
        sampling=SamplingCheck(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            group_size=cfg.group_size,
            max_new_tokens=cfg.max_new_tokens,
            eos_id=tok.eos_token_id,
        ),
    )
    stats = train_step(
        model,
        make_optimizer(model, lcfg),
        groups,
        lcfg,
        pad_id=tok.pad_token_id,
        temperature=cfg.temperature,
        check=check,
    )
    return check, stats


def _own_logprobs(model, tok, record: Trajectory, temperature: float) -> tuple[float, ...]:
    batch = to_tensors([record], pad_id=tok.pad_token_id, advantages=[0.0])
    with torch.no_grad():
        return tuple(response_logprobs(model, batch, temperature=temperature)[0].tolist())


def test_honest_gumbel_records_pass_and_a_chosen_payload_is_refused(tiny):
    model, tok, cfg, groups = _setup(tiny)
    check, stats = _step(model, tok, cfg, groups)
    assert check.refused == [] and check.sampling.refused == [] and stats["train/unsampled_records"] == 0
    assert check.sampling.tokens == sum(len(r.response_ids) for g in groups for r in g)
    assert check.sampling.margin_max < 1e-4  # fp32 engine, fp32 learner

    # the payload: a fixed string, carrying the model's own log-probs (so the log-prob check passes)
    victim = groups[0][1]
    payload = tuple(tok("rm -rf", add_special_tokens=False).input_ids)[: cfg.max_new_tokens - 1] + (
        tok.eos_token_id,
    )
    forged = dataclasses.replace(
        victim, response_ids=payload, loss_mask=(1,) * len(payload), behaviour_logprobs=(0.0,) * len(payload)
    )
    forged = dataclasses.replace(
        forged, behaviour_logprobs=_own_logprobs(model, tok, forged, cfg.temperature)
    )
    attacked = [[forged if r is victim else r for r in g] for g in groups]
    check, stats = _step(model, tok, cfg, attacked)
    assert check.refused == []  # its log-probs are the model's own: the log-prob check cannot see it
    assert [r.record_id for r in check.sampling.refused] == [forged.record_id]
    assert stats["train/unsampled_records"] == 1


def test_keys_the_worker_could_choose_are_refused(tiny):
    model, tok, cfg, groups = _setup(tiny)
    g = groups[0]
    dup = dataclasses.replace(g[1], metadata={**g[1].metadata, sampling.SAMPLE_KEY: 0})  # re-used noise
    unseeded = dataclasses.replace(
        g[2], metadata={k: v for k, v in g[2].metadata.items() if k != sampling.SEED_KEY}
    )
    check, _ = _step(model, tok, cfg, [[g[0], dup, unseeded], groups[1]])
    assert {r.record_id for r in check.sampling.refused} == {
        g[0].record_id,
        dup.record_id,
        unseeded.record_id,
    }


def test_a_response_cut_short_or_continued_after_eos_is_refused(tiny):
    model, tok, cfg, groups = _setup(tiny)
    long = [
        r
        for g in groups
        for r in g
        if len(r.response_ids) == cfg.max_new_tokens and tok.eos_token_id not in r.response_ids
    ]
    assert long, "some sampled response ran to max_new_tokens"
    victim = long[0]
    cut = dataclasses.replace(
        victim,
        response_ids=victim.response_ids[:3],
        loss_mask=victim.loss_mask[:3],
        behaviour_logprobs=victim.behaviour_logprobs[:3],
    )
    attacked = [[cut if r is victim else r for r in g] for g in groups]
    check, _ = _step(model, tok, cfg, attacked)
    assert [r.record_id for r in check.sampling.refused] == [cut.record_id]

