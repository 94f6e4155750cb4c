"""Issue 22, round 2 of untrusted workers: text at the door, the per-token log-prob check, the
version a record is checked against, the poker replay's token rules, the worker-sent `grouping`,
and the journal a resumed learner trusts. Each test fails on commit 97ea5ef."""

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
