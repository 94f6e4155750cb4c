"""The long poll for publications (`GET /api/v1/published?after=V&wait=S`), served by the
coordinator (coordinator.py): it answers as soon as a version newer than `after` is published,
the run is over or the server stops, or after `wait` seconds (at most LONG_POLL_MAX). The
learner's thread wakes the waiting polls after each publication (`notify`, thread-safe).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from aiohttp import web

from echo2.wire.errors import Unreadable

LONG_POLL_MAX = 25.0
"""The longest a poll is held, whatever `wait` it asks for."""


class PublishedPoll:
    def __init__(self, state: Any) -> None:
        self.state = state  # a CoordinatorState: its shared.published_version and shared.closed
        self._event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False

    def start(self) -> None:
        """On the server's loop, before it serves."""
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        self.stopping = False

    def stop(self) -> None:
        """On the server's loop: every held poll answers now."""
        self.stopping = True
        self._wake()

    def notify(self) -> None:
        """Wake the polls (called from the learner's thread after each publication)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop is shutting down
                pass

    def _wake(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = asyncio.Event()

    async def handler(self, request: web.Request) -> web.Response:
        try:
            after = int(request.query.get("after", "-1"))
            wait = float(request.query.get("wait", "20"))
            if not math.isfinite(wait):
                raise ValueError
            wait = min(max(wait, 0.0), LONG_POLL_MAX)
        except ValueError:
            raise Unreadable("after must be an integer and wait a number") from None
        shared = self.state.shared
        try:
            async with asyncio.timeout(wait):
                while shared.published_version <= after and not (shared.closed or self.stopping):
                    await self._event.wait()
        except TimeoutError:
            pass
        return web.json_response({"version": self.state.shared.published_version})
