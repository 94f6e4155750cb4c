"""Issue 22: hindsight-optimal poker play was trained as if sampled.

A worker that replays the seeded deal offline knows the cards; it plays, for each deal, the best of
a few fixed lines (fold, call, all-in) and pushes that episode with the model's own log-probs. The
replay (rollout/replay.py) accepts it: the env tokens, masks, return and outcome are the env's.
With rollout.sampling = "gumbel" every reply of an episode is sampled with noise keyed by the
record and the reply's positions in the record's response (rollout/episodes.py), and the learner
checks every loss-mask token (learning/verify.py: SamplingCheck with `episodes`), so the chosen
replies are refused (`not_sampled`, a strike) while honest episodes from the HF engine pass."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from support import checked_train_step

from echo2.config import CoordinatorConfig, EnvTaskConfig, RolloutConfig
from echo2.data.tasks import make_task
from echo2.data.tasks.base import to_tensors
from echo2.learning.step import response_logprobs
from echo2.learning.verify import StepCheck, TaskReferee, sampling_check
from echo2.records import Trajectory
from echo2.rollout import sampling
from echo2.rollout.collect import collect
from echo2.rollout.engine import HFEngine, Sample
from echo2.rollout.episodes import collect_episodes

DEALS = 60
SEED = 4321
LINES = ("fold", "call", "all-in")
"""The fixed lines a hindsight worker tries on each deal (fold with nothing to call checks)."""
CFG = RolloutConfig(
    group_size=2,
    max_new_tokens=8,
    max_prompt_tokens=400,
    temperature=0.9,
    sampling="gumbel",
)
"""top_p = 1: top-p (tested in test_verifiable_sampling.py) sorts the vocabulary at each checked
token, ~40 ms per token here, which 60 deals' episodes cannot afford in a test."""


@pytest.fixture(scope="module")
def poker(tiny):
    model, tok = tiny
    task = make_task(
        EnvTaskConfig(env="poker:heads_up?opponent=call_station&stack_bb=10", max_turns=3, max_tokens=600),
        seed=0,
    )
    return model, tok, task


class LineEngine:
    """Writes the same reply every turn: `line` + "</answer>" + EOS (the env wrote "<answer>")."""

    version = 0

    def __init__(self, tok, line: str) -> None:
        self.tokenizer = tok
        self.ids = (*tok(line + "</answer>", add_special_tokens=False).input_ids, tok.eos_token_id)
        self.text = line + "</answer>"

    def generate_ids(self, encoded, *, n, greedy=False, keys=None):
        return [
            [Sample(prompt_ids=(), response_ids=self.ids, logprobs=(0.0,) * len(self.ids), text=self.text)]
        ] * len(encoded)


def hindsight(model, tok, task, prompt, *, seed: int) -> Trajectory:
    """The best of `LINES` on this deal (each played against the seeded env), as sample 0 of its
    group, with the model's own log-probs on its reply tokens and the lease's seed."""
    played = [
        collect_episodes(LineEngine(tok, line), task, [prompt], n=1, config=CFG, sampling_seed=seed)[0][0]
        for line in LINES
    ]
    best = max(played, key=lambda r: r.reward)
    batch = to_tensors([best], pad_id=tok.pad_token_id, advantages=[0.0])
    with torch.no_grad():
        own = response_logprobs(model, batch, temperature=CFG.temperature)[0].tolist()
    lps = tuple(lp if m else 0.0 for lp, m in zip(own, best.loss_mask, strict=True))
    return dataclasses.replace(best, behaviour_logprobs=lps)


def _step(model, tok, groups) -> tuple[StepCheck, dict]:
    check = StepCheck(
        max_logratio=1.0,
        learner_version=0,
        sampling=sampling_check(CFG, is_env=True, eos_id=tok.eos_token_id),
    )
    stats = checked_train_step(
        model, tok, groups, check, temperature=CFG.temperature, micro_batch_tokens=8192
    )
    return check, stats


def _replies(record: Trajectory) -> int:
    return sum(1 for k, m in enumerate(record.loss_mask) if m and (k == 0 or not record.loss_mask[k - 1]))


def test_honest_gumbel_episodes_pass_with_no_false_refusal(poker):
    """Honest episodes of the real HF engine: every reply keyed at its positions in the record, so
    the learner's check of every loss-mask token passes (and the replay accepts them)."""
    model, tok, task = poker
    engine = HFEngine(copy.deepcopy(model), tok, CFG)
    prompts = [task.train_prompt(i) for i in range(8)]  # test_hindsight_... plays 60 more honest ones
    groups = collect(engine, task, prompts, n=CFG.group_size, sampling_seed=SEED)
    records = [r for g in groups for r in g]
    assert {r.metadata[sampling.SAMPLE_KEY] for g in groups for r in g} == {0, 1}
    assert any(_replies(r) > 1 for r in records), "some episode has several replies, env tokens between"
    referee = TaskReferee(task, tok, max_new_tokens=CFG.max_new_tokens)
    assert all(referee.check(r, i) is None for i, g in enumerate(groups) for r in g)
    check, stats = _step(model, tok, groups)
    assert check.refused == [] and check.sampling.refused == [] and stats["train/unsampled_records"] == 0
    assert check.sampling.tokens == sum(sum(r.loss_mask) for r in records)  # env tokens skipped
    assert check.sampling.margin_max < 1e-4  # fp32 engine, fp32 learner


