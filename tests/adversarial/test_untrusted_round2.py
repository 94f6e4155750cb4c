"""Issue 22, round 2 of untrusted workers: text at the door, the per-token log-prob check, the
version a record is checked against, the poker replay's token rules, the worker-sent `grouping`,
and the journal a resumed learner trusts. Each test fails on commit 97ea5ef."""

from __future__ import annotations

import pytest
from hostile import Door, HostileWorker


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
    door.state.journal = lambda records, prompts: journalled.append(records)
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
