"""The coordinator's refusals, one class each, shared by both ends of the wire.

Raised by the coordinator state (registry.py, leases.py, state.py) and by the HTTP layer when a
request cannot be read; the coordinator answers each with its class's `status` and
`{"error": reason, "detail": ...}` (coordinator.py: `refusal`), and the client raises the same class
again from that answer (`from_answer`, used by wire/client.py). Each reason the server sends is
one class here, except the `Invalid` family, one class whose reason code says which rule was broken
(`INVALID`). A refusal guarantees that nothing was changed by the refused request, except the
counters and reissues that docs/protocol.md names (a stale batch's prompts are reissued).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class Reason(StrEnum):
    """Reason codes a refusal carries (docs/protocol.md)."""

    UNKNOWN_WORKER = "unknown_worker"
    RELEASED = "released"
    RUN_FINISHED = "run_finished"
    NO_SNAPSHOT = "no_snapshot"
    LEASE_EXPIRED = "lease_expired"
    STALE = "stale"
    FUTURE_VERSION = "future_version"
    WRONG_GROUP = "wrong_group"
    TOO_LONG = "too_long"
    TOO_LARGE = "too_large"
    MALFORMED = "malformed"
    OUT_OF_VOCAB = "out_of_vocab"
    GROUP_OVERFLOW = "group_overflow"
    PARTIAL_GROUP = "partial_group"
    NON_FINITE_REWARD = "non_finite_reward"
    WRONG_SNAPSHOT = "wrong_snapshot"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    # validation at the door (validate.py) and the referee (learning/verify.py)
    REWARD_OUT_OF_RANGE = "reward_out_of_range"
    BAD_LOGPROB = "bad_logprob"
    BAD_MASK = "bad_mask"
    DUPLICATE_ID = "duplicate_id"
    WRONG_PROMPT = "wrong_prompt"
    REWARD_MISMATCH = "reward_mismatch"
    LOGPROB_MISMATCH = "logprob_mismatch"
    NOT_SAMPLED = "not_sampled"
    WRONG_VERSION = "wrong_version"
    QUARANTINED = "quarantined"
    LEASE_LIMIT = "lease_limit"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    SLOT_UNPROVEN = "slot_unproven"


INVALID = frozenset(
    {
        Reason.FUTURE_VERSION,
        Reason.WRONG_GROUP,
        Reason.TOO_LONG,
        Reason.MALFORMED,
        Reason.OUT_OF_VOCAB,
        Reason.GROUP_OVERFLOW,
        Reason.PARTIAL_GROUP,
        Reason.NON_FINITE_REWARD,
        Reason.WRONG_SNAPSHOT,
        Reason.REWARD_OUT_OF_RANGE,
        Reason.BAD_LOGPROB,
        Reason.BAD_MASK,
        Reason.DUPLICATE_ID,
        Reason.WRONG_PROMPT,
        Reason.REWARD_MISMATCH,
        Reason.LOGPROB_MISMATCH,
        Reason.NOT_SAMPLED,
        Reason.WRONG_VERSION,
    }
)
"""The reasons an `Invalid` (422) carries: the request breaks a rule and will be refused again."""


class Refused(Exception):
    """A request refused with a reason; nothing was changed. Subclasses fix the reason and the HTTP
    `status` or, for the `Invalid` family, take the reason as an argument. At the client, `body` is
    the whole answer as it came (None where the exception was raised by the coordinator)."""

    reason: str = ""
    status: int = 0
    """The HTTP status the coordinator answers this refusal with."""

    def __init__(self, detail: str, *, reason: str | None = None) -> None:
        if reason is not None:
            self.reason = reason
        assert self.reason, f"{type(self).__name__} needs a reason code"
        super().__init__(f"{self.reason}: {detail}")
        self.detail = detail
        self.body: Any = None

    @classmethod
    def from_answer(cls, status: int, body: Any) -> Refused:
        """The exception for an answer received: `status` and `body` as they came (reason and
        detail read from the JSON `error` and `detail` fields, empty when absent)."""
        fields = body if isinstance(body, dict) else {}
        e = cls.__new__(cls)
        e.reason, e.detail = str(fields.get("error", "")), str(fields.get("detail", ""))
        Exception.__init__(e, f"HTTP {status}: {body}")
        e.status, e.body = status, body
        return e


class UnknownWorker(Refused):
    """Not registered, or marked lost: the worker should register again."""

    reason = Reason.UNKNOWN_WORKER
    status = 404


class Released(Refused):
    """Released by the scheduler through its provider: the worker should stop, not register again."""

    reason = Reason.RELEASED
    status = 410


class RunFinished(Released):
    """The learner finished the run: every worker call is answered so, and the worker stops (exit 0)."""

    reason = Reason.RUN_FINISHED


class Unauthorized(Refused):
    """No credential, or a wrong one: the run token for registration, a worker's own credential
    (issued at registration) for every call made as that worker."""

    reason = Reason.UNAUTHORIZED
    status = 401


class Forbidden(Refused):
    """A valid credential used for what it does not cover: the run token for a worker's call, or
    one worker's credential for a call made as another."""

    reason = Reason.FORBIDDEN
    status = 403


