"""Readiness checks that a hung replica cannot stall: each waits at most its bound and goes on without its
waiter."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from app.targets.failures import ReplicaFailure

T = TypeVar("T")


class Checks:
    """Checks that outlive the wait for them: ``/health/ready`` waits at most its bound, and a check still
    running when the bound passes goes on (its answer recorded when it comes) and is the one the next wait
    waits for, never started twice. A hung replica then costs one pending check and a "no answer yet" in the
    report, not a probe that times out."""

    def __init__(self) -> None:
        self._running: dict[str, asyncio.Future[Any]] = {}

    async def wait(
        self, calls: dict[str, Callable[[], Awaitable[T]]], timeout: float | None
    ) -> dict[str, T | BaseException]:
        """``calls[key]()`` for each key (the running one where there is one): its result, its exception, or a
        ReplicaFailure of kind ``timeout`` when it has not answered within ``timeout`` s (None: wait for
        all)."""
        futures = {}
        for key, call in calls.items():
            future = self._running.get(key)
            if future is None or future.done():
                future = self._running[key] = asyncio.ensure_future(call())
                future.add_done_callback(_retrieved)
            futures[key] = future
        if futures:
            await asyncio.wait(futures.values(), timeout=timeout)
        results: dict[str, T | BaseException] = {}
        for key, future in futures.items():
            if not future.done():
                results[key] = ReplicaFailure(
                    "timeout", f"no answer to /v1/info within {timeout:g} s (still asking)"
                )
            elif future.cancelled():
                results[key] = ReplicaFailure("timeout", "the check was cancelled")
            else:
                results[key] = future.exception() or future.result()
        return results

    def cancel(self) -> None:
        """Stop the checks still running (the gateway is closing)."""
        for future in self._running.values():
            future.cancel()


def _retrieved(future: asyncio.Future[Any]) -> None:
    """A check nobody waits for any more: its exception is in its replica's record, not "never retrieved"."""
    if not future.cancelled():
        future.exception()
