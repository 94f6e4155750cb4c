"""The coordinator's reissue queue: prompts to generate again, lowest index first. Pure."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator


class PromptQueue:
    """The prompts to generate again (expired, returned or stale leases, evicted groups, lost
    workers), handed out lowest index first. A FIFO queue let a prompt put back twice fall behind a
    later one put back once between: at S = 0 a lone worker whose pre-generated leases were refused
    stale generated step k + 1's prompts before step k's, so the learner trained prompts 8-9 at step
    3 where the in-process loop trains 6-7 (tests/e2e/test_workers.py's parity test, which failed
    so in whole-suite runs). By index, every interleaving of refusals gives the learner the prompts
    in the order the in-process loop takes them. Deque-like: `extend`, `popleft`, `clear`,
    iteration in index order."""

    __slots__ = ("_heap",)

    def __init__(self, indices: Iterable[int] = ()) -> None:
        self._heap: list[int] = list(indices)
        heapq.heapify(self._heap)

    def extend(self, indices: Iterable[int]) -> None:
        for i in indices:
            heapq.heappush(self._heap, i)

    def popleft(self) -> int:
        return heapq.heappop(self._heap)

    def clear(self) -> None:
        self._heap.clear()

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._heap))

    def __len__(self) -> int:
        return len(self._heap)
