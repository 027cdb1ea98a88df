"""The draft's step batcher (continuous batching): a draft is a generator (``DraftSteps``) that yields the
``ForwardItem`` it needs next and gets its logits back; one runner ``forward_each`` per step, on the
model thread, serves every draft in progress, so N concurrent drafts cost one decode per position. A
background prefill (a late draft's, app.engine.late) goes in small chunks behind the drafts waiting."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field

import torch

from core.batching import take_within
from core.math.tree import TokenTree
from core.runners import ModelRunner
from core.runners.base import ForwardItem, common_prefix
from core.runners.model_thread import ModelThread

DEFAULT_BATCH_TOKENS = 128  # a draft step's new rows, all requests together (DraftConfig.max_batch_tokens)
# steps in a row a background prefill may be left out of while drafts wait: then it goes beside them
BACKGROUND_PASSES = 3

DraftSteps = Generator[ForwardItem, torch.Tensor, TokenTree]  # a draft: yields items, gets their logits
DraftSeconds = dict[str, float]  # a round's drafting seconds by part (``DraftClock.parts``), summed


@dataclass
class DraftClock:
    """Where one draft's seconds went: in the runner (``draft_model``), and the rest (``draft_sampling``)."""

    model_s: float = 0.0
    total_s: float = 0.0

    def parts(self) -> DraftSeconds:
        return {"draft_model": self.model_s, "draft_sampling": max(self.total_s - self.model_s, 0.0)}


@dataclass(eq=False)
class Drafting:
    """A draft in progress: its generator, the item it waits on, its clock and its outcome."""

    steps: DraftSteps
    done: asyncio.Future[TokenTree]
    clock: DraftClock = field(default_factory=DraftClock)
    item: ForwardItem | None = None
    started: bool = False
    stop: bool = False  # its caller went away: closed at the next step
    background: bool = False  # a prefill nobody waits on yet (a late draft's): the drafts waiting go first
    result: TokenTree | None = None
    error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None

    def advance(self, logits: torch.Tensor | None) -> None:
        """Run the draft on to its next item (or its end) with the logits of the last one."""
        started = time.perf_counter()
        try:
            self.item = self.steps.send(logits)  # type: ignore[arg-type]  # None primes it
        except StopIteration as end:
            self.item, self.result = None, end.value
        except Exception as exc:  # noqa: BLE001 - the draft's own failure, handed to its caller
            self.item, self.error = None, exc
        finally:
            self.clock.total_s += time.perf_counter() - started

    def fail(self, exc: BaseException) -> None:
        """Its item failed: raise it in the draft (its ``finally`` runs), and end it."""
        try:
            self.steps.throw(exc)
        except BaseException as raised:  # noqa: BLE001 - the item's failure, handed to the caller
            self.error = raised
        else:
            self.error = exc
            self.steps.close()
        self.item = None

    def settle(self) -> None:
        """On the event loop: hand a finished (or stopped) draft's outcome to its caller."""
        if self.done.done():
            return
        if self.result is not None:
            self.done.set_result(self.result)
        elif self.error is not None:
            self.done.set_exception(self.error)
        else:
            self.done.cancel()


