"""What a worker runs beside its work (rollout/membership.py: `_alongside`): heartbeats and
snapshot following end with the work, and one that fails while the work goes on is a bug that
surfaces at once, the work cancelled (and its own clean-up run)."""

from __future__ import annotations

import asyncio

import pytest

from echo2.rollout.membership import _alongside


def test_background_tasks_end_with_the_work():
    events: list[str] = []

    async def work() -> None:
        await asyncio.sleep(0)
        events.append("work done")

    async def beat() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            events.append("beat cancelled")
            raise

    asyncio.run(asyncio.wait_for(_alongside(work(), beat()), 10))
    assert events == ["work done", "beat cancelled"]


def test_a_failing_background_task_surfaces_and_the_work_cleans_up():
    events: list[str] = []

    async def work() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            events.append("leases returned")

    async def beat() -> None:
        raise RuntimeError("bug in the heartbeat")

    with pytest.raises(RuntimeError, match="bug in the heartbeat"):
        asyncio.run(asyncio.wait_for(_alongside(work(), beat()), 10))
    assert events == ["leases returned"]


def test_a_background_task_that_ends_on_stop_does_not_end_the_work():
    """On stop the heartbeats end first; the work still finishes (it returns what it holds)."""
    stop = asyncio.Event()
    events: list[str] = []

    async def work() -> None:
        await stop.wait()
        await asyncio.sleep(0.05)
        events.append("work done")

    async def beat() -> None:
        await stop.wait()

    async def scenario() -> None:
        asyncio.get_running_loop().call_later(0.01, stop.set)
        await _alongside(work(), beat())

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert events == ["work done"]