class SlotUnproven(Refused):
    """A registration under the name of a slot the provider started, without that slot's secret
    (identity.SLOT_SECRET_ENV): refused, and nothing in the fleet changes."""

    reason = Reason.SLOT_UNPROVEN
    status = 403


class NoSnapshot(Refused):
    """The version asked for is not (or no longer) kept, or nothing is published yet."""

    reason = Reason.NO_SNAPSHOT
    status = 404


class Conflict(Refused):
    """The request was valid once but no longer matches the state (the worker drops its work)."""

    status = 409


class LeaseExpired(Conflict):
    """The lease is not (or no longer) held by this worker; its prompts went to another one."""

    reason = Reason.LEASE_EXPIRED


class Stale(Conflict):
    """Records older than the learner's version - S; the lease's prompts are reissued."""

    reason = Reason.STALE


class Quarantined(Refused):
    """The worker's records kept failing verification: it gets no more leases and its pushes are
    refused (it stays registered and visible in /status). Not a `Forbidden`: registering again
    is no remedy, the worker stops."""

    reason = Reason.QUARANTINED
    status = 403


class LeaseLimit(Refused):
    """The worker already holds as many open leases as one worker may: it returns what it holds
    and asks again later."""

    reason = Reason.LEASE_LIMIT
    status = 429


class Invalid(Refused):
    """A request that breaks a rule (a version from the future, bytes that are not the snapshot);
    the reason code (one of `INVALID`) says which."""

    status = 422

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail, reason=reason)


class InvalidBatch(Invalid):
    """A batch of records with one bad record (the whole batch is refused); the reason code says why."""


class Unreadable(Invalid):
    """The request cannot be read at all (not JSON, a query parameter of the wrong type)."""

    reason = Reason.MALFORMED
    status = 400

    def __init__(self, detail: str) -> None:
        Refused.__init__(self, detail)


class TooLarge(Invalid):
    """The body is over the size the call allows."""

    reason = Reason.TOO_LARGE
    status = 413

    def __init__(self, detail: str) -> None:
        Refused.__init__(self, detail)


class NotFound(Refused):
    """No such route."""

    reason = Reason.NOT_FOUND
    status = 404


class MethodNotAllowed(Refused):
    """The route exists, not with this method."""

    reason = Reason.METHOD_NOT_ALLOWED
    status = 405


_ONE_CLASS: tuple[type[Refused], ...] = (
    UnknownWorker,
    Released,
    RunFinished,
    Unauthorized,
    Forbidden,
    SlotUnproven,
    NoSnapshot,
    LeaseExpired,
    Stale,
    Quarantined,
    LeaseLimit,
    Unreadable,
    TooLarge,
    NotFound,
    MethodNotAllowed,
)
BY_ANSWER: dict[tuple[int, str], type[Refused]] = {
    **{(cls.status, cls.reason): cls for cls in _ONE_CLASS},
    **{(Invalid.status, reason): Invalid for reason in INVALID},
}
"""The class of each (status, reason) the coordinator answers with."""
BY_STATUS: dict[int, type[Refused]] = {
    400: Invalid,
    401: Unauthorized,
    403: Forbidden,
    409: Conflict,
    410: Released,
    413: Invalid,
    422: Invalid,
    429: LeaseLimit,
}
"""The class of an answer whose reason is not known here (a newer coordinator), by status."""


def from_answer(status: int, body: Any) -> Refused:
    """The refusal an error answer (4xx) stands for: its own class by status and reason, else by status."""
    reason = body.get("error", "") if isinstance(body, dict) else ""
    cls = BY_ANSWER.get((status, reason)) or BY_STATUS.get(status, Refused)
    return cls.from_answer(status, body)
