"""The reissue queue hands prompts out lowest index first (coordinator/prompt_queue.py), whatever
order leases were put back in.

The interleaving below is the one the journal of a failed whole-suite run showed
(tests/e2e/test_workers.py::test_one_worker_with_s0_matches_the_in_process_loop, reward/mean at
step 3: 0.357 against 0.322): at S = 0 a lone worker pre-generates ahead of the learner, and its
leases come back stale or evicted at each version. With a FIFO queue step 3 trained prompts 8-9;
the in-process loop trains 6-7.
"""

from __future__ import annotations

from support import LIMITS

from echo2.coordinator.leases import Leases, Work
from echo2.coordinator.prompt_queue import PromptQueue
from echo2.data.buffer import ReplayBuffer


def _leases() -> Leases:
    work = Work(
        buffer=ReplayBuffer(staleness=0, group_size=2),
        limits=LIMITS,
        group_id_of=lambda i: f"g{i}",
        groups_per_step=2,
    )
    return Leases(work, lease_timeout=30.0)


def test_a_prompt_put_back_twice_does_not_fall_behind_a_later_one():
    ls = _leases()
    take = lambda: ls.issue(f"l{len(ls.leases)}-{ls.reissued}", "w", max_groups=2, now=0.0)  # noqa: E731
    for _ in range(2):  # steps 0 and 1 trained their prompts
        ls._close(take(), None)
    a, b, c = take(), take(), take()  # pre-generated at version 1: prompts 4-5, 6-7, 8-9
    assert [a.indices, b.indices, c.indices] == [(4, 5), (6, 7), (8, 9)]
    ls.put_back(a)  # 4-5 and 6-7 were evicted when the learner moved on; 8-9 came back stale after
    ls.put_back(b)
    ls.put_back(c)
    step2 = take()
    assert step2.indices == (4, 5)
    ls._close(step2, None)
    again = take()
    assert again.indices == (6, 7)
    ls.put_back(again)  # stale once more: the learner moved on while it was generated
    assert take().indices == (6, 7), "step 3 trains 6-7, as the in-process loop does (FIFO gave 8-9)"


def test_the_queue_is_deque_like_in_index_order():
    q = PromptQueue([5, 1])
    q.extend([3, 0])
    assert list(q) == [0, 1, 3, 5] and len(q) == 4 and q
    assert q.popleft() == 0
    q.clear()
    assert not q and list(q) == []
