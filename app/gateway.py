"""The gateway (docs/design.md §5): the targets' readiness, a job's grammar compiled off the event
loop, its choices run from rounds to text events, counted in usage and metrics (requests become jobs in
app.requests, events bodies in app.bodies)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from app.drafting import DraftModel
from app.engine import Engine, GenerationRequest, TokenLogprob
from app.errors import ApiError
from app.metrics import GatewayMetrics
from app.reasoning import ReasoningSplitter
from app.requests import Job, Requests
from app.targets.failures import WorkerError
from app.targets.pool import TargetSet
from app.text import ChoiceText, delta_text
from app.tool_formats import GENERIC
from app.tools import ToolOutput
from core.config import SpecgateConfig
from core.grammar import GrammarError, GrammarLimits, Grammars, GrammarSpec, engine_version

log = logging.getLogger(__name__)


@dataclass
class ChoiceEvent:
    index: int
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    round: RoundInfo | None = None  # where the text came from (the stream's ``speculative`` field)
    is_prompt: bool = False  # the echoed prompt's logprobs (echo with logprobs), before any token
    # tools: the text read into OpenAI's deltas (content, tool_calls pieces)
    deltas: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class RoundInfo:
    """One round as a chat UI shows it: the event's first ``draft_chars`` characters are accepted draft
    tokens, the rest the target's."""

    accepted: int
    drafted: int
    draft_chars: int
    bytes: int  # to and from the workers, this round