class StepBatcher:
    """Runs drafts (``DraftSteps``) on one runner, one shared ``forward_each`` per step."""

    def __init__(
        self,
        runner: ModelRunner,
        thread: ModelThread | None = None,
        max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
    ) -> None:
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be ≥ 1, got {max_batch_tokens}")
        self.runner = runner
        self.thread = thread or ModelThread()  # every runner call (core.runners.model_thread)
        self.max_batch_tokens = max_batch_tokens  # new rows per step, all drafts together (one always goes)
        self.prefill_chunk = max(1, max_batch_tokens // 2)  # a prompt's rows per step: others ride along
        # a background prefill's: a step it runs alone in stays short
        self.background_chunk = max(1, max_batch_tokens // 4)
        self.steps: deque[int] = deque(maxlen=1024)  # drafts per step, the latest steps (tests)
        self.num_steps = self.num_step_drafts = 0  # since start (metrics: the mean draft batch)
        self.busy: dict[str, asyncio.Future[TokenTree]] = {}  # session -> its draft in progress
        self._runs: dict[str, Drafting] = {}  # session -> its draft in progress
        self._arrived: list[Drafting] = []
        self._loop_task: asyncio.Task[None] | None = None
        self._passed = 0  # steps in a row a background prefill waited through

    async def idle(self, session_id: str) -> None:
        """Wait until the session has no draft in progress (one draft per session at a time); a background
        prefill waited on goes with the drafts from its next step."""
        while (busy := self.busy.get(session_id)) is not None:
            if (drafting := self._runs.get(session_id)) is not None:
                drafting.background = False
            await asyncio.wait([busy])

    async def run(
        self, session_id: str, steps: DraftSteps, timing: DraftSeconds | None, background: bool = False
    ) -> TokenTree:
        """The draft ``steps`` to its end, its seconds added to ``timing`` (``DraftClock``); ``background``: a
        prefill the drafts waiting go before (``_step``)."""
        drafting = Drafting(steps, asyncio.get_running_loop().create_future(), background=background)
        self.busy[session_id], self._runs[session_id] = drafting.done, drafting
        drafting.done.add_done_callback(lambda done: self._forget(session_id, drafting))
        self._arrived.append(drafting)
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._step_loop())
        try:
            tree = await asyncio.shield(drafting.done)
        except asyncio.CancelledError:
            drafting.stop = True  # the step loop closes it; the session stays busy until then
            raise
        if timing is not None:
            for name, seconds in drafting.clock.parts().items():
                timing[name] = timing.get(name, 0.0) + seconds
        return tree

    def _forget(self, session_id: str, drafting: Drafting) -> None:
        if self._runs.get(session_id) is drafting:
            del self.busy[session_id], self._runs[session_id]

    def catch_up(
        self, session_id: str, sequence: list[int], chunk: int | None = None
    ) -> Generator[ForwardItem, torch.Tensor, torch.Tensor]:
        """Bring the session to ``sequence`` (a new one adopts a prompt cache's rows first): crop to what they
        share, feed the rest; the last logits."""
        runner = self.runner
        if not runner.has_session(session_id):
            runner.adopt(session_id, sequence)
        common = common_prefix(runner.tokens(session_id), sequence)
        runner.crop(session_id, common)
        return (yield from self.feed(session_id, sequence[common:], chunk))

    def prefill_steps(self, session_id: str, sequence: list[int]) -> DraftSteps:
        """A draft of nothing that leaves the session holding ``sequence`` (``catch_up`` in
        ``background_chunk`` rows a step)."""
        yield from self.catch_up(session_id, sequence, self.background_chunk)
        return TokenTree.chain([], [])

    def feed(
        self, session_id: str, tokens: list[int], chunk: int | None = None
    ) -> Generator[ForwardItem, torch.Tensor, torch.Tensor]:
        """Append ``tokens`` in chunks of ≤ ``chunk`` rows (``prefill_chunk``), one per step (none: the last
        row again); its logits."""
        logits, chunk = None, chunk or self.prefill_chunk
        for begin in range(0, max(len(tokens), 1), chunk):
            logits = yield self.runner.append_item(session_id, tokens[begin : begin + chunk], 1)
        assert logits is not None
        return logits[0]

    async def _step_loop(self) -> None:
        """DraftSteps while any draft is in progress; a draft that arrives joins the next step."""
        active: list[Drafting] = []
        try:
            while True:
                active += self._arrived
                self._arrived = []
                if not active:
                    return
                try:
                    await self.thread.run(self._steps, active)
                except Exception as exc:  # noqa: BLE001 - a broken step fails its drafts, not the loop
                    for d in active:
                        d.item, d.error = None, d.error or exc
                for d in active:
                    if d.finished or d.stop:
                        d.settle()
                active = [d for d in active if not d.done.done()]
        finally:
            self._loop_task = None
            for d in [*active, *self._arrived]:  # the loop was cancelled (shutdown)
                if not d.done.done():
                    d.done.cancel()

    def _steps(self, drafts: list[Drafting]) -> None:
        """On the model thread: steps while no draft ends or is stopped and none arrives. Each return to the
        event loop and back is a thread hop, and a chain takes a step per token: its drafted tokens take one
        hop, not one each."""
        while self._step(drafts) and not self._arrived and not any(d.finished or d.stop for d in drafts):
            pass

    def _step(self, drafts: list[Drafting]) -> bool:
        """On the model thread: start new drafts, close stopped ones, one ``forward_each`` of the waiting
        items (``take_within``), each draft on; whether it forwarded any."""
        for d in drafts:
            if d.stop and not d.finished:
                d.steps.close()
                d.item = None
            elif not d.started:
                d.started = True
                d.advance(None)
        waiting = [d for d in drafts if d.item is not None and not d.stop]
        taken = take_within(
            [d for d in waiting if not d.background],
            lambda d: len(d.item.tokens) if d.item is not None else 0,
            self.max_batch_tokens,
            id,
        )
        behind = [d for d in waiting if d.background]
        if behind and (not taken or self._passed >= BACKGROUND_PASSES):
            # alone, or after waiting its passes: one chunk beside them
            taken.append(behind[0])
            self._passed = 0
        elif behind:
            self._passed += 1
        if not taken:
            return False
        started = time.perf_counter()
        results = self.runner.forward_each([d.item for d in taken if d.item is not None])
        seconds = time.perf_counter() - started
        self.steps.append(len(taken))
        self.num_steps += 1
        self.num_step_drafts += len(taken)
        for d, result in zip(taken, results):
            d.clock.model_s += seconds
            d.clock.total_s += seconds
            if isinstance(result, Exception):
                d.fail(result)
            else:
                d.advance(result)
        return True
