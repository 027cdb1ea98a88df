"""The worker's ``VerifyScheduler`` (DESIGN §9): verify calls batched into scheduler steps.

Calls wait in one FIFO queue. Each step takes the waiting calls from the front — one per
session (a second call of a session waits for the next step), up to ``max_batch_tokens`` new
tokens in all (the first call always goes, whatever its size) — and runs them on the model
thread as **one** runner forward (its host's ``verify_batch``: ``WorkerState`` in workers/server.py): each call is checked, cropped
and scored on its own, so one that fails (a prefix that does not match, a malformed tree) fails
alone. Anything else that touches the runner — ``DELETE``, the close at shutdown — is queued
as an *exclusive* entry: it runs between two steps, in its place in the queue. The event loop
never waits for a step, so ``/health`` answers while one runs.

Usage::

    scheduler = VerifyScheduler(state, max_batch_tokens=256)
    resp = await scheduler.verify(req, timing)          # from a route handler
    await scheduler.exclusive(state.sessions.free, sid)  # ordered with the steps
    await scheduler.close()
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from core.protocol import StageRequest, VerifyRequest
from core.runners.model_thread import ModelThread, take_within

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Call:
    req: VerifyRequest | StageRequest
    timing: dict[str, float]
    done: asyncio.Future[Any]

    @property
    def tokens(self) -> int:
        """New tokens the call feeds (its budget)."""
        return self.req.new_rows


@dataclass
class _Exclusive:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    done: asyncio.Future[Any]


@dataclass
class StepLog:
    """What the steps so far did (tests, metrics): the sessions and new tokens of each."""

    sizes: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def add(self, calls: list[_Call]) -> None:
        self.sizes.append(len(calls))
        self.tokens.append(sum(c.tokens for c in calls))


class StepHost(Protocol):
    """What the scheduler runs its steps on (``workers.server.WorkerState``)."""

    thread: ModelThread

    def verify_batch(self, reqs: list[VerifyRequest | StageRequest], timings: list[dict[str, float]]) -> list[Any]: ...


class VerifyScheduler:
    def __init__(self, state: StepHost, max_batch_tokens: int) -> None:
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be ≥ 1, got {max_batch_tokens}")
        self.state, self.max_batch_tokens = state, max_batch_tokens
        self.steps = StepLog()
        self._queue: deque[_Call | _Exclusive] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def verify(self, req: VerifyRequest | StageRequest, timing: dict[str, float]) -> Any:
        """Queue a call (a verify call, or a pipeline stage's segment); its answer once its step
        has run (or the exception it failed with)."""
        call = _Call(req, timing, asyncio.get_running_loop().create_future())
        self._enqueue(call)
        return await call.done  # type: ignore[no-any-return]

    async def exclusive(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the model thread between two steps, in its place in the queue."""
        entry = _Exclusive(fn, args, asyncio.get_running_loop().create_future())
        self._enqueue(entry)
        return await entry.done  # type: ignore[no-any-return]

    async def close(self) -> None:
        """Stop after what is queued; later calls are refused."""
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for entry in self._queue:
            if not entry.done.done():
                entry.done.set_exception(RuntimeError("the worker is shutting down"))
        self._queue.clear()

    def _enqueue(self, entry: _Call | _Exclusive) -> None:
        self._queue.append(entry)
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="verify-scheduler")

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                head = self._queue[0]
                if isinstance(head, _Exclusive):
                    self._queue.popleft()
                    await self._exclusive(head)
                else:
                    await self._step(self._take())

    def _take(self) -> list[_Call]:
        """The step's calls (``take_within``) from those before the first exclusive entry; calls
        it passes over keep their places, calls whose client left are dropped."""
        waiting: list[_Call] = []
        for entry in self._queue:
            if isinstance(entry, _Exclusive):
                break  # a barrier: what comes after it waits for it
            waiting.append(entry)
        taken = take_within((c for c in waiting if not c.done.done()), lambda c: c.tokens, self.max_batch_tokens, lambda c: c.req.session_id)
        gone = {id(c) for c in waiting if c.done.done()} | {id(c) for c in taken}
        self._queue = deque(e for e in self._queue if id(e) not in gone)
        return taken

    async def _step(self, calls: list[_Call]) -> None:
        if not calls:
            return
        self.steps.add(calls)
        try:
            answers = await self.state.thread.run(self.state.verify_batch, [c.req for c in calls], [c.timing for c in calls])
        except Exception as exc:  # noqa: BLE001 - the step itself failed: every call of it
            log.exception("verify step failed")
            answers = [exc] * len(calls)
        for call, answer in zip(calls, answers):
            if call.done.done():
                continue
            if isinstance(answer, BaseException):
                call.done.set_exception(answer)
            else:
                call.done.set_result(answer)

    async def _exclusive(self, entry: _Exclusive) -> None:
        try:
            result = await self.state.thread.run(entry.fn, *entry.args)
        except Exception as exc:  # noqa: BLE001 - the caller's
            if not entry.done.done():
                entry.done.set_exception(exc)
            return
        if not entry.done.done():
            entry.done.set_result(result)
