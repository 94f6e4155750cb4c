"""The endpoint fuzz (issue 12), worker calls: register, heartbeat, lease, return, push.

What every answer must be, and the invariant after each run: fuzz_wire.py.
"""

from __future__ import annotations

import json
import math
import uuid
from typing import Any

from fuzz_values import (
    INF,
    NAN,
    NASTY_FLOATS,
    NASTY_INTS,
    NASTY_STRINGS,
    POSTS,
    RATES,
    SCALARS,
    TEXTS,
    VALUES,
    VERSIONS,
    body_or_junk,
    choose,
    ids,
    mostly,
    nested,
)
from fuzz_wire import (
    Probe,
    cast,
    run,
)
from hostile import GROUP_SIZE, TOKEN, Door
from hypothesis import strategies as st

from echo2.rollout.engine import encode_prompt


# ---------------------------------------------------------------------------- worker calls
def test_register(fdoor: Door):
    probe = Probe(fdoor)
    hosts = st.sampled_from(
        ["127.0.0.1", "::1", "::ffff:127.0.0.1", "[::1]", "localhost", "10.0.0.1", "169.254.169.254"]
    )
    good = {
        "name": mostly(st.just("w"), TEXTS),
        "hardware": TEXTS,
        "price_per_hour": RATES,
        "inbound": st.booleans(),
        "relay_port": mostly(st.none(), st.integers(-1, 70_000)),
        "relay_host": mostly(st.none(), hosts, st.text(alphabet="0123456789abcdef.:[]-", max_size=40)),
        "throughput": RATES,
    }

    bodies = body_or_junk(good)
    auths = st.sampled_from([f"Bearer {TOKEN}"] * 4 + [f"Bearer {TOKEN}x", "Bearer", ""])

    def one(data: st.DataObject) -> None:
        body, raw = data.draw(bodies)
        auth = data.draw(auths)
        answer, reply = probe("POST", POSTS["register"], body=body, raw=raw, auth=auth)
        if answer.status == 200:
            assert reply["credential"].startswith(reply["worker_id"] + ".")
            info = fdoor.state.registry.workers[reply["worker_id"]]
            assert not any(ch < " " or ch == "\x7f" for ch in info.name + info.hardware), info
            assert info.relay_url is None or "127.0.0.1" in info.relay_url or "::1" in info.relay_url

    run(one)
    assert probe.accepted and probe.refused
    probe.finish()


def test_heartbeat(fdoor: Door):
    c, probe = cast(fdoor), Probe(fdoor)
    good = {"worker_id": ids(c.me, c.victim.worker_id), "version": VERSIONS, "throughput": RATES}

    bodies = body_or_junk(good)

    def one(data: st.DataObject) -> None:
        body, raw = data.draw(bodies)
        answer, reply = probe("POST", POSTS["heartbeat"], body=body, raw=raw, auth=c.auth(), who=c.me)
        if answer.status == 200:
            w = fdoor.state.registry.workers[c.me]
            assert reply["published_version"] == 0 and -1 <= w.version <= 0
            assert math.isfinite(w.throughput) and 0 <= w.throughput <= 1e9

    run(one)
    assert probe.accepted and probe.refused
    probe.finish()


def test_lease(fdoor: Door):
    c, probe = cast(fdoor), Probe(fdoor)
    good = {
        "worker_id": ids(c.me, c.victim.worker_id),
        "version": VERSIONS,
        "max_groups": mostly(st.integers(1, 4), st.integers(-5, 5000)),
    }

    bodies = body_or_junk(good)

    def one(data: st.DataObject) -> None:
        body, raw = data.draw(bodies)
        answer, reply = probe("POST", POSTS["lease"], body=body, raw=raw, auth=c.auth(), who=c.me)
        if answer.status == 200:
            assert 1 <= len(reply["indices"]) <= fdoor.state.intake.max_groups_per_lease
            assert fdoor.state.intake.ingestion.leases[reply["lease_id"]].worker_id == c.me
            back = {"worker_id": c.me, "lease_id": reply["lease_id"]}  # so the next one may be granted
            assert c.mallory.call("POST", POSTS["return_lease"], back)[0] == 200

    run(one)
    assert probe.accepted and probe.refused
    probe.finish()


HELD = "<held lease>"
"""Stands for the lease mallory holds at the time (a strategy is built once, the lease changes)."""


def test_return_lease(fdoor: Door):
    c, probe = cast(fdoor), Probe(fdoor)
    held: list[str] = []
    leases = mostly(st.just(HELD), st.sampled_from([c.victim_lease, "nolease", HELD + "x"]), TEXTS)
    bodies = body_or_junk({"worker_id": ids(c.me, c.victim.worker_id), "lease_id": leases})

    def one(data: st.DataObject) -> None:
        if not held:
            status, lease = c.mallory.lease(max_groups=1)
            assert status == 200, lease
            held.append(lease["lease_id"])
        body, raw = data.draw(bodies)
        if isinstance(body, dict) and body.get("lease_id") == HELD:
            body["lease_id"] = held[0]
        answer, _ = probe("POST", POSTS["return_lease"], body=body, raw=raw, auth=c.auth(), who=c.me)
        if answer.status == 200 and held[0] not in fdoor.state.intake.ingestion.leases:
            held.clear()
        assert c.victim_lease in fdoor.state.intake.ingestion.leases, "mallory returned the victim's lease"

    run(one)
    assert probe.accepted and probe.refused
    probe.finish()


