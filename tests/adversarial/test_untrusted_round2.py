"""Issue 22, round 2 of untrusted workers: text at the door, the per-token log-prob check, the
version a record is checked against, the poker replay's token rules and the worker-sent `grouping`
(the journal a resumed learner trusts: test_untrusted_journal.py). Each test fails on commit 97ea5ef."""

from __future__ import annotations

import pytest
from hostile import Door, HostileWorker


def _intake(door: Door):
    """The state's ingestion half (`state.intake` since the state was split; the state itself before)."""
    return getattr(door.state, "intake", door.state)


def _publish(door: Door, version: int) -> None:
    getattr(door.state, "publisher", door.state).publish(version, b"weights-v%d" % version, keep=2)


# ---------------------------------------------------------------------------- D: text at the door
@pytest.mark.parametrize(
    ("where", "text"),
    [
        ("value", "\ud800"),
        ("key", "\udfff"),
        ("value", "a\x1b[2Jb"),
        ("value", "\x85"),
        ("record_id", "r\ud800"),
        ("group_id", "g\udc00"),
    ],
)
def test_a_lone_surrogate_or_control_character_is_refused_before_anything_is_stored(
    door: Door, mallory: HostileWorker, where: str, text: str
):
    journalled = []
    _intake(door).journal = lambda records, prompts: journalled.append(records)
    lease_id, records = door.honest_lease(mallory)
    if where == "value":
        records[0]["metadata"]["note"] = text
    elif where == "key":
        records[0]["metadata"][text] = 1
    else:
        records[0][where] = text
    before = door.snapshot()
    status, body = mallory.push(lease_id, records)
    assert 400 <= status < 500 and body["error"] == "malformed", body
    named = ("surrogate", "control character", "unicode")  # ids: the wire model refuses them itself
    assert any(word in body["detail"] for word in named), body
    assert journalled == []
    door.invariant(before, "malformed")
    assert journalled, "the honest push after it is journalled"


def test_text_with_tabs_newlines_and_accents_is_kept(door: Door, mallory: HostileWorker):
    lease_id, records = door.honest_lease(mallory)
    records[0]["metadata"]["note"] = "line one\n\tline two: é, 数, \u00a0"
    status, body = mallory.push(lease_id, records)
    assert status == 200 and body["accepted"] == len(records), body


# ---------------------------------------------------------------------------- A: the log-prob check
def _own_logprobs(door: Door, n: int, seed: int = 0):
    """A record of `n` random response tokens whose behaviour log-probs are the learner's own."""
    import torch

    from echo2.data.tasks.base import to_tensors
    from echo2.learning.step import response_logprobs
    from echo2.records import Trajectory

    g = torch.Generator().manual_seed(seed)
    prompt = tuple(torch.randint(2, 128, (8,), generator=g).tolist())
    response = tuple(torch.randint(2, 128, (n,), generator=g).tolist())
    draft = Trajectory(
        group_id="g0",
        prompt_ids=prompt,
        response_ids=response,
        behaviour_logprobs=(-1.0,) * n,
        loss_mask=(1,) * n,
        reward=1.0,
        version=0,
    )
    batch = to_tensors([draft], pad_id=0, advantages=[0.0])
    with torch.no_grad():
        logp = response_logprobs(door.model.eval(), batch, temperature=1.0)
    return draft, logp[0, :n].tolist()


def test_one_token_20_nats_off_is_refused_though_the_others_compensate(door: Door):
    import dataclasses

    import torch

    from echo2.data.tasks.base import to_tensors
    from echo2.learning.verify import StepCheck

    n = 40
    draft, own = _own_logprobs(door, n)
    forged = list(own)
    forged[7] -= 20.0  # the learner's log-prob is 20 nats above the claimed one: ratio e^20
    forged = [lp + (20.0 / (n - 1) if i != 7 else 0.0) for i, lp in enumerate(forged)]  # mean 0
    honest = dataclasses.replace(draft, behaviour_logprobs=tuple(own), record_id="honest")
    attack = dataclasses.replace(draft, behaviour_logprobs=tuple(forged), record_id="attack")
    records = [honest, attack]
    batch = to_tensors(records, pad_id=0, advantages=[0.0, 0.0])
    with torch.no_grad():
        logp = __import__("echo2.learning.step", fromlist=["x"]).response_logprobs(
            door.model.eval(), batch, temperature=1.0
        )
    check = StepCheck(max_logratio=door.config.max_logratio, learner_version=0)
    mean = ((logp - batch.behaviour_logprobs) * batch.loss_mask).sum(dim=1) / n
    assert mean.abs().max() < 1e-3, "the mean alone cannot tell them apart"
    bad = check.outliers(logp, batch.behaviour_logprobs, batch.loss_mask, records, newest=0)
    assert bad.tolist() == [False, True]


