"""The pure identity rules (wire/identity.py) and transfer cross-check (broadcast/transfers.py)."""

from __future__ import annotations

import pytest

from echo2.broadcast.transfers import MAX_PENDING, TransferLedger
from echo2.wire import identity


def test_credentials_name_their_worker_and_only_their_secret_matches():
    secret = identity.new_secret()
    cred = identity.credential("abc123", secret)
    assert identity.split(cred) == ("abc123", secret)
    assert identity.matches(secret, identity.digest(secret))
    assert not identity.matches(secret + "x", identity.digest(secret))
    assert not identity.matches(secret, b""), "no digest: nothing matches"
    for bad in ("", "abc", ".x", "abc.", "Bearer"):
        assert identity.split(bad) == ("", "")


def test_fingerprints_match_by_prefix_of_16_or_more_or_the_key_itself():
    key = "ab" * 32
    fp = identity.fingerprint(key)
    assert len(fp) == 64
    assert identity.same_fingerprint(fp, key) and identity.same_fingerprint(fp[:16].upper(), key)
    assert identity.same_fingerprint(key, key)
    assert not identity.same_fingerprint(fp[:15], key)
    assert not identity.same_fingerprint(identity.fingerprint("cd" * 32), key)


@pytest.mark.parametrize(
    ("advertised", "observed", "same"),
    [
        ("127.0.0.1", "127.0.0.1", True),
        ("127.0.0.1", "::ffff:127.0.0.1", True),
        ("[::1]", "::1", True),
        ("10.0.0.2", "127.0.0.1", False),
        ("localhost", "127.0.0.1", False),
        ("127.0.0.1", "", False),
    ],
)
def test_a_relay_host_is_the_observed_address_or_not(advertised, observed, same):
    assert identity.same_host(advertised, observed) is same


def test_a_transfer_needs_a_route_and_both_accounts():
    led = TransferLedger()
    key = (0, "p", "r")
    assert led.received(key, 100, 1.0, size=100, now=5.0) is None
    assert led.outcomes["unrouted"] == 1, "no route: no account kept"
    led.route(0, "p", "r", now=10.0)
    assert led.received(key, 100, 0.5, size=100, now=11.0) is None
    credit = led.sent(key, 100, 0.25, size=100, now=11.5)
    assert credit is not None and credit.parent_id == "p" and credit.bytes == 100
    assert credit.seconds == 1.0, "no faster than the route-to-first-account time"
    assert led.sent(key, 100, 0.25, size=100, now=12.0) is None and led.outcomes["late"] == 1


def test_accounts_that_disagree_or_overclaim_are_bounded():
    led = TransferLedger()
    led.route(0, "p", "r", now=0.0)
    led.received((0, "p", "r"), 10**9, 1.0, size=100, now=1.0)
    credit = led.sent((0, "p", "r"), 10**9, 1.0, size=100, now=1.0)
    assert credit.bytes == 100, "never more than the snapshot"
    led.route(1, "p", "q", now=0.0)
    led.received((1, "p", "q"), 1000, 1.0, size=1000, now=1.0)
    assert led.sent((1, "p", "q"), 100, 1.0, size=1000, now=1.0) is None
    assert led.outcomes["disputed"] == 1


def test_the_ledger_forgets_evicted_versions_and_stays_bounded():
    led = TransferLedger()
    for i in range(MAX_PENDING + 10):
        led.route(i % 3, "p", f"r{i}", now=0.0)
    assert len(led.routed) == MAX_PENDING
    led.forget(0)
    assert all(k[0] != 0 for k in led.routed)
