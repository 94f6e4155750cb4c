"""The coordinator's refusals as domain errors: what was refused and why, never how it travels.

Raised by the coordinator state (registry.py, leases.py, state.py) and by the HTTP layer when a
request cannot be read. Each carries a reason code (the wire's `error` field, docs/protocol.md) and
a human-readable detail. Knows no HTTP: the one table from error class to status code lives in
coordinator.py (`STATUS`). A refusal guarantees that nothing was changed by the refused request,
except the counters and reissues that docs/protocol.md names (a stale batch's prompts are reissued).
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Reason codes a refusal carries (docs/protocol.md)."""

    UNKNOWN_WORKER = "unknown_worker"
    RELEASED = "released"
    NO_SNAPSHOT = "no_snapshot"
    LEASE_EXPIRED = "lease_expired"
    STALE = "stale"
    FUTURE_VERSION = "future_version"
    WRONG_GROUP = "wrong_group"
    TOO_LONG = "too_long"
    MALFORMED = "malformed"
    OUT_OF_VOCAB = "out_of_vocab"
    GROUP_OVERFLOW = "group_overflow"
    NON_FINITE_REWARD = "non_finite_reward"
    WRONG_SNAPSHOT = "wrong_snapshot"
    # validation at the door (validate.py) and the referee (learning/verify.py)
    REWARD_OUT_OF_RANGE = "reward_out_of_range"
    BAD_LOGPROB = "bad_logprob"
    BAD_MASK = "bad_mask"
    DUPLICATE_ID = "duplicate_id"
    WRONG_PROMPT = "wrong_prompt"
    REWARD_MISMATCH = "reward_mismatch"
    LOGPROB_MISMATCH = "logprob_mismatch"
    QUARANTINED = "quarantined"
    LEASE_LIMIT = "lease_limit"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"


class Refused(Exception):
    """A request refused with a reason; nothing was changed. Subclasses fix the reason or, for the
    `Invalid` family, take it as an argument."""

    reason: str = ""

    def __init__(self, detail: str, *, reason: str | None = None) -> None:
        if reason is not None:
            self.reason = reason
        assert self.reason, f"{type(self).__name__} needs a reason code"
        super().__init__(f"{self.reason}: {detail}")
        self.detail = detail


class UnknownWorker(Refused):
    """Not registered, or marked lost: the worker should register again."""

    reason = Reason.UNKNOWN_WORKER


class Released(Refused):
    """Released by the scheduler through its provider: the worker should stop, not register again."""

    reason = Reason.RELEASED


class NoSnapshot(Refused):
    """The version asked for is not (or no longer) kept, or nothing is published yet."""

    reason = Reason.NO_SNAPSHOT


class Conflict(Refused):
    """The request was valid once but no longer matches the state (the worker drops its work)."""


class LeaseExpired(Conflict):
    """The lease is not (or no longer) held by this worker; its prompts went to another one."""

    reason = Reason.LEASE_EXPIRED


class Stale(Conflict):
    """Records older than the learner's version - S; the lease's prompts are reissued."""

    reason = Reason.STALE


class Quarantined(Refused):
    """The worker's records kept failing verification: it gets no more leases and its pushes are
    refused (it stays registered and visible in /status)."""

    reason = Reason.QUARANTINED


class LeaseLimit(Conflict):
    """The worker already holds as many open leases as one worker may."""

    reason = Reason.LEASE_LIMIT


class Invalid(Refused):
    """A request that breaks a rule (a version from the future, bytes that are not the snapshot);
    the reason code says which."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail, reason=reason)


class InvalidBatch(Invalid):
    """A batch of records with one bad record (the whole batch is refused); the reason code says why."""


class Unreadable(Refused):
    """The request cannot be read at all (not JSON, a query parameter of the wrong type)."""

    reason = Reason.MALFORMED
