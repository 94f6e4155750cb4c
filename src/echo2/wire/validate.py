"""Validation at the coordinator's door: what a record, a body or a logged string may look like before
anything of the state is touched.

Pure functions over plain values: no lock, no I/O, no state. The wire models (protocol.py) check
types and simple bounds; this module checks what needs a look across fields or into numbers
(finite rewards inside the task's declared range, log-probs that are log-probabilities, masks that
are masks, no record id twice in one batch, free-form metadata of bounded depth and size) and
escapes strings before they reach a log line. The coordinator (coordinator.py) calls it for every
push and counts a refusal under the reason it returns; the coordinator state never sees a batch that
fails here. What it cannot know (the prompt the coordinator leased for a group, the reward the task
gives the response) is checked by a `Referee` (learning/verify.py) inside the state.

Every bound is a module constant, named and documented, so docs/security.md ("Validation at the door") can quote them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from echo2.config import ConfigError
from echo2.records import Trajectory

DEFAULT_REWARD_RANGE = (-1e6, 1e6)
"""Rewards a task that declares no `reward_range` may give (far from float32 overflow of the
group std, which squares them)."""
LOGPROB_TOLERANCE = 1e-3
"""A behaviour log-prob may exceed 0 by this much (rounding of log-softmax in low precision)."""
MIN_LOGPROB = -1e3
"""No sampler draws a token of probability e^-1000; lower values are fabricated, and their
importance ratio exp(logp - behaviour) would overflow."""
METADATA_DEPTH = 8
"""Nesting levels of a record's metadata (a dict at the top counts as one)."""
METADATA_NODES = 256
"""Values (containers, strings, numbers) in one record's metadata."""
METADATA_CHARS = 8192
"""Characters of all keys and strings in one record's metadata."""
SMALL_BODY = 256 * 1024
"""Bytes of a request body on every endpoint but `POST /v1/trajectories` (which has `max_body`)."""
LOG_CHARS = 200
"""Characters of one peer-supplied string in a log line."""
TEXT_ALLOWED_CONTROLS = frozenset("\t\n\r")
"""Control characters a record's strings may hold (free task text has lines and tabs); every other
C0 or C1 control character, and any lone surrogate (which no UTF-8 encoder writes, so the journal
could not store it), is refused at the door."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    """Why a batch is refused: a reason code (errors.Reason) and a detail naming the record."""

    reason: str
    detail: str


class Referee(Protocol):
    """Checks what only the task can: implemented by `TaskReferee` (learning/verify.py)."""

    def check(self, record: Trajectory, index: int) -> Problem | None:
        """The problem with `record`, generated for training prompt `index`, or None."""
        ...


# ---------------------------------------------------------------------------- strings
def printable(text: object, limit: int = LOG_CHARS) -> str:
    """`text` safe for one log line: control characters (newlines included) escaped, cut to `limit`."""
    s = str(text)
    if len(s) > limit:
        s = s[:limit] + "..."
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


def text_problem(text: str) -> str | None:
    """What makes `text` unfit to store (a lone surrogate, a control character other than tab and
    newline), named by its position and code point, or None."""
    if text.isprintable():  # the common case, in C
        return None
    for i, c in enumerate(text):
        code = ord(c)
        if 0xD800 <= code <= 0xDFFF:
            return f"lone surrogate U+{code:04X} at character {i}"
        if (code < 0x20 or 0x7F <= code <= 0x9F) and c not in TEXT_ALLOWED_CONTROLS:
            return f"control character U+{code:04X} at character {i}"
    return None


# ---------------------------------------------------------------------------- metadata
def metadata_problem(
    value: Any, *, depth: int = METADATA_DEPTH, nodes: int = METADATA_NODES, chars: int = METADATA_CHARS
) -> str | None:
    """What is wrong with a record's metadata (too deep, too many values, too long, a non-finite
    number, a string or key that `text_problem` refuses), or None. Iterative, so a hostile depth
    cannot exhaust the stack."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    seen = used = 0
    while stack:
        item, level = stack.pop()
        seen += 1
        if seen > nodes:
            return f"metadata has over {nodes} values"
        if isinstance(item, dict | list):
            if level > depth:
                return f"metadata nested deeper than {depth}"
            if isinstance(item, dict):
                used += sum(len(str(k)) for k in item)
                for k in item:
                    if isinstance(k, str) and (bad := text_problem(k)):
                        return f"metadata key {printable(k, 64)!r}: {bad}"
                stack.extend((v, level + 1) for v in item.values())
            else:
                stack.extend((v, level + 1) for v in item)
        elif isinstance(item, str):
            used += len(item)
            if bad := text_problem(item):
                return f"metadata string: {bad}"
        elif isinstance(item, float) and not math.isfinite(item):
            return "metadata holds a non-finite number"
        if used > chars:
            return f"metadata over {chars} characters"
    return None