def test_the_forged_token_is_left_out_of_a_real_step(door: Door):
    import copy
    import dataclasses

    from echo2.learning.step import train_step
    from echo2.learning.verify import StepCheck

    n = 40
    draft, own = _own_logprobs(door, n)
    forged = list(own)
    forged[3] -= 20.0
    group = [
        dataclasses.replace(draft, behaviour_logprobs=tuple(forged), record_id="a", reward=1.0),
        dataclasses.replace(draft, behaviour_logprobs=tuple(own), record_id="b", reward=0.0),
    ]
    check = StepCheck(max_logratio=door.config.max_logratio, learner_version=0)
    model = copy.deepcopy(door.model)
    stats = train_step(
        model,
        door.optimizer.__class__(model.parameters(), lr=1e-4),
        [group],
        door.config,
        pad_id=0,
        temperature=1.0,
        check=check,
    )
    assert [r.record_id for r in check.refused] == ["a"] and stats["train/refused_records"] == 1.0


def test_a_record_claiming_an_older_version_than_its_lease_is_refused(door: Door, mallory: HostileWorker):
    """Versions 0 and 1 are published; the worker leases at 1 and claims 0 (its bounds would double)."""
    _publish(door, 1)
    _intake(door).set_learner_version(1)  # version 0 is still admissible (S = 1)
    status, lease = mallory.lease(version=1)
    assert status == 200, lease
    groups = door.generate(lease["indices"], version=0)
    import json

    records = [json.loads(json.dumps(r.to_dict())) for g in groups for r in g]
    before = door.snapshot()
    status, body = mallory.push(lease["lease_id"], records)
    assert (status, body["error"]) == (422, "wrong_version"), body
    assert _intake(door).integrity.strikes[mallory.worker_id] == 1
    after = door.snapshot()
    assert after["buffer"] == before["buffer"] and after["accepted"] == before["accepted"]
    status, body = mallory.push(lease["lease_id"], [dict(r, version=1) for r in records])
    assert status == 200 and body["accepted"] == len(records), body


# ---------------------------------------------------------------------------- B: the poker replay
@pytest.fixture(scope="module")
def poker():
    """(task, tokenizer, prompt, honest record): one heads-up hand, every reply "call" + EOS."""
    from support import TINY

    from echo2.config import EnvTaskConfig, load_config
    from echo2.data.tasks import make_task
    from echo2.models import load_tokenizer
    from echo2.rollout.engine import Sample
    from echo2.rollout.episodes import collect_episodes

    config = load_config(TINY)
    tokenizer = load_tokenizer(config.model)
    task = make_task(
        EnvTaskConfig(env="poker:heads_up?opponent=call_station&stack_bb=10", max_turns=3, max_tokens=600),
        seed=0,
    )
    rollout = config.rollout.model_copy(update={"max_new_tokens": 6, "max_prompt_tokens": 400})

    class CallEngine:
        version = 0

        def __init__(self) -> None:
            self.tokenizer = tokenizer

        def generate_ids(self, encoded, *, n, greedy=False):
            ids = (*tokenizer("call", add_special_tokens=False).input_ids, tokenizer.eos_token_id)
            return [
                [Sample(prompt_ids=(), response_ids=ids, logprobs=(-0.5,) * len(ids), text="call")]
            ] * len(encoded)

    prompt = task.train_prompt(3)
    [[record]] = collect_episodes(CallEngine(), task, [prompt], n=1, config=rollout)
    return task, tokenizer, prompt, record


def _first_reply(record) -> tuple[int, int]:
    start = record.loss_mask.index(1)
    end = start
    while record.loss_mask[end]:
        end += 1
    return start, end


def _splice(record, start: int, end: int, reply: list[int]):
    import dataclasses

    ids = list(record.response_ids)
    mask, lps = list(record.loss_mask), list(record.behaviour_logprobs)
    ids[start:end], mask[start:end], lps[start:end] = reply, [1] * len(reply), [-0.5] * len(reply)
    return dataclasses.replace(
        record, response_ids=tuple(ids), loss_mask=tuple(mask), behaviour_logprobs=tuple(lps)
    )


