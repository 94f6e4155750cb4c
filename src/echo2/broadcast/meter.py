"""The receiver's judgement of its parent: `RelayMeter`, the rate a relay delivers chunk bodies at
over a sliding window, and `ParentFailed`, the report it raises (a failure reason of
docs/protocol.md and a detail). Pure: no I/O, no clock (the caller measures each piece)."""

from __future__ import annotations

from collections import deque


class ParentFailed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class RelayMeter:
    """The rate a relay delivers chunk bodies at, over the last `window_s` seconds spent waiting on
    them (a sliding window, judged once a full window is measured): waits between chunks, while the
    relay waits on its own upstream, and this worker's own download cap are not counted. Below
    `stall_bps` the relay is stalled, below `slow_bps` slow. A relay that drops from rate R0 to R1
    is caught window_s * (R0 - floor) / (R0 - R1) seconds later (a whole window if slow from the
    start)."""

    __slots__ = ("pieces", "bytes", "seconds", "stall_bps", "slow_bps", "window_s")

    def __init__(self, *, stall_bps: float, slow_bps: float, window_s: float) -> None:
        self.pieces: deque[tuple[int, float]] = deque()
        self.bytes, self.seconds = 0, 0.0
        self.stall_bps, self.slow_bps, self.window_s = stall_bps, slow_bps, window_s

    def add(self, nbytes: int, seconds: float) -> None:
        """One piece; raises ParentFailed when the last full window came in below a floor."""
        self.pieces.append((nbytes, seconds))
        self.bytes += nbytes
        self.seconds += seconds
        while self.pieces and self.seconds - self.pieces[0][1] >= self.window_s:
            b, t = self.pieces.popleft()
            self.bytes -= b
            self.seconds -= t
        if self.seconds < self.window_s:
            return
        rate = self.bytes / self.seconds
        if rate < self.stall_bps:
            raise ParentFailed("stalled", f"{rate:.0f} B/s, below the floor of {self.stall_bps:.0f} B/s")
        if rate < self.slow_bps:
            raise ParentFailed("slow", f"{rate:.0f} B/s, below the relay floor of {self.slow_bps:.0f} B/s")
