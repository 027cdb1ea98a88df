"""Fakes for testing the engine (the layer above runners and workers): Markov-chain "models"
over a small vocabulary behind the real ModelRunner, DraftModel and worker code."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import httpx
import torch

from app.drafting import DraftModel
from app.engine import Engine
from app.targets.base import resend
from app.targets.channel import Channel, Expected, Traffic
from app.targets.pipeline import PipelineTarget, Segment, StageShort
from app.targets.segments import stage_request
from core.errors import SessionShort
from core.protocol import (
    BINARY_CONTENT_TYPE,
    ErrorBody,
    InfoResponse,
    StageRequest,
    StageResponse,
    VerifyRequest,
    VerifyResponse,
    check_verify_response,
    decode,
    encode,
    encode_json,
)
from core.runners.base import ModelRunner, Rows, RunnerInfo, Staged
from core.runners.model_thread import CallingThread
from workers.scheduler import Timing
from workers.scoring import score
from workers.settings import WorkerSettings
from workers.stage import StageStates
from workers.state import WorkerState


class MarkovRunner(ModelRunner):
    """Logits of the next token depend on the last token only: ``table[last]`` — for a tree
    row too (its own token), so it is also the reference runner for trees."""

    def __init__(self, table: torch.Tensor, eos_ids: list[int] | None = None, name: str = "markov") -> None:
        super().__init__()
        self.table = table  # [V, V] logits
        self.info = RunnerInfo(
            model_id=name,
            backend="markov",
            vocab_size=table.shape[0],
            max_context=4096,
            eos_ids=eos_ids or [],
        )
        self.tokenizer = None

    @property
    def fingerprint(self) -> str:  # type: ignore[override]
        return "markov"

    def _compute(self, session_id: str, rows: Rows, start: int, logits_rows: list[int]) -> torch.Tensor:
        return self.table[torch.tensor([rows.tokens[r] for r in logits_rows])].float()

    def forward_full(self, tokens: list[int], num_logits: int) -> torch.Tensor:
        return self.table[torch.tensor(tokens[-num_logits:])].float()

    def _keep_cache(self, session_id: str, rows: Rows, kept: Sequence[int]) -> None: ...

    def _free_cache(self, session_id: str) -> None: ...

    def kv_bytes_per_token(self) -> int:
        return 0

    def next_probs(self, last: int, temperature: float = 1.0) -> torch.Tensor:
        return torch.softmax(self.table[last].double() / temperature, dim=-1)


class MarkovStageRunner(MarkovRunner):
    """A stage of a Markov "model" of ``num_layers`` layers split by ``layers``: the first
    stage's states are (token, 1) per row, each later stage adds 1 to the count, the last
    answers ``table[token]`` read back from the states it was sent — so a row only gets the
    right distribution if its states went through every stage."""

    hidden_size = 2
    keeps_subtrees = True

    def __init__(
        self, table: torch.Tensor, layers: tuple[int, int], num_layers: int, eos_ids: list[int] | None = None
    ) -> None:
        super().__init__(table, eos_ids, name="markov-stage")
        self.layer_range, self.num_layers = layers, num_layers
        self.info = replace(self.info, backend="transformers")

    @property
    def is_last_stage(self) -> bool:
        assert self.layer_range is not None and self.num_layers is not None
        return self.layer_range[1] == self.num_layers

    def _compute_each(self, work: list[Staged]) -> list[torch.Tensor | Exception]:
        out: list[torch.Tensor | Exception] = []
        for w in work:
            if self.is_first_stage:
                states = torch.tensor([[float(t), 1.0] for t in w.rows.tokens[w.start :]])
            elif w.hidden is None:
                out.append(ValueError("a later stage needs the states"))
                continue
            else:
                states = w.hidden.float() + torch.tensor([0.0, 1.0])
            if not self.is_last_stage:
                out.append(states)
                continue
            assert self.layer_range is not None
            stages = int(states[0, 1]) if len(states) else 0
            if self.layer_range[0] and stages < 2:
                out.append(ValueError("the states skipped a stage"))
                continue
            out.append(self.table[states[[r - w.start for r in w.logits_rows], 0].long()].float())
        return out


class FakePipeline(PipelineTarget):
    """The real PipelineTarget's bookkeeping (sessions, seq, restarts, verify made of segments)
    with its stages in memory: real WorkerStates over MarkovStageRunners, each stage's states
    handed to the next. ``short_at``: seqs answered 409 once (the stage lost the session)."""

    def __init__(self, name: str, stages: list[MarkovStageRunner], weight: float = 1.0) -> None:
        channel = Channel(name, httpx.AsyncClient(), httpx.Timeout(5.0))
        super().__init__(
            name,
            [[f"http://stage{i}:1"] for i in range(len(stages))],
            weight,
            channel,
            Expected("markov", stages[0].info.vocab_size),
            3,
        )
        self.states = [
            WorkerState.build(WorkerSettings(model=f"stage{i}", max_sessions=10_000), r)
            for i, r in enumerate(stages)
        ]
        self.segments: list[Segment] = []
        self.short_at: set[int] = set()
        self.freed: list[str] = []
        self.asked_k: list[int | None] = []  # the payload each segment asked the last stage for

    async def forward(
        self, session_id: str, segment: Segment, sampling: dict[str, Any]
    ) -> tuple[StageResponse, Traffic]:
        self.asked_k.append(sampling.get("k"))
        stage = self.session(session_id)
        seq, stage.seq = stage.seq, stage.seq + 1
        await asyncio.sleep(0)  # the segments in flight interleave with the strategy, as over HTTP
        self.segments.append(segment)
        if seq in self.short_at and stage.restarts == 0:
            raise StageShort(f"message {seq} lost")
        req: StageRequest | Any = stage_request(stage, seq, segment, sampling, hidden_dtype="f32")
        for state in self.states:
            answer = state.steps.verify_batch([req], [Timing()])[0]
            if isinstance(answer, SessionShort):
                raise StageShort(str(answer))
            if isinstance(answer, Exception):
                raise answer
            if isinstance(answer, StageStates):
                req = replace(req, hidden=answer.states.numpy())
                continue
            return answer, Traffic(sent=1, received=1, calls=1)
        raise AssertionError("the last stage answered states")

    async def _free(self, stage_id: str) -> None:
        self.freed.append(stage_id)
        for state in self.states:
            state.sessions.free(stage_id)

    def held(self, session_id: str) -> list[int]:
        """Rows each stage holds of the session's current stage id."""
        stage = self.session(session_id)
        return [s.runner.length(stage.id) if stage.id in s.sessions else 0 for s in self.states]


