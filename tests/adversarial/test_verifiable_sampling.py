"""Issue 22 case 4: a chosen response carrying the model's own log-probs was trained as if sampled.

With rollout.sampling = "gumbel" the learner regenerates each record's keyed noise and leaves out,
for a strike, a record any of whose tokens is not the arg-max (learning/verify.py: SamplingCheck)."""

from __future__ import annotations

import copy
import dataclasses

import torch
from support import checked_train_step

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


def _sampling(tok, cfg, **kw) -> SamplingCheck:
    """The learner's sampling check for `cfg`'s records (`kw`: tolerance, strike_margin)."""
    return SamplingCheck(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        group_size=cfg.group_size,
        max_new_tokens=cfg.max_new_tokens,
        eos_id=tok.eos_token_id,
        **kw,
    )


def _step(model, tok, cfg, groups):
    check = StepCheck(
        max_logratio=1.0,
        learner_version=0,
        sampling=_sampling(tok, cfg),
    )
    stats = checked_train_step(
        model, tok, groups, check, temperature=cfg.temperature, micro_batch_tokens=4096
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


def test_doubtful_records_are_left_out_of_the_step_without_a_strike(tiny):
    """A margin over the tolerance but under the strike margin (honest bf16 engines reach one now
    and then) leaves the record out untrained, listed as doubtful, not refused: the loop reports
    only `refused` to the coordinator for strikes (issue 41 item 2)."""
    model, tok, cfg, groups = _setup(tiny)
    check = StepCheck(
        max_logratio=1.0,
        learner_version=0,
        sampling=_sampling(tok, cfg, tolerance=-1.0, strike_margin=1e9),  # every honest record is doubtful
    )
    stats = checked_train_step(
        model, tok, groups, check, temperature=cfg.temperature, micro_batch_tokens=4096
    )
    records = [r for g in groups for r in g]
    assert check.refused == [] and check.sampling.refused == []
    assert {r.record_id for r in check.sampling.doubtful} == {r.record_id for r in records}
    assert stats["train/doubtful_records"] == len(records) and stats["train/unsampled_records"] == 0
    assert stats["train/grad_norm"] == 0.0, "no doubtful token is trained"


def test_stale_records_over_the_tolerance_are_left_out_without_a_strike(tiny):
    """The step checks stale records against its newer weights: one over the tolerance is doubtful,
    never refused; the same records fresh are refused (found with S = 3, bench/headline.py)."""
    model, tok, cfg, groups = _setup(tiny)
    records = [r for g in groups for r in g]
    for staleness in (0, 1):
        check = StepCheck(
            max_logratio=1.0,
            learner_version=1,
            sampling=_sampling(tok, cfg, tolerance=-1.0),  # every record is over it and the strike margin
        )
        lcfg = LearnerConfig(lr=1e-4, micro_batch_tokens=4096)
        copy_ = copy.deepcopy(model)
        train_step(
            copy_, make_optimizer(copy_, lcfg), groups, lcfg, pad_id=tok.pad_token_id,
            temperature=cfg.temperature, staleness=[staleness] * len(records), check=check,
        )  # fmt: skip
        refused, doubtful = check.sampling.refused, check.sampling.doubtful
        assert (len(refused), len(doubtful)) == ((len(records), 0) if staleness == 0 else (0, len(records)))


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


# ---------------------------------------------------------------------------- through the coordinator
def _gumbel_engine(door):
    from hostile import GROUP_SIZE

    cfg = RolloutConfig(max_new_tokens=4, group_size=GROUP_SIZE, temperature=1.0, sampling="gumbel")
    return HFEngine(copy.deepcopy(door.model), door.tokenizer, cfg), cfg


def _wire(groups) -> list[dict]:
    import json

    return [json.loads(json.dumps(r.to_dict())) for g in groups for r in g]


def test_the_seed_is_the_leases_never_the_workers(door, mallory):
    """The lease reply carries the coordinator's seed (one per coordinator: a group's noise is keyed by
    it and the group's id, so a second lease of other prompts has the same seed and other noise);
    what a worker writes as its records' seed is replaced by its lease's when they are accepted."""
    from hostile import GROUP_SIZE

    status, lease = mallory.lease()
    assert status == 200 and 0 <= lease["sampling_seed"] < 2**63, lease
    status, other = mallory.lease()
    assert status == 200 and other["sampling_seed"] == lease["sampling_seed"]
    assert set(other["indices"]).isdisjoint(lease["indices"])
    engine, _ = _gumbel_engine(door)
    prompts = [door.task.train_prompt(i) for i in lease["indices"]]
    records = _wire(collect(engine, door.task, prompts, n=GROUP_SIZE, sampling_seed=lease["sampling_seed"]))
    for r in records:
        r["metadata"][sampling.SEED_KEY] = 7  # the worker's own choice of noise
    status, body = mallory.push(lease["lease_id"], records)
    assert status == 200 and body["accepted"] == len(records), body
    taken, _ = door.state.intake.buffer.take(len(prompts))
    assert {r.metadata[sampling.SEED_KEY] for g in taken for r in g} == {lease["sampling_seed"]}


def test_a_pushed_payload_is_refused_by_the_learner_with_a_strike(door, mallory):
    """Honest Gumbel records pushed through the coordinator pass the learner's check; a payload with
    the model's own log-probs and the task's own reward for it passes the door and the referee, and
    is refused by the learner (`not_sampled`), a strike against its worker."""
    from hostile import GROUP_SIZE

    from echo2.learning.verify import sampling_check

    status, lease = mallory.lease()
    assert status == 200, lease
    engine, cfg = _gumbel_engine(door)
    prompts = [door.task.train_prompt(i) for i in lease["indices"]]
    groups = collect(engine, door.task, prompts, n=GROUP_SIZE, sampling_seed=lease["sampling_seed"])
    victim = groups[0][0]
    payload = tuple(door.tokenizer(prompts[0].answer).input_ids) + (
        door.tokenizer.eos_token_id,
    )  # right, chosen
    forged = dataclasses.replace(
        victim,
        response_ids=payload,
        loss_mask=door.task.loss_mask(payload),
        behaviour_logprobs=(0.0,) * len(payload),
    )
    reward = door.task.score(prompts[0], door.tokenizer.decode(payload, skip_special_tokens=True))
    forged = dataclasses.replace(
        forged,
        reward=reward.reward,
        metadata={**forged.metadata, "correct": reward.correct},
        behaviour_logprobs=_own_logprobs(door.model, door.tokenizer, forged, 1.0),
    )
    groups[0][0] = forged
    status, body = mallory.push(lease["lease_id"], _wire(groups))
    assert status == 200 and body["accepted"] == 2 * GROUP_SIZE, body  # the door and referee pass it
    taken, _ = door.state.intake.buffer.take(len(prompts))
    check = StepCheck(
        max_logratio=1.0,
        learner_version=0,
        sampling=sampling_check(cfg, is_env=False, eos_id=door.tokenizer.eos_token_id),
    )
    model = copy.deepcopy(door.model)
    train_step(
        model, make_optimizer(model, door.config), taken, door.config, pad_id=0, temperature=1.0, check=check
    )
    assert check.refused == []
    assert [r.record_id for r in check.sampling.refused] == [forged.record_id]
    assert door.state.intake.flag(check.sampling.refused, "not_sampled") == [mallory.worker_id]
    assert door.state.intake.integrity.strikes[mallory.worker_id] == 1
