"""Asyncio helpers shared by the coordinator client and the worker's loops: a sleep, or a wait for a
coroutine, cut short by a stop event. Pure asyncio; imports no other echo2 module."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or less if `stop` is set meanwhile."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass


async def unless(stop: asyncio.Event, coro: Awaitable[Any], also: asyncio.Event | None = None) -> Any:
    """The coroutine's result, or None if `stop` (or `also`) is set first (the coroutine is then
    cancelled)."""
    task = asyncio.ensure_future(coro)
    waits = [asyncio.ensure_future(e.wait()) for e in (stop, also) if e is not None]
    try:
        await asyncio.wait({task, *waits}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        for t in (task, *waits):
            t.cancel()
        await asyncio.gather(task, *waits, return_exceptions=True)
