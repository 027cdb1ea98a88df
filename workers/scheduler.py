"""The worker's ``VerifyScheduler`` (DESIGN §9): calls wait in one FIFO queue; a step takes from its front
(``take_within``) and runs them as one runner forward (``workers.step``); ``exclusive`` entries (``DELETE``, the
close) run between two steps, in their place in the queue."""

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
        self.tokens.append(sum(c.req.new_rows for c in calls))


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
        """Queue a call (a verify call, or a pipeline stage's segment); its answer once its step has run."""
        return await self._enqueue(_Call(req, timing, asyncio.get_running_loop().create_future()))

    async def exclusive(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the model thread between two steps, in its place in the queue."""
        return await self._enqueue(_Exclusive(fn, args, asyncio.get_running_loop().create_future()))  # type: ignore[no-any-return]

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
            _settle(entry.done, RuntimeError("the worker is shutting down"))
        self._queue.clear()

    @property
    def queue_length(self) -> int:
        """Calls waiting for a step (exclusive work between steps not counted)."""
        return sum(isinstance(entry, _Call) for entry in self._queue)

    def _enqueue(self, entry: _Call | _Exclusive) -> asyncio.Future[Any]:
        self._queue.append(entry)
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="verify-scheduler")
        return entry.done

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
        """The step's calls from those before the first exclusive entry; calls passed over keep their places, calls whose client left are dropped."""
        barrier = next((i for i, entry in enumerate(self._queue) if isinstance(entry, _Exclusive)), len(self._queue))  # what comes after it waits
        waiting = [entry for entry in list(self._queue)[:barrier] if isinstance(entry, _Call)]
        taken = take_within((c for c in waiting if not c.done.done()), lambda c: c.req.new_rows, self.max_batch_tokens, lambda c: c.req.session_id)
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
            _settle(call.done, answer)

    async def _exclusive(self, entry: _Exclusive) -> None:
        try:
            result = await self.state.thread.run(entry.fn, *entry.args)
        except Exception as exc:  # noqa: BLE001 - the caller's
            result = exc
        _settle(entry.done, result)


def _settle(done: asyncio.Future[Any], answer: Any) -> None:
    """The answer (an exception: raised) to its waiter, if still waiting."""
    if done.done():
        return
    if isinstance(answer, BaseException):
        done.set_exception(answer)
    else:
        done.set_result(answer)