INVERT = "<1 - reward>"
SHORT_INTS = st.one_of(st.integers(-(2**70), 2**70), st.integers(-3, 200))
SEMANTIC: dict[str, st.SearchStrategy] = {
    "reward": st.one_of(st.sampled_from([*NASTY_FLOATS, INVERT, 0.5, 1.0, 0.0, 1.5, -0.5]), st.floats()),
    "behaviour_logprobs": st.lists(
        st.one_of(st.sampled_from([*NASTY_FLOATS, 0.0, 1e-3, 2e-3, -1e3, -1001.0]), st.floats()),
        min_size=4,
        max_size=4,
    ).map(lambda v: ("same length", v)),
    "loss_mask": st.lists(st.sampled_from([0, 1, 2, -1, 10**6, True, 1.0]), min_size=4, max_size=4).map(
        lambda v: ("same length", v)
    ),
    "prompt_ids": st.one_of(
        st.sampled_from(["<eval prompt>", "<unleased prompt>", [5] * 70_000]),
        st.lists(SHORT_INTS, max_size=8),
    ),
    "response": st.lists(SHORT_INTS, max_size=6),
    "version": st.one_of(st.integers(0, 3), st.sampled_from(NASTY_INTS)),
    "group_id": st.one_of(st.sampled_from(["<victim group>", "g-other"]), st.text(min_size=1, max_size=8)),
    "metadata": st.one_of(
        st.sampled_from(
            [{"correct": True}, {"correct": False}, {"deep": nested(900)}, {"n": NAN}, {"k": "x" * 9000}]
        ),
        st.dictionaries(st.text(max_size=8), SCALARS, max_size=4),
    ),
}
"""Values of a record field's own type that a hostile worker might send (`<...>`: filled in when
the batch is made)."""
MUTATIONS: dict[str, st.SearchStrategy] = {
    **{name: choose((4, strategy), (1, VALUES)) for name, strategy in SEMANTIC.items()},
    "drop": st.integers(0, 8),  # a field left out
    "extra": st.dictionaries(st.text(max_size=8), VALUES, min_size=1, max_size=2),
}
"""What a record's fields may be replaced with: four times in five a value of the field's type."""
SEEDS = [
    ("reward", NAN),
    ("reward", -INF),
    ("reward", 1e39),
    ("reward", INVERT),  # a forged reward: the referee re-scores the response
    ("behaviour_logprobs", ("same length", [NAN] * 4)),
    ("behaviour_logprobs", ("same length", [50.0] * 4)),
    ("behaviour_logprobs", ("same length", [-1e30] * 4)),
    ("loss_mask", ("same length", [2] * 4)),
    ("loss_mask", ("same length", [-1] * 4)),
    ("prompt_ids", "<eval prompt>"),  # a held-out evaluation problem under a leased group
    ("prompt_ids", "<unleased prompt>"),
    ("response", [2**40]),  # out of the vocabulary: refused before the referee decodes it
    ("response", [-1, 5]),
    ("version", 999),
    ("group_id", "<victim group>"),
    ("metadata", {"deep": nested(900)}),
    ("metadata", {"correct": "forged"}),
]
"""One record's attack each, sent before the generated pushes (the attacks of issue 12)."""
RECORD_PLANS = st.tuples(
    st.integers(0, 3),  # which honest record of the lease it starts from
    st.sampled_from(["fresh", "fresh", "fresh", "fresh", "stored", "same", "text"]),  # its record id
    choose(  # a fresh id, drawn (so two honest batches are two examples), or any text
        (3, st.uuids().map(lambda u: u.hex)),
        (1, st.text(min_size=1, max_size=64)),
        (1, st.sampled_from(NASTY_STRINGS)),
    ),
    choose(
        (1, st.just(())),
        (1, st.lists(st.sampled_from(sorted(MUTATIONS)), min_size=1, max_size=2, unique=True)),
    ).flatmap(lambda names: st.tuples(*(st.tuples(st.just(n), MUTATIONS[n]) for n in names))),
)
"""How one record of a push is made: an honest record, one time in two with a field or two
replaced."""