def test_replies_keyed_per_generate_call_are_refused(poker, monkeypatch):
    """The negative control: an engine that keys each reply from position 0 of its generate call
    (not from its position in the record: after the "<answer>" prefix and the earlier turns)
    produces episodes the learner refuses, every one."""
    model, tok, task = poker
    monkeypatch.setattr(
        sampling.SamplingKeys, "starts", lambda self, n: torch.zeros(len(self.groups) * n, dtype=torch.long)
    )
    engine = HFEngine(copy.deepcopy(model), tok, CFG)
    groups = collect(
        engine, task, [task.train_prompt(i) for i in range(2)], n=CFG.group_size, sampling_seed=SEED
    )
    check, _ = _step(model, tok, groups)
    assert {r.record_id for r in check.sampling.refused} == {r.record_id for g in groups for r in g}


@pytest.mark.timeout(900)  # ~170 s on one busy core: 120 episodes, ~1,400 tokens checked
def test_hindsight_optimal_poker_is_refused_with_a_strike(poker):
    """60 deals leased from a coordinator: each group holds the hindsight-optimal episode (sample 0)
    and an honest one (sample 1). The door and the replay accept all 120; the learner refuses the
    60 hindsight episodes (`not_sampled`, a strike each push) and none of the honest ones."""
    from hostile import TOKEN, FakeClock, HostileWorker

    from echo2.coordinator.leases import Limits, Work
    from echo2.coordinator.server import Coordinator
    from echo2.coordinator.state import CoordinatorState
    from echo2.data.buffer import ReplayBuffer
    from echo2.wire.validate import reward_range

    model, tok, task = poker
    state = CoordinatorState(
        CoordinatorConfig(
            lease_timeout=300.0,
            heartbeat_timeout=300.0,
            groups_per_lease=DEALS,
            quarantine_after=10**9,
        ),
        work=Work(
            buffer=ReplayBuffer(staleness=1, group_size=CFG.group_size),
            limits=Limits(
                vocab_size=len(tok),
                max_prompt_tokens=CFG.max_prompt_tokens,
                max_new_tokens=task.config.max_tokens,
                group_size=CFG.group_size,
                reward_range=reward_range(task),
            ),
            group_id_of=lambda i: task.train_prompt(i).group_id,
            groups_per_step=DEALS,
        ),
        clock=FakeClock(),
        referee=TaskReferee(task, tok, max_new_tokens=CFG.max_new_tokens),
    )
    server = Coordinator(state, token=TOKEN, run_info={}, heartbeat_interval=1.0, max_body=64 * 2**20)
    server.start()
    try:
        state.publisher.publish(0, b"weights-v0", keep=2)
        mallory = HostileWorker(server.url)
        status, lease = mallory.lease(max_groups=DEALS)
        assert status == 200 and len(lease["indices"]) == DEALS, lease
        seed = lease["sampling_seed"]
        prompts = [task.train_prompt(i) for i in lease["indices"]]
        engine = HFEngine(copy.deepcopy(model), tok, CFG)
        groups = collect(engine, task, prompts, n=CFG.group_size, sampling_seed=seed)
        chosen = [hindsight(model, tok, task, p, seed=seed) for p in prompts]
        honest_return = sum(g[0].reward for g in groups)
        assert sum(r.reward for r in chosen) > honest_return  # it is the better play
        pushed = [[c, g[1]] for c, g in zip(chosen, groups, strict=True)]
        wire = [json.loads(json.dumps(r.to_dict())) for g in pushed for r in g]
        status, body = mallory.push(lease["lease_id"], wire)
        assert status == 200 and body["accepted"] == 2 * DEALS, body  # door and replay accept them
        taken, _ = state.intake.buffer.take(DEALS)
        assert {r.metadata[sampling.SEED_KEY] for g in taken for r in g} == {seed}
        check, stats = _step(model, tok, taken)
        refused = {r.record_id for r in check.sampling.refused}
        assert check.refused == []  # the model's own log-probs: the log-prob check cannot see them
        assert check.sampling.bad_keys(taken) == set()  # keys and reply ends as an engine's
        assert refused == {c.record_id for c in chosen}  # 60 of 60, and no honest episode
        assert stats["train/unsampled_records"] == DEALS
        assert state.intake.flag(check.sampling.refused, "not_sampled") == [mallory.worker_id]
        assert state.intake.integrity.strikes[mallory.worker_id] == 1
    finally:
        server.stop()
        state.close()


def test_a_reply_cut_short_is_refused(poker):
    """A reply that neither ends at EOS nor runs to max_new_tokens was cut by the worker."""
    model, tok, task = poker
    [[record]] = collect_episodes(
        LineEngine(tok, "call"), task, [task.train_prompt(0)], n=1, config=CFG, sampling_seed=SEED
    )
    start = record.loss_mask.index(1)
    end = start
    while end < len(record.loss_mask) and record.loss_mask[end]:
        end += 1
    cut = dataclasses.replace(
        record,
        response_ids=record.response_ids[: end - 1],
        loss_mask=record.loss_mask[: end - 1],
        behaviour_logprobs=record.behaviour_logprobs[: end - 1],
    )
    check = sampling_check(CFG, is_env=True, eos_id=tok.eos_token_id)
    assert check.bad_keys([[record]]) == set()
    assert check.bad_keys([[cut]]) == {cut.record_id}
