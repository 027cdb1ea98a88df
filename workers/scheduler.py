"""The worker's ``VerifyScheduler`` (docs/design.md §9): calls wait in one FIFO queue; a step takes from its
front (``take_within``) and runs them as one runner forward (``workers.step``); ``exclusive`` entries
(``DELETE``, the close) run between two steps, in their place in the queue. A long prompt goes in pieces
(chunked prefill, as vLLM's): ``prefill_chunk`` of its tokens a step, in the steps the other sessions' calls
leave free and one step in four beside them, so theirs wait one piece at most, not the whole prefill."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypeVar

from core.batching import take_within
from core.protocol import StageRequest, StageResponse, VerifyRequest, VerifyResponse
from core.runners.model_thread import ModelThread
from workers.stage import StageStates

log = logging.getLogger(__name__)
T = TypeVar("T")
# steps in a row a long call's next piece may wait while other calls go: then it goes beside them
PIECE_PASSES = 3
# pieces of shorter long calls that may go before a long call's next one: then the oldest such goes first
AGE_PASSES = 8


@dataclass(frozen=True)
class Piece:
    """A piece of a long call (chunked prefill): ``req.tokens[start:end]`` fed in a step, no answer; ``end``
    None: the rest of its tokens and its draft, answered as the call."""

    req: VerifyRequest
    start: int
    end: int | None = None

    @property
    def session_id(self) -> str:
        return self.req.session_id

    @property
    def new_rows(self) -> int:
        return self.req.new_rows - self.start if self.end is None else self.end - self.start


Work = VerifyRequest | StageRequest | Piece  # what a step runs for one call
StepAnswer = VerifyResponse | StageResponse | StageStates | int | Exception
"""A step's answer to one call: a verify call's ``VerifyResponse``; a stage's ``StageResponse`` (the last) or
``StageStates`` (to send on); a piece's, how many of its call's tokens are held; or the call's exception."""


def chunkable(req: VerifyRequest | StageRequest) -> bool:
    """Whether a call's new tokens may go in pieces: a chain's or a tree's (its agreed tokens in pieces, the
    last with the tree); not one that keeps a previous tree's path first, an echo's that scores every row, or
    a pipeline stage's."""
    return isinstance(req, VerifyRequest) and req.path is None and not req.score_tokens


@dataclass
class Timing:
    """A call's time: when it ``arrived`` at the scheduler (perf_counter seconds), then its Server-Timing in
    ms (a verify call's): the step's ``model`` and ``score``, the route's ``codec``, ``queue``, ``total``."""

    arrived: float | None = None
    model: float = 0.0
    score: float = 0.0
    codec: float = 0.0
    queue: float = 0.0
    total: float = 0.0

    def header(self) -> str:
        """The W3C ``Server-Timing`` header: ``name;dur=ms`` for every part, in the order above."""
        return ", ".join(f"{f.name};dur={getattr(self, f.name):.3f}" for f in fields(self)[1:])


@dataclass
class _Call:
    req: VerifyRequest | StageRequest
    timing: Timing
    done: asyncio.Future[Any]
    fed: int = 0  # its first tokens already in the session, fed by pieces
    passed_over: int = 0  # pieces of other long calls that went before its next one


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

    def add(self, work: list[Work]) -> None:
        self.sizes.append(len(work))
        self.tokens.append(sum(w.new_rows for w in work))


class StepHost(Protocol):
    """What the scheduler runs its steps on (``workers.step.Steps``): a step whole, or launched and finished
    apart where its device work runs while the host goes on (``overlaps``: a GPU's stream)."""

    thread: ModelThread

    def verify_batch(self, reqs: list[Work], timings: list[Timing]) -> list[StepAnswer]: ...

    @property
    def overlaps(self) -> bool: ...

    def launch(self, reqs: list[Work], timings: list[Timing]) -> Any: ...

    def finish(self, pending: Any) -> list[StepAnswer]: ...


