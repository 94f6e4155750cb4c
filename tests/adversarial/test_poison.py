"""Pushes that would poison the model: each is refused whole at the door (422 with its reason),
changes nothing but its refusal counter, and the learner keeps training with finite weights."""

from __future__ import annotations

import json

import pytest
from hostile import Door, HostileWorker

INF, NAN = float("inf"), float("nan")


def poisoned(door: Door, mallory: HostileWorker, change) -> tuple[str, list[dict]]:
    """An honest batch for a fresh lease, with `change` applied to its first record."""
    lease_id, records = door.honest_lease(mallory)
    change(records[0])
    return lease_id, records


def set_logprob(value):
    def change(r):
        r["behaviour_logprobs"][0] = value

    return change


def set_mask(value):
    def change(r):
        r["loss_mask"][0] = value

    return change


def set_reward(value):
    def change(r):
        r["reward"] = value

    return change


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (set_logprob(NAN), "bad_logprob"),
        (set_logprob(-INF), "bad_logprob"),
        (set_logprob(50.0), "bad_logprob"),
        (set_logprob(-1e30), "bad_logprob"),
        (set_reward(1e39), "reward_out_of_range"),
        (set_reward(1e300), "reward_out_of_range"),
        (set_reward(-1e300), "reward_out_of_range"),
        (set_reward(NAN), "non_finite_reward"),
        (set_mask(2), "bad_mask"),
        (set_mask(-1), "bad_mask"),
        (set_mask(1_000_000), "bad_mask"),
    ],
    ids=[
        "logp-nan",
        "logp-neg-inf",
        "logp+50",
        "logp-1e30",
        "reward-1e39",
        "reward-1e300",
        "reward-neg-1e300",
        "reward-nan",
        "mask-2",
        "mask-neg-1",
        "mask-1e6",
    ],
)
def test_a_poisoned_record_is_refused_whole(door: Door, mallory: HostileWorker, change, reason):
    lease_id, records = poisoned(door, mallory, change)
    before = door.snapshot()
    status, body = mallory.push(lease_id, records)
    assert (status, body["error"]) == (422, reason), body
    door.invariant(before, reason, count=len(records))


def test_an_inverted_reward_is_refused(door: Door, mallory: HostileWorker):
    """The reward the worker claims is not what the task gives the response it sent."""
    lease_id, records = door.honest_lease(mallory)
    for r in records:
        r["reward"] = 1.0 - r["reward"]
        r["metadata"]["correct"] = not r["metadata"]["correct"]
    before = door.snapshot()
    status, body = mallory.push(lease_id, records)
    assert (status, body["error"]) == (422, "reward_mismatch"), body
    door.invariant(before, "reward_mismatch")


def test_a_forged_correct_flag_is_refused(door: Door, mallory: HostileWorker):
    """The accuracy metric reads `correct`: a claim the task does not make is refused."""
    lease_id, records = door.honest_lease(mallory)
    records[0]["metadata"]["correct"] = not records[0]["metadata"]["correct"]
    before = door.snapshot()
    status, body = mallory.push(lease_id, records)
    assert (status, body["error"]) == (422, "reward_mismatch"), body
    door.invariant(before, "reward_mismatch")


def test_a_held_out_prompt_under_a_leased_group_is_refused(door: Door, mallory: HostileWorker):
    """The prompt ids of an evaluation problem, sent under a leased group id."""
    lease_id, records = door.honest_lease(mallory)
    held_out = door.task.eval_prompts(1)[0]
    ids = door.tokenizer("\n".join(m["content"] for m in held_out.messages) + "\n").input_ids
    for r in records:
        r["prompt_ids"] = ids
    before = door.snapshot()
    status, body = mallory.push(lease_id, records)
    assert (status, body["error"]) == (422, "wrong_prompt"), body
    door.invariant(before, "wrong_prompt")


def test_metadata_nested_900_deep_is_refused_and_a_checkpoint_still_saves(door: Door, mallory: HostileWorker):
    lease_id, records = door.honest_lease(mallory)
    deep: dict = {}
    for _ in range(900):
        deep = {"x": deep}
    records[0]["metadata"] = {"deep": deep}
    before = door.snapshot()
    status, body = mallory.push(lease_id, records)
    assert (status, body["error"]) == (422, "malformed") and "deeper" in body["detail"], body
    door.invariant(before, "malformed", count=1)
    json.dumps(door.state.intake.buffer.state_dict())  # what a checkpoint writes


def test_duplicate_record_ids_in_one_batch_are_refused_whole(door: Door, mallory: HostileWorker):
    lease_id, records = door.honest_lease(mallory)
    records[1]["record_id"] = records[0]["record_id"]
    before = door.snapshot()
    status, body = mallory.push(lease_id, records)
    assert (status, body["error"]) == (422, "duplicate_id"), body
    door.invariant(before, "duplicate_id", count=len(records))


def test_a_quarantined_worker_gets_no_lease_and_shows_in_status(door: Door, mallory: HostileWorker):
    for _ in range(door.state.intake.integrity.quarantine_after):
        lease_id, records = poisoned(door, mallory, set_reward(1e39))
        assert mallory.push(lease_id, records)[0] == 422
    before = door.snapshot()
    status, body = mallory.lease()
    assert (status, body["error"]) == (403, "quarantined")
    _, st = mallory.call("GET", "/status")
    assert st["quarantined"] == [mallory.worker_id]
    assert [w["state"] for w in st["workers"] if w["worker_id"] == mallory.worker_id] == ["quarantined"]
    assert not any(lease.worker_id == mallory.worker_id for lease in door.state.intake.ingestion.leases.values())
    door.invariant(before, None)


@pytest.mark.parametrize("token", [2**40, -1], ids=["huge", "negative"])
def test_a_token_outside_the_vocabulary_is_refused_before_the_referee_decodes_it(
    door: Door, mallory: HostileWorker, token
):
    """The referee decodes responses, and a tokenizer raises on an id it has no token for: the
    push is refused by the lease's rules (422 out_of_vocab), never answered 500 (the endpoint fuzz
    found this once the referee moved ahead of the lock)."""
    lease_id, records = door.honest_lease(mallory)
    records[0]["response_ids"][0] = token
    before = door.snapshot()
    status, body = mallory.push(lease_id, records)
    assert (status, body["error"]) == (422, "out_of_vocab"), body
    door.invariant(before, "out_of_vocab", count=len(records))
