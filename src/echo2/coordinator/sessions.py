"""One credential, one client (issue 41 item 6): the request numbers a worker's client puts on
every call that acts as the worker (heartbeat, lease, push, route and the reports: the server's
WORKER_CALLS; reads such as chunk streams and manifests are not numbered) as `X-Echo2-Seq`
(wire/client.py: one counter per client, a fresh number per attempt, so a retry is never a
repeat), and the window the coordinator admits them in. Requests of one client travel on several connections at once and may arrive out of
order, so a number is admitted when it is new and not more than WINDOW below the highest seen. A
copy of the credential used beside its worker has its own counter: the first number it sends
repeats one, is too old, or jumps ahead so that the worker's next one is too old. Either way the
two clients cannot go on together unnoticed, and the coordinator revokes the credential
(coordinator/state.py: `CoordinatorState.check_session`).

A credential's first call decides whether it is numbered: once a numbered call was admitted, an
unnumbered one is a copy too. (Clients that never number, e.g. tests speaking raw HTTP, keep
working unchecked; every `echo2 worker` numbers.) Pure: no I/O, no clock, no lock."""

from __future__ import annotations

from echo2.wire.identity import SEQ_HEADER

WINDOW = 4096
"""How far below the highest number seen a request may arrive (requests in flight at once, with
retries, stay far under it)."""
MAX_SEQ = 2**63 - 1


def parse_seq(value: str | None) -> int | None:
    """The header's number; None when absent; ValueError when it is not a decimal in [0, MAX_SEQ]."""
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()) or len(value) > 19 or int(value) > MAX_SEQ:
        raise ValueError(f"{SEQ_HEADER} must be a decimal integer in [0, {MAX_SEQ}]")
    return int(value)


class SeqWindow:
    """The numbers one credential's client has used."""

    __slots__ = ("high", "seen")

    def __init__(self) -> None:
        self.high = -1
        self.seen: set[int] = set()

    def admit(self, n: int | None) -> str | None:
        """None when a request numbered `n` (None: unnumbered) may be this credential's client's;
        otherwise why it cannot be (and nothing changes)."""
        if n is None:
            return (
                "an unnumbered call with a credential whose client numbers its calls"
                if self.high >= 0
                else None
            )
        if n in self.seen:
            return f"request number {n} used twice"
        if n <= self.high - WINDOW:
            return f"request number {n} is more than {WINDOW} below the highest seen ({self.high})"
        self.seen.add(n)
        if n > self.high:
            self.high = n
            if len(self.seen) > 2 * WINDOW:
                self.seen = {m for m in self.seen if m > self.high - WINDOW}
        return None