def split_pipeline(
    table: torch.Tensor, cuts: list[int], num_layers: int, eos_ids: list[int] | None = None
) -> FakePipeline:
    """A FakePipeline of ``table`` cut at ``cuts`` (e.g. [1, 2] of 3 layers: three stages)."""
    bounds = [0, *cuts, num_layers]
    return FakePipeline(
        "pipe", [MarkovStageRunner(table, (a, b), num_layers, eos_ids) for a, b in zip(bounds, bounds[1:])]
    )


def pipeline_engine(draft: MarkovRunner, target: FakePipeline, eos_ids: list[int] | None = None) -> Engine:
    return Engine(InlineDraftModel(draft), FakePool([target]), eos_ids or [], max_context=4096)  # type: ignore[arg-type, list-item]


def random_table(vocab: int, seed: int, sharpness: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, vocab, generator=g, dtype=torch.float64) * sharpness


_SETTINGS: dict[tuple[str, tuple[tuple[str, str], ...]], WorkerSettings] = {}


def _worker_settings(name: str) -> WorkerSettings:
    """``WorkerSettings(model=name, max_sessions=10_000)``, read once per value of the environment's
    SPECGATE_WORKER_* (each read takes ms; the lossless matrix builds thousands of workers)."""
    key = (name, tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("SPECGATE_WORKER_"))))
    if key not in _SETTINGS:
        _SETTINGS[key] = WorkerSettings(model=name, max_sessions=10_000)
    return _SETTINGS[key]


class FakeWorker:
    """A worker in memory: the real WorkerState (sessions, crop/append, scoring) without HTTP."""

    def __init__(self, name: str, runner: MarkovRunner, weight: float) -> None:
        self.name, self.weight, self.url = name, weight, f"mem://{name}"
        self.state = WorkerState.build(_worker_settings(name), runner)
        self.calls: list[VerifyRequest] = []

    async def verify(self, req: VerifyRequest, agreed: list[int]) -> tuple[VerifyResponse, Traffic]:
        """The worker's answer; on session_short, the resend the specgate dialect builds."""
        self.calls.append(req)
        try:
            # what the worker receives: the transform on a session's first call only
            resp = self.state.steps.verify(req.on_wire())
        except SessionShort as short:
            req = resend(req, agreed, short.held if short.held < req.prefix_len else 0)
            self.calls.append(req)
            resp = self.state.steps.verify(req.on_wire())
        check_verify_response(resp, req, self.state.runner.info.vocab_size)
        return resp, Traffic(sent=1, received=1, calls=1)

    async def delete_session(self, session_id: str) -> None:
        self.state.sessions.free(session_id)


