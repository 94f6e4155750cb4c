"""Issue 41 item 3: no free re-draws of the sampling noise.

A worker that dislikes what the noise of its lease gives a prompt could have its push refused for
a reason that earns no strike (an over-full group, `group_overflow`; records tagged stale), give the
lease back and lease the prompt again. Each lease used to carry a freshly drawn seed, so every
round was a new draw: 40 seeds for one prompt, 0 strikes. The noise is now the coordinator's one
seed keyed by the group's id (coordinator/leases.py: `Leases.noise_seed`), spent when the group is
first leased: every round gets the same noise, and with the same weights the same response.
"""

from __future__ import annotations

import copy
import json

from hostile import GROUP_SIZE, Door, HostileWorker

from echo2.config import RolloutConfig
from echo2.rollout.collect import collect
from echo2.rollout.engine import HFEngine

ROUNDS = 40


def _refuse_and_return(door: Door, mallory: HostileWorker, lease: dict) -> None:
    """Have the push on `lease` refused without a strike (one record too many in its first group),
    then give the lease back."""
    records = [json.loads(json.dumps(r.to_dict())) for g in door.generate(lease["indices"]) for r in g]
    records.append(dict(records[0], record_id=records[0]["record_id"][::-1]))
    status, body = mallory.push(lease["lease_id"], records)
    assert status == 422 and body["error"] == "group_overflow", (status, body)
    status, _ = mallory.call(
        "POST", "/v1/lease/return", {"worker_id": mallory.worker_id, "lease_id": lease["lease_id"]}
    )
    assert status == 200


def test_a_refused_then_returned_lease_redraws_nothing(door: Door, mallory: HostileWorker):
    seeds: dict[int, set[int]] = {}
    leases = []
    for _ in range(ROUNDS):
        status, lease = mallory.lease(max_groups=1)
        assert status == 200, lease
        leases.append(lease)
        seeds.setdefault(lease["indices"][0], set()).add(lease["sampling_seed"])
        _refuse_and_return(door, mallory, lease)
    counts = {index: len(s) for index, s in seeds.items()}
    assert max(counts.values()) == 1, f"distinct seeds per prompt index: {counts}"
    first = leases[0]["indices"][0]
    assert sum(lease["indices"][0] == first for lease in leases) > 1, "the prompt was leased again"
    # what the noise gives: the same response for the prompt in every round that leased it
    cfg = RolloutConfig(max_new_tokens=4, group_size=GROUP_SIZE, temperature=1.0, sampling="gumbel")
    engine = HFEngine(copy.deepcopy(door.model), door.tokenizer, cfg)
    prompt = door.task.train_prompt(first)
    responses = {
        tuple(r.response_ids for r in collect(engine, door.task, [prompt], n=GROUP_SIZE, sampling_seed=s)[0])
        for lease in leases
        if lease["indices"][0] == first
        for s in [lease["sampling_seed"]]
    }
    assert len(responses) == 1
    assert mallory.worker_id not in door.state.intake.integrity.quarantined