def test_push(fdoor: Door):
    """Pushes made of the honest records for mallory's own lease, each with hostile fields."""
    c, probe = cast(fdoor), Probe(fdoor)
    task, tok = fdoor.task, fdoor.tokenizer
    held: dict[str, Any] = {}
    prompts = {
        "<eval prompt>": encode_prompt(tok, task.eval_prompts(1)[0]),  # a held-out evaluation problem
        "<unleased prompt>": encode_prompt(tok, task.train_prompt(10**6)),
    }

    def record(plan: tuple, stored: list[str]) -> dict:
        pick, id_mode, drawn_id, mutations = plan
        r = json.loads(json.dumps(held["records"][pick % len(held["records"])]))
        n = len(r["response_ids"])
        r["record_id"] = {
            "fresh": drawn_id if len(drawn_id) == 32 else uuid.uuid4().hex,
            "stored": stored[pick % len(stored)] if stored else drawn_id,
            "same": held["records"][0]["record_id"],
            "text": drawn_id,
        }[id_mode]
        for name, value in mutations:
            if name == "response" and isinstance(value, list):  # lengths agree: the referee sees it
                r.update(
                    response_ids=value, behaviour_logprobs=[-0.5] * len(value), loss_mask=[1] * len(value)
                )
            elif name == "response":
                r["response_ids"] = value
            elif name == "drop":
                r.pop(sorted(r)[value % len(r)])
            elif name == "extra":
                r.update(value)
            elif isinstance(value, tuple):  # ("same length", values)
                r[name] = value[1][:n]
            elif value == INVERT:
                r["reward"] = 1.0 - r["reward"]
            elif isinstance(value, str) and value in prompts:
                r[name] = prompts[value]
            elif value == "<victim group>":
                r[name] = c.victim_groups[0]
            else:
                r[name] = value
        return r

    good = {
        "worker_id": ids(c.me, c.victim.worker_id),
        "lease_id": mostly(st.just(HELD), st.sampled_from([c.victim_lease, "nolease"]), TEXTS),
        "records": choose(
            (8, st.lists(RECORD_PLANS, min_size=1, max_size=3).map(lambda p: ("plans", p))),
            (1, st.sampled_from([[], "<4,400 records>"])),
            (1, VALUES),
        ),
    }
    bodies = body_or_junk(good, hits=(0, 0, 0, 0, 1))  # most pushes get as far as their records

    def one(data: st.DataObject) -> None:
        push(*data.draw(bodies))

    def push(body: Any, raw: bytes | None) -> None:
        if fdoor.state.intake.ingestion.leases.get(held.get("lease_id", "")) is None:  # none yet, or completed
            lease_id, records = fdoor.honest_lease(c.mallory)
            held.update(lease_id=lease_id, records=records)
        if isinstance(body, dict):
            if body.get("lease_id") == HELD:
                body["lease_id"] = held["lease_id"]
            stored = sorted(fdoor.state.intake.buffer._seen)[-8:]
            if isinstance(body.get("records"), tuple):
                body["records"] = [record(plan, stored) for plan in body["records"][1]]
            elif body.get("records") == "<4,400 records>":
                body["records"] = [record((i, "fresh", "", ()), stored) for i in range(4)] * 1100
        answer, reply = probe("POST", POSTS["push"], body=body, raw=raw, auth=c.auth(), who=c.me)
        if answer.status == 200:
            assert reply["accepted"] + reply["duplicates"] == len(body["records"])
            if reply["accepted"]:
                settle()

    def settle() -> None:
        """Mallory completes her lease with honest records (no group is left half stored, so the
        next pushes meet the record checks, not `group_overflow`); the learner takes what is done."""
        state = fdoor.state
        lease = state.intake.ingestion.leases.get(held["lease_id"])
        if lease is not None:
            rest = []
            for gid in sorted(lease.group_ids - lease.done_groups):
                missing = GROUP_SIZE - state.intake.buffer.group_count(gid)
                rest += [
                    dict(r, record_id=uuid.uuid4().hex) for r in held["records"] if r["group_id"] == gid
                ][:missing]
            status, reply = c.mallory.push(held["lease_id"], rest)
            assert status == 200 and reply["accepted"] == len(rest), reply
        ready = state.intake.buffer.num_ready_groups()
        if ready:
            taken.extend(state.intake.take_groups(ready, timeout=5.0)[0])

    taken: list[list] = []
    for name, value in SEEDS:  # each known attack once, whatever hypothesis draws
        push(
            {"worker_id": c.me, "lease_id": HELD, "records": ("plans", [(0, "fresh", "", ((name, value),))])},
            None,
        )
    assert probe.accepted == 0 and probe.refused == len(SEEDS)
    run(one)
    assert probe.accepted and probe.refused
    for group in taken + list(fdoor.state.intake.buffer._groups.values()):  # what was stored, the door admits
        for r in group:
            assert 0.0 <= r.reward <= 1.0 and all(-1e3 <= lp <= 1e-3 for lp in r.behaviour_logprobs)
            assert set(r.loss_mask) <= {0, 1}
            assert all(0 <= t < len(tok) for t in r.prompt_ids + r.response_ids)
    probe.finish()
