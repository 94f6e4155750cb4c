"""The one refusal hierarchy (wire/errors.py) over the wire and back: each refusal gets its class's
status and `{"error": reason, "detail": detail}` from the coordinator, and the client raises that
same class again from the answer, for every reason the coordinator sends."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

from echo2.coordinator.http import refusal
from echo2.wire import client, errors
from echo2.wire.errors import INVALID, Reason


@pytest.mark.parametrize(
    ("error", "status", "reason"),
    [
        (errors.Unreadable("body is not JSON"), 400, "malformed"),
        (errors.Unauthorized("wrong credential"), 401, "unauthorized"),
        (errors.Forbidden("not yours"), 403, "forbidden"),
        (errors.UnknownWorker("who"), 404, "unknown_worker"),
        (errors.NoSnapshot("version 3 is not kept"), 404, "no_snapshot"),
        (errors.LeaseExpired("not held"), 409, "lease_expired"),
        (errors.Stale("too old"), 409, "stale"),
        (errors.Released("stop"), 410, "released"),
        (errors.RunFinished("over"), 410, "run_finished"),
        (errors.TooLarge("65 MiB"), 413, "too_large"),
        (errors.NotFound("GET /v1/nothing"), 404, "not_found"),
        (errors.MethodNotAllowed("GET /v1/lease"), 405, "method_not_allowed"),
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


CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.Refused)]
OWN_REASON = [c for c in CLASSES if c is not errors.Refused and "reason" in vars(c)]
"""The classes that fix their reason: one reason each."""


def test_every_refusal_class_has_a_status():
    for cls in CLASSES:
        if cls is not errors.Refused:
            assert 400 <= cls.status < 500, f"{cls.__name__} has no HTTP status"


def test_every_reason_has_its_class():
    """A reason is either one class's own, or one the `Invalid` family carries (malformed is both:
    400 for a body that cannot be read, 422 for one that breaks the schema)."""
    owners = [c.reason for c in OWN_REASON]
    assert len(owners) == len(set(owners)), "two classes with one reason"
    assert set(owners) | INVALID == set(Reason)
    assert set(owners) & INVALID == {Reason.MALFORMED}


def round_trip(error: errors.Refused) -> errors.Refused:
    """What the client raises for the coordinator's answer to `error`."""
    resp = refusal(error)
    return client.refusal(resp.status, json.loads(resp.text))


@pytest.mark.parametrize("cls", OWN_REASON, ids=lambda c: c.reason)
def test_a_refusal_arrives_at_the_client_as_its_own_class(cls):
    sent = cls("why")
    got = round_trip(sent)
    assert type(got) is cls
    assert (got.status, got.reason, got.detail) == (cls.status, cls.reason, "why")
    assert got.body == {"error": cls.reason, "detail": "why"}


@pytest.mark.parametrize("reason", sorted(INVALID))
@pytest.mark.parametrize("cls", [errors.Invalid, errors.InvalidBatch])
def test_an_invalid_request_arrives_as_invalid_with_its_reason(cls, reason):
    got = round_trip(cls(reason, "which rule"))
    assert type(got) is errors.Invalid
    assert (got.status, got.reason, got.detail) == (422, reason, "which rule")


@pytest.mark.parametrize(
    ("status", "body", "cls"),
    [
        (409, {"error": "newer_conflict", "detail": ""}, errors.Conflict),
        (403, {"error": "newer_rule", "detail": ""}, errors.Forbidden),
        (422, {"error": "newer_check"}, errors.Invalid),
        (429, {"error": "slow_down"}, errors.LeaseLimit),
        (404, {"error": "quarantined"}, errors.Refused),  # a reason at the wrong status is not trusted
        (418, "teapot", errors.Refused),
    ],
)
def test_an_unknown_reason_falls_back_by_status(status, body, cls):
    got = client.refusal(status, body)
    assert type(got) is cls and (got.status, got.body) == (status, body)


@pytest.mark.parametrize("status", [500, 502, 503])
def test_a_5xx_is_a_transient_server_error(status):
    got = client.refusal(status, {"error": "timeout", "detail": ""})
    assert type(got) is client.ServerError and client.is_transient(got)
    assert not client.is_transient(client.refusal(429, {"error": "lease_limit"}))


def test_a_refusal_needs_a_reason():
    with pytest.raises(AssertionError):
        errors.Conflict("no reason code")


def test_the_refusal_table_in_the_protocol_doc_matches_the_classes():
    """docs/protocol.md's table: each row's status is that of the classes it names, their reasons are
    the ones it lists, and every refusal class is in it."""
    doc = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    rows = [line.split(" | ") for line in doc.splitlines() if re.match(r"\| \d{3} \| `", line)]
    named = set()
    for status, classes, reasons, _ in rows:
        for name in re.findall(r"`(\w+)`", classes.split("(")[0]):
            cls = getattr(errors, name)
            named.add(cls)
            assert cls.status == int(status.strip("| ")), name
            if "reason" in vars(cls):
                assert f"`{cls.reason}`" in reasons, name
        if "Invalid" in classes and "Unreadable" not in classes and "TooLarge" not in classes:
            assert set(re.findall(r"`(\w+)`", reasons)) - {"INVALID"} == INVALID
    assert named == set(CLASSES) - {errors.Refused}
