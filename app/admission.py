"""Backpressure and draining: which requests may generate now, which wait, which are refused."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from app.errors import ApiError

Release = Callable[[], None]


class Admission:
    """``max_active`` generate at once, ``max_queued`` wait ≤ ``queue_timeout_s`` (beyond: 429); after
    ``start_drain``: 503, streams learn their deadline."""

    def __init__(self, max_active: int, max_queued: int, queue_timeout_s: float) -> None:
        self.max_active, self.max_queued, self.queue_timeout_s = max_active, max_queued, queue_timeout_s
        self._slots = asyncio.Semaphore(max_active)
        self.active = 0
        self.queued = 0
        self.rejected = 0  # 429s given
        self.drain_deadline: float | None = None  # time.monotonic() by which open streams end

    @property
    def is_draining(self) -> bool:
        return self.drain_deadline is not None

    def drain_expired(self) -> bool:
        return self.drain_deadline is not None and time.monotonic() >= self.drain_deadline

    def is_idle(self) -> bool:
        """Nothing running, nothing queued: a drain may end."""
        return self.active == 0 and self.queued == 0

    def start_drain(self, timeout_s: float) -> None:
        self.drain_deadline = time.monotonic() + timeout_s

    async def enter(self) -> Release:
        """Wait for a slot; call the returned ``release`` once (it is idempotent: a ``finally`` and a response
        callback may both call it)."""
        if self.is_draining:
            raise ApiError(
                503,
                "the gateway is shutting down; retry on another instance",
                code="shutting_down",
                kind="server_error",
            )
        if self._slots.locked() and self.queued >= self.max_queued:
            self.rejected += 1
            raise ApiError(
                429,
                f"{self.max_active} requests running and {self.queued} queued; retry shortly",
                code="rate_limit_exceeded",
                kind="rate_limit_error",
            )
        self.queued += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), self.queue_timeout_s)
        except TimeoutError:
            self.rejected += 1
            raise ApiError(
                429,
                f"no slot within {self.queue_timeout_s:g} s; retry shortly",
                code="rate_limit_exceeded",
                kind="rate_limit_error",
            ) from None
        finally:
            self.queued -= 1
        self.active += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.active -= 1
                self._slots.release()

        return release
