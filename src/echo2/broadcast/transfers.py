"""Cross-checked transfer accounts: when a reported transfer may count for a parent's score.

Pure bookkeeping with the caller's clock; no lock, no I/O. A transfer from parent P to receiver R
of version v counts (once) only when three accounts agree:

- the coordinator's own: it routed R to P for v (`routed`), so a worker can never credit itself or
  a parent it was not given;
- the receiver's: R's install report names P with the bytes it received and verified;
- the sender's: P reports the bytes it streamed to R (`POST /v1/broadcast/sent`; the learner's own
  streams are accounted by the coordinator itself).

The credit is bounded by what was observed: bytes at most the snapshot's size and the smaller of the
two accounts (which must be within a factor of 2 of each other); seconds at least the larger claim
and at least the time from the route to the first account of it, so no pair of reports can claim a
rate faster than the coordinator saw happen. Accounts that never match are dropped with the version.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

MAX_PENDING = 8192
"""Unmatched accounts kept (oldest dropped first): a flood of reports cannot grow memory."""
AGREE = 0.5
"""The smaller account must be at least this fraction of the larger."""

Key = tuple[int, str | None, str]
"""(version, parent id or None for the learner, receiver id)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Credit:
    parent_id: str | None
    receiver_id: str
    bytes: int
    seconds: float


@dataclass(slots=True)
class _Account:
    bytes: int = 0
    seconds: float = 0.0
    first_at: float = 0.0


class TransferLedger:
    def __init__(self) -> None:
        self.routed: dict[Key, float] = {}
        """When the coordinator first named the parent of each (version, parent, receiver)."""
        self.sender: dict[Key, _Account] = {}
        self.receiver: dict[Key, _Account] = {}
        self.credited: set[Key] = set()
        self.outcomes: Counter[str] = Counter()
        """credited, disputed (accounts disagree), unrouted (a parent never named), late."""

    def route(self, version: int, parent_id: str | None, receiver_id: str, now: float) -> None:
        self.routed.setdefault((version, parent_id, receiver_id), now)
        self._bound(self.routed)

    def sent(self, key: Key, nbytes: int, seconds: float, *, size: int, now: float) -> Credit | None:
        """The sender's account of one stream; the credit if the receiver's account agrees."""
        self._account(self.sender, key, nbytes, seconds, now)
        return self.settle(key, size)

    def received(self, key: Key, nbytes: int, seconds: float, *, size: int, now: float) -> Credit | None:
        """The receiver's account of one stream segment; the credit if the sender's agrees."""
        self._account(self.receiver, key, nbytes, seconds, now)
        return self.settle(key, size)

    def _account(self, book: dict[Key, _Account], key: Key, nbytes: int, seconds: float, now: float) -> None:
        if key not in self.routed:
            self.outcomes["unrouted"] += 1
            return
        if key in self.credited:
            self.outcomes["late"] += 1
            return
        acc = book.get(key)
        if acc is None:
            acc = book[key] = _Account(first_at=now)
            self._bound(book)
        acc.bytes += max(0, nbytes)
        acc.seconds += max(0.0, seconds)

    def settle(self, key: Key, size: int) -> Credit | None:
        """The credit for `key` once both accounts are in (None until then, or if they disagree);
        a key is credited at most once."""
        s, r = self.sender.get(key), self.receiver.get(key)
        if s is None or r is None or key in self.credited:
            return None
        del self.sender[key], self.receiver[key]
        self.credited.add(key)
        low, high = sorted((s.bytes, r.bytes))
        if high == 0 or low < AGREE * high:
            self.outcomes["disputed"] += 1
            return None
        observed = min(s.first_at, r.first_at) - self.routed[key]
        self.outcomes["credited"] += 1
        return Credit(
            parent_id=key[1],
            receiver_id=key[2],
            bytes=min(low, size),
            seconds=max(s.seconds, r.seconds, observed, 1e-3),
        )

    def forget(self, version: int) -> None:
        """A version is evicted: its unmatched accounts go with it."""
        for book in (self.routed, self.sender, self.receiver):
            for key in [k for k in book if k[0] == version]:
                del book[key]
        self.credited = {k for k in self.credited if k[0] != version}

    @staticmethod
    def _bound(book: dict) -> None:
        while len(book) > MAX_PENDING:
            del book[next(iter(book))]