# ---------------------------------------------------------------------------- records
def record_problem(record: Trajectory, *, reward_range: tuple[float, float]) -> Problem | None:
    """The first rule `record` breaks, or None. Lengths and a finite reward are already enforced by
    `Trajectory` itself; this adds the numbers' ranges."""
    low, high = reward_range
    lps, mask = record.behaviour_logprobs, record.loss_mask
    if (
        math.isfinite(record.reward)
        and low <= record.reward <= high
        and (
            not lps or (math.isfinite(sum(lps)) and min(lps) >= MIN_LOGPROB and max(lps) <= LOGPROB_TOLERANCE)
        )
        and set(mask) <= {0, 1}
        and record.record_id.isprintable()
        and record.group_id.isprintable()
    ):  # the common case, in C; any doubt goes through the rules below, which name the value
        return None
    where = f"record {printable(record.record_id, 64)}"
    for name in ("record_id", "group_id"):
        if bad := text_problem(getattr(record, name)):
            return Problem(reason="malformed", detail=f"{where}: {name}: {bad}")
    if not math.isfinite(record.reward):
        return Problem(reason="non_finite_reward", detail=f"{where}: reward {record.reward}")
    if not low <= record.reward <= high:
        return Problem(
            reason="reward_out_of_range",
            detail=f"{where}: reward {record.reward:g} outside [{low:g}, {high:g}]",
        )
    for lp in lps:
        if not (MIN_LOGPROB <= lp <= LOGPROB_TOLERANCE):  # NaN fails both comparisons
            return Problem(
                reason="bad_logprob",
                detail=f"{where}: behaviour log-prob {lp} outside [{MIN_LOGPROB:g}, {LOGPROB_TOLERANCE:g}]",
            )
    if any(m != 0 and m != 1 for m in mask):
        bad = next(m for m in mask if m != 0 and m != 1)
        return Problem(reason="bad_mask", detail=f"{where}: loss mask value {bad} is not 0 or 1")
    return None


def batch_problem(records: Iterable[Trajectory], *, reward_range: tuple[float, float]) -> Problem | None:
    """The first problem of a batch: a record id twice, or a record that breaks a rule."""
    ids: set[str] = set()
    for record in records:
        if record.record_id in ids:
            return Problem(
                reason="duplicate_id",
                detail=f"record id {printable(record.record_id, 64)} twice in one batch",
            )
        ids.add(record.record_id)
        problem = record_problem(record, reward_range=reward_range)
        if problem is not None:
            return problem
    return None


def reward_range(task: object) -> tuple[float, float]:
    """The rewards `task` declares it gives (`reward_range`), else `DEFAULT_REWARD_RANGE`; refuses a
    declaration that is not two finite numbers, low <= high."""
    declared = getattr(task, "reward_range", DEFAULT_REWARD_RANGE)
    try:
        low, high = (float(x) for x in declared)
    except (TypeError, ValueError):
        raise ConfigError(f"task reward_range: must be two numbers, not {declared!r}") from None
    if not (math.isfinite(low) and math.isfinite(high) and low <= high):
        raise ConfigError(f"task reward_range: must be finite with low <= high, not {declared!r}")
    return low, high


class Limits(Protocol):
    """The lease limits a record is held to (coordinator/leases.py `Limits`)."""

    reward_range: tuple[float, float]
    max_prompt_tokens: int
    max_new_tokens: int
    vocab_size: int


def token_problem(r: Trajectory, lim: Limits) -> Problem | None:
    """A record's tokens against the lease's limits: a response, lengths within them, every id in
    the vocabulary (what a tokenizer needs to decode it); None when they hold. The one statement of
    these rules: the lease check, the referee's pre-check and the resume's door all ask it."""
    where = f"record {printable(r.record_id, 64)}"
    if len(r.prompt_ids) > lim.max_prompt_tokens or len(r.response_ids) > lim.max_new_tokens:
        return Problem(
            reason="too_long",
            detail=f"{where}: {len(r.prompt_ids)} prompt / {len(r.response_ids)} response tokens",
        )
    if not r.response_ids:
        return Problem(reason="malformed", detail=f"{where}: empty response")
    tokens = r.prompt_ids + r.response_ids
    if min(tokens) < 0 or max(tokens) >= lim.vocab_size:
        return Problem(reason="out_of_vocab", detail=f"{where}: token id outside [0, {lim.vocab_size})")
    return None


def door_problem(
    lim: Limits, records: list[Trajectory], prompts: dict[str, int], referee: Referee | None
) -> Problem | None:
    """What the coordinator's door would refuse in a journalled batch (wire/validate.py, the
    lease's length and vocabulary limits, the referee), or None. Used on resume, where every
    journalled batch goes through the door again (coordinator/journal.py)."""
    ids: set[str] = set()
    for r in records:
        where = f"record {printable(r.record_id, 64)}"
        if r.record_id in ids:
            return Problem(reason="duplicate_id", detail=f"{where} twice")
        ids.add(r.record_id)
        if (problem := record_problem(r, reward_range=lim.reward_range)) is not None:
            return problem
        if (bad := metadata_problem(r.metadata)) is not None:
            return Problem(reason="malformed", detail=f"{where}: {bad}")
        if r.group_id not in prompts:
            return Problem(reason="wrong_group", detail=f"{where}: its group has no prompt index")
        if (problem := token_problem(r, lim)) is not None:
            return problem
        if referee is not None and (problem := referee.check(r, prompts[r.group_id])) is not None:
            return problem
    return None