class VerifyScheduler:
    def __init__(self, state: StepHost, max_batch_tokens: int, prefill_chunk: int | None = None) -> None:
        if max_batch_tokens < 1 or (prefill_chunk is not None and prefill_chunk < 1):
            raise ValueError(
                f"max_batch_tokens and prefill_chunk must be ≥ 1, got {max_batch_tokens} and {prefill_chunk}"
            )
        self.state, self.max_batch_tokens = state, max_batch_tokens
        self.prefill_chunk = prefill_chunk or max_batch_tokens  # a long call's tokens per step
        # a call with more new tokens goes in pieces (a chat's first call goes whole)
        self.long_call = max(self.prefill_chunk, max_batch_tokens // 4)
        self._passed = 0  # steps in a row a long call's piece waited through
        self.steps = StepLog()
        self.overlapped = 0  # steps launched while the one before was still on the device
        self._queue: deque[_Call | _Exclusive] = deque()
        self._working = False  # the loop is taking work (a step or exclusive work runs, or is next)
        # when a step or exclusive work last ended, or work came to an idle scheduler
        self.progress_at = time.monotonic()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def verify(self, req: VerifyRequest | StageRequest, timing: Timing) -> Any:
        """Queue a call (a verify call, or a pipeline stage's segment); its answer once its step has run.
        ``timing`` gets ``arrived`` (a call answered from a decode done ahead counts the part it waited for),
        then its step's parts."""
        timing.arrived = time.perf_counter()
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
    def stalled_s(self) -> float:
        """Seconds since the model last finished a step (or a decode of one) while work waits or runs; 0 while
        idle. A busy worker's stays under a step's time whatever its queue; a stuck one's grows (its
        ``/health`` reports it: the gateway waits on a slow answer while it stays low,
        ``app.targets.channel``)."""
        if not self._queue and not self._working:
            return 0.0
        runner = getattr(self.state, "runner", None)  # llama.cpp: each decode of a step is progress too
        return time.monotonic() - max(self.progress_at, getattr(runner, "progress_at", 0.0))

    @property
    def queue_length(self) -> int:
        """Calls waiting for a step (exclusive work between steps not counted)."""
        return sum(isinstance(entry, _Call) for entry in self._queue)

    def _enqueue(self, entry: _Call | _Exclusive) -> asyncio.Future[Any]:
        if not self._queue and not self._working:
            self.progress_at = time.monotonic()
        self._queue.append(entry)
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="verify-scheduler")
        return entry.done

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._working = True
            while self._queue:
                exclusive = self._next_exclusive()
                if exclusive is not None:
                    self._queue = deque(e for e in self._queue if e is not exclusive)
                    await self._exclusive(exclusive)
                elif getattr(self.state, "overlaps", False):
                    await self._overlapped(self._take())
                else:
                    await self._step(self._take())
            self._working = False
            while not self._queue and getattr(self.state, "wants_ahead", False):
                # idle: answers' tokens decoded ahead, one a hop
                if not await self._look_ahead():
                    break

    async def _look_ahead(self) -> bool:
        try:
            await self.state.thread.run(self.state.look_ahead)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - only a head start: the next calls decode as they would have
            log.warning("decoding ahead failed", exc_info=True)
            return False
        return True

    def _next_exclusive(self) -> _Exclusive | None:
        """The first exclusive entry, once every call before it has had a step: a long call between two of its
        pieces does not hold it (a ``DELETE`` behind a long prefill would hold every call behind it)."""
        for entry in self._queue:
            if isinstance(entry, _Exclusive):
                return entry
            if entry.fed == 0 and not entry.done.done():
                return None
        return None

    async def _overlapped(self, work: list[tuple[_Call, Work]]) -> None:
        """Steps in a pipeline two deep (where the host's device queues work: a GPU): while one step runs on
        the device, the host prepares and launches the next — of other sessions: a session's next call waits
        for its answer, as the protocol has it — then takes the first's answers. An exclusive entry whose turn
        has come drains the pipeline: it runs between two steps, none in flight."""
        pending = await self._launch(work)
        while pending is not None:
            following = None
            if self._next_exclusive() is None:  # else it runs next, between two steps: none in flight
                following = await self._launch(self._take(busy=pending[2]))
                self.overlapped += following is not None
            await self._settle_pending(pending)
            pending = following

    async def _launch(
        self, work: list[tuple[_Call, Work]]
    ) -> tuple[list[tuple[_Call, Work]], Any, set[str]] | None:
        if not work:
            return None
        self.steps.add([w for _, w in work])
        try:
            launched: Any = await self.state.thread.run(
                self.state.launch, [w for _, w in work], [c.timing for c, _ in work]
            )
        except Exception as exc:  # noqa: BLE001 - the step itself failed: every call of it
            log.exception("verify step failed")
            launched = exc
        return work, launched, {c.req.session_id for c, _ in work}

    async def _settle_pending(self, pending: tuple[list[tuple[_Call, Work]], Any, set[str]]) -> None:
        work, launched, _ = pending
        if isinstance(launched, Exception):
            answers: list[StepAnswer] = [launched] * len(work)
        else:
            try:
                answers = await self.state.thread.run(self.state.finish, launched)
            except Exception as exc:  # noqa: BLE001 - the step itself failed: every call of it
                log.exception("verify step failed")
                answers = [exc] * len(work)
        self._answer(work, answers)

    def _take(self, busy: Collection[str] = ()) -> list[tuple[_Call, Work]]:
        """The step's work from the calls before the first exclusive entry: whole calls within
        ``max_batch_tokens`` (``take_within``); the next piece of the long call with the fewest tokens left (a
        session sent again goes before a long prompt; one passed over ``AGE_PASSES`` times goes first, oldest
        first) in a step of its own, or beside them once it waited ``PIECE_PASSES`` steps; calls passed over
        keep their places, calls whose client left are dropped."""
        # what comes after it waits
        barrier = next(
            (i for i, entry in enumerate(self._queue) if isinstance(entry, _Exclusive)), len(self._queue)
        )
        waiting = [entry for entry in list(self._queue)[:barrier] if isinstance(entry, _Call)]
        # busy: a step in flight holds the session
        live = [c for c in waiting if not c.done.done() and c.req.session_id not in busy]
        long = [
            c
            for c in live
            if chunkable(c.req)
            and (c.fed or len(c.req.tokens) > self.long_call)
            and len(c.req.tokens) - c.fed > self.prefill_chunk
        ]
        apart = {c.req.session_id for c in long}
        taken = take_within(
            (c for c in live if c.req.session_id not in apart),
            lambda c: c.req.new_rows - c.fed,
            self.max_batch_tokens,
            lambda c: c.req.session_id,
        )
        work: list[tuple[_Call, Work]] = [(c, Piece(c.req, c.fed) if c.fed else c.req) for c in taken]  # type: ignore[arg-type]  # fed: a chunkable call
        if long and (not taken or self._passed >= PIECE_PASSES):
            # alone, or beside them after waiting its passes
            # shorter prompts arriving all the time starve none
            aged = [c for c in long if c.passed_over >= AGE_PASSES]
            # the oldest of the shortest
            first = aged[0] if aged else min(long, key=lambda c: len(c.req.tokens) - c.fed)
            for call in long:
                call.passed_over = 0 if call is first else call.passed_over + 1
            work.append((first, Piece(first.req, first.fed, first.fed + self.prefill_chunk)))  # type: ignore[arg-type]
            self._passed = 0
        elif long:
            self._passed += 1
        gone = {id(c) for c in waiting if c.done.done()} | {id(c) for c in taken}
        self._queue = deque(e for e in self._queue if id(e) not in gone)
        return work

    async def _step(self, work: list[tuple[_Call, Work]]) -> None:
        if not work:
            return
        self.steps.add([w for _, w in work])
        try:
            answers = await self.state.thread.run(
                self.state.verify_batch, [w for _, w in work], [c.timing for c, _ in work]
            )
        except Exception as exc:  # noqa: BLE001 - the step itself failed: every call of it
            log.exception("verify step failed")
            answers = [exc] * len(work)
        self._answer(work, answers)

    def _answer(self, work: list[tuple[_Call, Work]], answers: list[StepAnswer]) -> None:
        self.progress_at = time.monotonic()
        for (call, piece), answer in zip(work, answers):
            if isinstance(piece, Piece) and piece.end is not None and not isinstance(answer, BaseException):
                # the call waits in its place for its next piece
                call.fed = answer if isinstance(answer, int) else piece.end
                continue
            if isinstance(piece, Piece) and piece.end is not None:  # a piece failed: the call with it
                self._queue = deque(e for e in self._queue if e is not call)
            _settle(call.done, answer)

    async def _exclusive(self, entry: _Exclusive) -> None:
        try:
            result = await self.state.thread.run(entry.fn, *entry.args)
        except Exception as exc:  # noqa: BLE001 - the caller's
            result = exc
        self.progress_at = time.monotonic()
        _settle(entry.done, result)


def _settle(done: asyncio.Future[Any], answer: Any) -> None:
    """The answer (an exception: raised) to its waiter, if still waiting."""
    if done.done():
        return
    if isinstance(answer, BaseException):
        done.set_exception(answer)
    else:
        done.set_result(answer)