class Gateway:
    """What the gateway app holds: config, draft, workers, engine, and ``requests`` (requests to jobs). Built
    by ``create_app``."""

    def __init__(
        self, config: SpecgateConfig, draft: DraftModel, pool: TargetSet, metrics: GatewayMetrics
    ) -> None:
        self.config = config
        self.draft = draft
        self.pool = pool
        self.metrics = metrics
        self.tokenizer = draft.runner.tokenizer
        self.engine = Engine(draft, pool, draft.runner.info.eos_ids, draft.runner.info.max_context)
        self.engine.prefill_waits = config.late_prefill_waits()
        self.requests = Requests(config, draft, pool, self.engine)
        self._workers_checked = False
        self._engine_warned: set[str] = set()

    async def check_workers(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """/v1/info of every replica of every worker, checked against the draft's tokenizer (``timeout``:
        ``pool.check_all``'s)."""
        report = await self.pool.check_all(timeout)
        ready = [e for e in report if e["ready"]]
        if ready:
            self.engine.max_context = min(
                [self.draft.runner.info.max_context] + [e["max_context"] for e in ready]
            )
        if len(ready) == len(report):
            self._workers_checked = True
        self._warn_engines()
        return report

    def _warn_engines(self) -> None:
        """A worker whose grammar engine is not the gateway's, logged once: it serves no grammar
        (``_check_peers``)."""
        engine = engine_version()
        for where, info in self.requests.replica_infos():
            if (
                info.grammar_engine is not None
                and info.grammar_engine != engine
                and where not in self._engine_warned
            ):
                self._engine_warned.add(where)
                log.warning(
                    "worker %s runs %s, the gateway %s: requests with a grammar get a 400 until they match",
                    where,
                    info.grammar_engine,
                    engine,
                )

    async def ensure_workers(self) -> None:
        """Before the first request: every worker has a ready replica (503 naming one that has not)."""
        if self._workers_checked:
            return
        for entry in await self.check_workers():
            if not entry["ready"]:
                raise WorkerError(
                    entry["name"], entry["error"].removeprefix(f"worker {entry['name']}: "), 503
                )

    def grammars(self) -> Grammars:
        """The gateway's grammar engine over the draft's tokenizer (built on first use)."""
        if self.engine.grammars is None:
            info = self.draft.runner.info
            limits = GrammarLimits(max_source_bytes=self.config.limits.max_grammar_bytes)
            self.engine.grammars = Grammars(self.tokenizer, info.vocab_size, info.eos_ids, limits)
        return self.engine.grammars

    def _compile(self, spec: GrammarSpec) -> object:
        return self.grammars().compile(spec)

    async def compile(self, job: Job) -> None:
        """Compile the job's grammar off the event loop: a 400 naming the parameter if it fails or takes too
        long."""
        transform = job.choices[0].transform
        if transform is None or transform.grammar is None:
            return
        grammar, param = transform.grammar, job.grammar_param
        limit = self.config.limits.grammar_compile_s
        try:
            await asyncio.wait_for(asyncio.to_thread(self._compile, grammar), limit)
        except GrammarError as exc:
            param = await self._culprit(job) or param
            raise ApiError(400, f"{param}: {exc}", param, "invalid_grammar") from None
        except TimeoutError:
            raise ApiError(
                400,
                f"{param}: the {grammar.kind.value} took longer than {limit:g} s to compile "
                "(limits.grammar_compile_s)",
                param,
                "grammar_too_complex",
            ) from None

    async def _culprit(self, job: Job) -> str | None:
        """The tool whose parameters make the generic format's schema fail to compile."""
        for i, parameters in enumerate(job.tool_parameters):
            try:
                await asyncio.to_thread(self._compile, GrammarSpec.json_schema(parameters))
            except GrammarError:
                return f"tools.{i}.function.parameters"
        return None

    async def events(self, job: Job) -> AsyncGenerator[ChoiceEvent, None]:
        """Events of every choice as they come; n > 1 choices run side by side."""
        if len(job.choices) == 1:
            async with aclosing(self._choice_events(job, job.choices[0])) as events:
                async for event in events:
                    yield event
            return
        queue: asyncio.Queue[ChoiceEvent | BaseException | None] = asyncio.Queue()

        async def pump(choice: GenerationRequest) -> None:
            try:
                async with aclosing(self._choice_events(job, choice)) as events:
                    async for event in events:
                        await queue.put(event)
            except Exception as exc:  # handed to the consumer, which raises it
                await queue.put(exc)
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(choice)) for choice in job.choices]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _choice_events(self, job: Job, choice: GenerationRequest) -> AsyncGenerator[ChoiceEvent, None]:
        tools = _reader(job)
        splitter = ReasoningSplitter(job.thinking) if job.thinking is not None else None
        # markers that are special tokens: written out for the readers
        keep = job.markers.ids and (tools is not None or splitter is not None)
        skipped = job.markers.skipped if keep else None
        reader = ChoiceText(
            self.tokenizer,
            job.stops,
            choice.min_tokens,
            tools,
            grammar=job.has_grammar,
            reasoning=splitter,
            skipped=skipped,
        )
        mode, last, is_first = str(choice.spec.mode), job.arrived, True
        if choice.choice == 0:
            self.metrics.prompt_tokens.inc(len(choice.prompt))
        async with aclosing(self.engine.generate(choice)) as rounds:
            async for result in rounds:
                job.usage.add(result)
                if result.prompt_logprobs is not None:  # echo with logprobs: the prompt first
                    yield ChoiceEvent(choice.choice, "", result.prompt_logprobs, is_prompt=True)
                    continue
                self.metrics.observe_round(mode, result)
                if result.tokens:
                    now = time.monotonic()
                    self.metrics.observe_tokens(mode, now - last, len(result.tokens), is_first)
                    last, is_first = now, False
                accepted = min(result.accepted, len(result.tokens))  # EOS may have cut the round short
                deltas = reader.push(result.tokens[:accepted])
                draft_chars = len(delta_text(deltas))
                deltas += [] if reader.stopped else reader.push(result.tokens[accepted:])
                finish = "stop" if reader.stopped else result.finish_reason
                if finish:
                    last_deltas, finish = reader.finish(finish)
                    deltas += last_deltas
                info = RoundInfo(
                    accepted, result.drafted, draft_chars, result.traffic.sent + result.traffic.received
                )
                yield ChoiceEvent(
                    choice.choice,
                    delta_text(deltas),
                    result.logprobs,
                    finish,
                    info,
                    deltas=deltas if tools is not None or splitter is not None else None,
                )
                if finish:
                    if job.usage.reasoning_tokens is not None:
                        job.usage.reasoning_tokens += reader.reasoning_tokens
                    self.metrics.observe_finish(mode, finish, time.monotonic() - job.arrived)
                    return

    async def collect(self, job: Job) -> list[ChoiceEvent]:
        """Run a job to the end: one event per choice with all its text."""
        merged = [ChoiceEvent(c.choice, "", [] if c.top_logprobs is not None else None) for c in job.choices]
        async with aclosing(self.events(job)) as events:
            async for event in events:
                into = merged[event.index]
                into.text += event.text
                if event.logprobs is not None and into.logprobs is not None:
                    into.logprobs.extend(event.logprobs)
                into.finish_reason = event.finish_reason or into.finish_reason
                if event.deltas is not None:
                    into.deltas = (into.deltas or []) + event.deltas
        return merged


def _reader(job: Job) -> ToolOutput | None:
    """What reads a tools answer into OpenAI's deltas: the generic format's reader, or the native format's."""
    if not job.tools:
        return None
    if job.tool_format is GENERIC:
        return ToolOutput(raw_response=job.tool_response_schema)
    return job.tool_format.reader(job.markers, job.tool_schemas)