def test_the_honest_poker_record_passes_the_referee(poker):
    from echo2.learning.verify import TaskReferee

    task, tokenizer, _, record = poker
    assert TaskReferee(task, tokenizer, max_new_tokens=6).check(record, 3) is None


def _action_of(task, prompt, tokenizer, reply) -> tuple:
    """What the env makes of `reply` as the first turn (decoded as the runner decodes it): the
    applied action and whether it was malformed."""
    from echo2.rollout.episodes import ChatTokens

    env = task.make_env()
    env.reset(prompt.metadata["env_seed"])
    chat = ChatTokens(tokenizer).for_env(env)
    result = env.step(chat.prefix_text + tokenizer.decode(reply, skip_special_tokens=True))
    return result.action, result.malformed, result.reward


def test_tokens_after_eos_in_a_reply_are_refused(poker):
    """The forged reply keeps the honest action ("call" <eos> " now" <eos> decodes to "call now",
    whose first word is the action) and its env tokens, so only the tokens after EOS are wrong:
    a replay without the EOS rule (97ea5ef's) accepts it."""
    from echo2.learning.verify import TaskReferee

    task, tokenizer, prompt, record = poker
    start, end = _first_reply(record)
    reply = list(record.response_ids[start:end])  # "call" <eos>
    assert reply[-1] == tokenizer.eos_token_id
    extra = list(tokenizer(" now", add_special_tokens=False).input_ids)
    forged_reply = reply[:-1] + [tokenizer.eos_token_id] + extra + [tokenizer.eos_token_id]
    assert len(forged_reply) <= 6, "within the per-reply limit: only the EOS rule can refuse it"
    assert _action_of(task, prompt, tokenizer, forged_reply) == _action_of(task, prompt, tokenizer, reply)
    assert not _action_of(task, prompt, tokenizer, forged_reply)[1], "a legal, well-formed call"
    forged = _splice(record, start, end, forged_reply)
    problem = TaskReferee(task, tokenizer, max_new_tokens=6).check(forged, 3)
    assert problem is not None and problem.reason == "bad_mask" and "after its EOS" in problem.detail, problem


def test_a_21_token_reply_where_the_limit_is_6_is_refused(poker):
    """A 21-token reply whose first word is the honest action ("call"), ending in EOS as the honest
    one does: the same action and env tokens, so only its length is wrong."""
    from echo2.learning.verify import TaskReferee

    task, tokenizer, prompt, record = poker
    start, end = _first_reply(record)
    honest = list(record.response_ids[start:end])
    text = "call, since given the pot odds and the stacks that is the best thing to do now, I think, surely"
    words = list(tokenizer(text, add_special_tokens=False).input_ids)
    reply = [*words[:20], tokenizer.eos_token_id]
    assert len(reply) == 21 and tokenizer.eos_token_id not in reply[:-1]
    assert tokenizer.decode(reply, skip_special_tokens=True).startswith("call")
    assert _action_of(task, prompt, tokenizer, reply) == _action_of(task, prompt, tokenizer, honest)
    assert not _action_of(task, prompt, tokenizer, reply)[1], "a legal, well-formed call"
    forged = _splice(record, start, end, reply)
    problem = TaskReferee(task, tokenizer, max_new_tokens=6).check(forged, 3)
    assert problem is not None and problem.reason == "too_long" and "21 tokens" in problem.detail, problem


def test_grouping_in_a_records_metadata_does_not_change_the_advantages(door: Door):
    """A worker tags its records `grouping: batch`: the learner normalises as its own config says."""
    import copy
    import dataclasses

    from echo2.learning.step import train_step

    groups = door.generate([0, 1])
    groups = [
        [
            dataclasses.replace(r, reward=float(i), metadata={**r.metadata, "grouping": "batch"})
            for i, r in enumerate(g)
        ]
        for g in groups
    ]
    groups[1] = [dataclasses.replace(r, reward=r.reward + 10.0) for r in groups[1]]
    out = {}
    for grouping in ("state", "batch"):
        model = copy.deepcopy(door.model)
        optimizer = door.optimizer.__class__(model.parameters(), lr=1e-4)
        stats = train_step(
            model, optimizer, groups, door.config, pad_id=0, temperature=1.0, grouping=grouping
        )
        out[grouping] = stats["train/adv_abs_mean"]
    # per group: rewards (0, 1) and (10, 11) -> |advantage| 1/sqrt(2) each; over the batch: less
    assert out["state"] == pytest.approx(0.7071, abs=1e-3), out
    assert abs(out["batch"] - out["state"]) > 0.1, out  # the learner's choice does change them