class FakePool:
    def __init__(self, workers: list[FakeWorker]) -> None:
        self.workers = workers

    @property
    def weights(self) -> list[float]:
        return [w.weight for w in self.workers]

    async def delete_sessions(self, session_id: str) -> None:
        for worker in self.workers:
            await worker.delete_session(session_id)

    def scorable(self, sequence: list[int], draft: list[int]) -> int:
        return len(draft)


class InlineDraftModel(DraftModel):
    """The real DraftModel and its step loop, minus the thread hop (a Markov draft costs
    microseconds)."""

    def __init__(self, runner: MarkovRunner) -> None:
        super().__init__(runner, CallingThread())


def make_engine(
    draft: MarkovRunner, workers: list[tuple[MarkovRunner, float]], eos_ids: list[int] | None = None
) -> Engine:
    pool = FakePool([FakeWorker(f"w{i}", runner, w) for i, (runner, w) in enumerate(workers)])
    return Engine(InlineDraftModel(draft), pool, eos_ids or [], max_context=4096)  # type: ignore[arg-type]


V = 49152
FAVOURITE = 1000  # the fake target's most likely next token, after any context

Mutation = Callable[[VerifyResponse], bytes]  # a correct answer → the bytes a broken worker sends


class FakeWorkerTransport:
    """Answers protocol v1 for several fake workers, told apart by host; ``behaviour[host]``
    breaks one: "down", "500", "garbage", "short-once", "other-tokenizer", "other-eos" (its
    /v1/info names EOS 7, not 2), "grammar:ENGINE:BYTES" (its /v1/info names that grammar engine
    and limit), "context:N" (its /v1/info says a context of N tokens), "sleep:S" (answers
    after S seconds), "die-after:N" (down after N verify calls), "full" (503 worker_full to every
    verify call; "full:N" to the next N), "draining" (503 worker_draining to a session it has not
    seen; those it has go on), or a Mutation of its answers."""

    def __init__(self, fingerprint: str, behaviour: dict[str, str | Mutation] | None = None) -> None:
        self.fingerprint = fingerprint
        self.behaviour = behaviour or {}
        self.requests: list[tuple[str, VerifyRequest]] = []
        self.deleted: list[str] = []
        self.authorization: list[str | None] = []  # the header of each request, in order
        self.bytes_in = self.bytes_out = 0  # verify bodies received / sent, as on the wire
        self.held: set[tuple[str, str]] = set()  # (host, session id) of every verify call answered
        # (host, path) of every request, counted as it arrives
        self.arrived: Counter[tuple[str, str]] = Counter()

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.arrived[request.url.host, request.url.path] += 1
        behaviour = self.behaviour.get(request.url.host, "")
        if isinstance(behaviour, str) and behaviour.startswith("sleep:"):
            await asyncio.sleep(float(behaviour.split(":")[1]))
        response = self._answer(request)
        if request.url.path == "/v1/verify":
            self.bytes_in += len(request.content)
            self.bytes_out += len(response.content)
        return response

    def _answer(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        self.authorization.append(request.headers.get("authorization"))
        mode = self.behaviour.get(host, "")
        if isinstance(mode, str) and mode.startswith("die-after:"):
            left = int(mode.split(":")[1]) - (request.url.path == "/v1/verify")
            self.behaviour[host] = "down" if left < 0 else f"die-after:{left}"
            mode = self.behaviour[host]
        if mode == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(
                503 if mode == "draining" else 200,
                json={"status": "draining" if mode == "draining" else "ok"},
            )
        if request.url.path == "/v1/info":
            eos_ids = [7] if mode == "other-eos" else [2]
            context = (
                int(mode.split(":")[1]) if isinstance(mode, str) and mode.startswith("context:") else 2048
            )
            info = InfoResponse(
                1,
                ["aggregate", "autoregressive"],
                host,
                V,
                "other" if mode == "other-tokenizer" else self.fingerprint,
                eos_ids,
                context,
                "fake",
            )
            if isinstance(mode, str) and mode.startswith("grammar:"):
                _, engine, size = mode.split(":")
                info = replace(info, grammar_engine=engine, max_grammar_bytes=int(size))
            return httpx.Response(
                200, content=encode_json(info), headers={"content-type": "application/json"}
            )
        if request.method == "DELETE":
            self.deleted.append(request.url.path)
            return httpx.Response(204)
        req = decode(VerifyRequest, request.content, request.headers["content-type"])
        self.requests.append((host, req))
        if mode == "500":
            return httpx.Response(500, content=ErrorBody("boom", "server_error").to_json())
        if isinstance(mode, str) and mode.startswith("full"):
            left = int(mode.split(":")[1]) if ":" in mode else None
            if left is not None:
                self.behaviour[host] = f"full:{left - 1}" if left > 1 else ""
            message = (
                "worker full: every KV slot is held by one of the 8 sessions used in the last 10 s; "
                "retry after 1 s"
            )
            return httpx.Response(
                503,
                content=ErrorBody(message, "server_error", code="worker_full").to_json(),
                headers={"retry-after": "1"},
            )
        if mode == "draining" and (host, req.session_id) not in self.held:
            message = (
                "worker draining: it is shutting down and takes no new session; retry on another "
                "replica after 1 s"
            )
            return httpx.Response(
                503,
                content=ErrorBody(message, "server_error", code="worker_draining").to_json(),
                headers={"retry-after": "1"},
            )
        self.held.add((host, req.session_id))
        if mode == "garbage":
            return httpx.Response(
                200, content=b"SGv1\x05\x00\x00\x00{oops", headers={"content-type": BINARY_CONTENT_TYPE}
            )
        if mode == "short-once" and req.prefix_len > 0:
            self.behaviour[host] = ""
            return httpx.Response(
                409, content=ErrorBody("lost", "session_short", code="session_short", held=0).to_json()
            )
        logits = torch.full((len(req.draft) + 1, V), -10.0)
        logits[:, FAVOURITE] = 3.0
        logits[:, FAVOURITE + 1] = 2.0
        # echo: the prompt's rows alike
        prompt_logits = torch.full((max(len(req.tokens) - 1, 0), V), -10.0) if req.score_tokens else None
        if prompt_logits is not None:
            prompt_logits[:, FAVOURITE] = 3.0
        resp = score(
            logits,
            req,
            held=req.prefix_len + len(req.tokens) + len(req.draft),
            model_ms=0.1,
            prompt_logits=prompt_logits,
        )
        if callable(mode):
            return httpx.Response(200, content=mode(resp), headers={"content-type": BINARY_CONTENT_TYPE})
        body, content_type = encode(resp, V)
        return httpx.Response(200, content=body, headers={"content-type": content_type})


class TableMatcher:
    """A grammar over the Markov fakes' 4 tokens (EOS = 3), with the interface of
    ``core.grammar.Matcher``: the first token is forced to 2; after 1 only 0 (forced); 2 never
    follows 2; EOS only after two tokens. The engine above it is what the tests check."""

    def __init__(self, vocab_size: int = 4, eos: int = 3) -> None:
        self.vocab_size, self.eos = vocab_size, eos
        self.tokens: list[int] = []

    @staticmethod
    def allowed_after(tokens: list[int] | tuple[int, ...], vocab_size: int = 4, eos: int = 3) -> torch.Tensor:
        # [V] bool
        mask = torch.ones(vocab_size, dtype=torch.bool)
        if not tokens:
            mask[:] = False
            mask[2] = True
            return mask
        if tokens[-1] == 1:
            mask[:] = False
            mask[0] = True
            return mask
        if tokens[-1] == 2:
            mask[2] = False
        if len(tokens) < 2:
            mask[eos] = False
        return mask

    def consume(self, token: int) -> bool:
        self.tokens.append(token)
        return True

    def rollback(self, count: int) -> None:
        del self.tokens[len(self.tokens) - count :]

    def sync(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)

    def allowed(self) -> torch.Tensor:
        return self.allowed_after(self.tokens, self.vocab_size, self.eos)


class TableGrammars:
    """``core.grammar.Grammars`` for ``TableMatcher``: every spec compiles to it."""

    def compile(self, spec: Any) -> Any:
        return self

    def matcher(self) -> TableMatcher:
        return TableMatcher()


def with_table_grammar(engine: Engine) -> Engine:
    """The engine and its in-memory workers compile every grammar to ``TableMatcher``."""
    engine.grammars = TableGrammars()  # type: ignore[assignment]
    for worker in engine.pool.workers:
        if isinstance(worker, FakeWorker):
            worker.state.steps.transforms._grammars = TableGrammars()  # type: ignore[assignment]
        if isinstance(worker, FakePipeline):
            for state in worker.states:
                state.steps.transforms._grammars = TableGrammars()  # type: ignore[assignment]
    return engine
