"""The one mapping from the coordinator's domain errors (control/errors.py) to HTTP answers: each
refusal gets its status and `{"error": reason, "detail": detail}`, the reason strings of the wire."""

from __future__ import annotations

import inspect
import json

import pytest

from echo2.control import errors
from echo2.control.coordinator import STATUS, refusal
from echo2.control.errors import Reason


@pytest.mark.parametrize(
    ("error", "status", "reason"),
    [
        (errors.Unreadable("body is not JSON"), 400, "malformed"),
        (errors.UnknownWorker("who"), 404, "unknown_worker"),
        (errors.NoSnapshot("version 3 is not kept"), 404, "no_snapshot"),
        (errors.LeaseExpired("not held"), 409, "lease_expired"),
        (errors.Stale("too old"), 409, "stale"),
        (errors.Released("stop"), 410, "released"),
        (errors.Quarantined("strikes"), 403, "quarantined"),
        (errors.LeaseLimit("4 open"), 429, "lease_limit"),
        (errors.Invalid(Reason.FUTURE_VERSION, "v 9 > 0"), 422, "future_version"),
        (errors.Invalid(Reason.WRONG_SNAPSHOT, "sha"), 422, "wrong_snapshot"),
        (errors.Invalid(Reason.MALFORMED, "name: missing"), 422, "malformed"),
        (errors.InvalidBatch(Reason.WRONG_GROUP, "g9"), 422, "wrong_group"),
        (errors.InvalidBatch(Reason.TOO_LONG, "5 tokens"), 422, "too_long"),
        (errors.InvalidBatch(Reason.OUT_OF_VOCAB, "400"), 422, "out_of_vocab"),
        (errors.InvalidBatch(Reason.GROUP_OVERFLOW, "3 > 2"), 422, "group_overflow"),
        (errors.InvalidBatch("non_finite_reward", "nan"), 422, "non_finite_reward"),
    ],
)
def test_each_refusal_has_its_status_and_reason(error, status, reason):
    resp = refusal(error)
    assert resp.status == status
    assert json.loads(resp.text) == {"error": reason, "detail": error.detail}


def test_every_refusal_class_has_a_status():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.Refused)]
    assert len(classes) == 12
    for cls in classes:
        if cls is not errors.Refused:
            assert any(c in STATUS for c in cls.__mro__), f"{cls.__name__} has no HTTP status"


def test_a_refusal_needs_a_reason():
    with pytest.raises(AssertionError):
        errors.Conflict("no reason code")
