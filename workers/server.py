"""The worker's FastAPI app (protocol v1, DESIGN §4). Route handlers parse, call, return;
errors leave in the OpenAI envelope. Verify calls are batched into steps by the
``VerifyScheduler`` (workers/scheduler.py), each step one forward on the model thread, so
``/health`` answers while a step is running."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

import httpx
import numpy as np
import torch
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from core.errors import ContextOverflow, InvalidRequest, ProtocolError, SessionShort, SpecgateError, WorkerFull
from core.protocol import (
    JSON_CONTENT_TYPE,
    PROTOCOL_VERSION,
    SERVED_MODES,
    ErrorBody,
    InfoResponse,
    StageRequest,
    StageResponse,
    VerifyRequest,
    check_stage_request,
    check_verify_request,
    decode,
    encode,
    encode_json,
)
from core.runners import ModelRunner
from core.runners.base import ForwardItem
from core.runners.model_thread import ModelThread
from core.grammar import GrammarLimits, Grammars, GrammarSpec, engine_version
from core.serving import Guard
from core.transform import Transformer, TransformSpec
from workers.scheduler import VerifyScheduler
from workers.scoring import score, tree_item
from workers.sessions import SessionStore
from workers.settings import WorkerSettings, load_target

log = logging.getLogger(__name__)


@dataclass
class WorkerState:
    """Everything one worker app owns; built by ``create_app``, never a module global."""

    settings: WorkerSettings
    runner: ModelRunner
    sessions: SessionStore
    thread: ModelThread = field(default_factory=ModelThread)  # every runner call (core.runners.model_thread)
    scheduler: VerifyScheduler = field(init=False)  # every call that touches the runner, in steps
    counters: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))  # see _WorkerCollector
    errors: Counter[str] = field(default_factory=Counter)  # refused calls, by error code
    order: StageOrder = field(default_factory=lambda: StageOrder())  # a stage: each session's messages in seq order
    _client: httpx.AsyncClient | None = None  # a stage: to the next stage
    _grammars: Grammars | None = None  # the grammar engine, built by the first call that carries a grammar

    def __post_init__(self) -> None:
        self.scheduler = VerifyScheduler(self, self.settings.max_batch_tokens)

    @property
    def is_stage(self) -> bool:
        return self.runner.layer_range is not None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.settings.stage_wait_s * 2, connect=5.0))
        return self._client

    @classmethod
    def build(cls, settings: WorkerSettings, runner: ModelRunner, thread: ModelThread | None = None) -> WorkerState:
        sessions = SessionStore(
            runner,
            max_sessions=settings.max_sessions,
            ttl_s=settings.session_ttl_s,
            memory_cap_bytes=settings.memory_cap_mb * 2**20,
            live_s=settings.session_live_s,
        )
        return cls(settings=settings, runner=runner, sessions=sessions, thread=thread or ModelThread())

    @property
    def max_context(self) -> int:
        return min(self.settings.max_context, self.runner.info.max_context)

    def info(self) -> InfoResponse:
        info = self.runner.info
        return InfoResponse(
            protocol_version=PROTOCOL_VERSION,
            modes=list(SERVED_MODES),
            model_id=info.model_id,
            vocab_size=info.vocab_size,
            tokenizer_fingerprint=self.runner.fingerprint,
            eos_ids=info.eos_ids,
            max_context=self.max_context,
            backend=info.backend,
            layer_range=list(self.runner.layer_range) if self.runner.layer_range is not None else None,
            num_layers=self.runner.num_layers,
            grammar_engine=engine_version(),
            max_grammar_bytes=self.settings.max_grammar_bytes,
        )

    def verify(self, req: VerifyRequest, timing: dict[str, float] | None = None) -> Any:
        """Crop, append, score: the body of ``POST /v1/verify`` for one call alone (runs on the
        model thread). ``timing`` gets the milliseconds of the model and of the scoring."""
        answer = self.verify_batch([req], [timing if timing is not None else {}])[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def verify_batch(self, reqs: list[VerifyRequest | StageRequest], timings: list[dict[str, float]]) -> list[Any]:
        """One scheduler step (runs on the model thread): the calls of distinct sessions checked
        and cropped one by one, then **one** runner forward over all of them, then each scored.
        Per call its ``VerifyResponse``, or the exception it alone fails with (a prefix that
        does not match, a malformed tree, …); its batch-mates are served. Each call's
        ``model_ms`` is the step's forward; ``batch_sessions`` how many calls shared it."""
        answers: list[Any] = [None] * len(reqs)
        items, order = [], []
        for i, req in enumerate(reqs):
            try:
                items.append(self._prepare_stage(req) if isinstance(req, StageRequest) else self._prepare(req))
                order.append(i)
            except Exception as exc:  # noqa: BLE001 - this call's answer
                answers[i] = exc
        started = time.perf_counter()
        try:
            outputs = self.runner.forward_each([item for item, *_ in items]) if items else []
        finally:
            for i in order:
                self.sessions.touch(reqs[i].session_id)
            for i in order:
                self.sessions.evict(keep=reqs[i].session_id)
        model_ms = (time.perf_counter() - started) * 1e3
        self.counters["model_seconds"] += model_ms / 1e3
        self.counters["steps"] += 1
        for (item, scored_tokens, shaping), i, logits in zip(items, order, outputs):
            if isinstance(logits, Exception):
                answers[i] = logits
                continue
            req = reqs[i]
            if isinstance(req, StageRequest):
                try:
                    answers[i] = self._stage_answer(req, logits, model_ms)
                except Exception as exc:  # noqa: BLE001 - this call's answer
                    answers[i] = exc
                timings[i]["model"] = model_ms
                continue
            self.counters["positions_scored"] += len(req.draft) + 1
            scored = time.perf_counter()
            try:
                rows = logits[scored_tokens:]
                if shaping is not None:  # DESIGN §3.9: each row by its own prefix
                    transformer, agreed, paths = shaping
                    rows = transformer.rows(rows, agreed, paths)
                resp = score(rows, req, self.runner.length(req.session_id), model_ms, logits[:scored_tokens] if req.score_tokens else None)
                answers[i] = replace(resp, batch_sessions=len(items)) if len(items) > 1 else resp
            except Exception as exc:  # noqa: BLE001 - this call's answer
                answers[i] = exc
            timings[i]["model"], timings[i]["score"] = model_ms, (time.perf_counter() - scored) * 1e3
        return answers

    def _prepare(self, req: VerifyRequest) -> tuple[ForwardItem, int, Shaping | None]:
        """Check a call and crop its session: the item it forwards, how many of its logits
        rows score its own tokens (echo) before the γ+1 decided positions, and how its rows are
        transformed (DESIGN §3.9; None: they are not)."""
        self.check_limits(req)
        if req.path is not None:  # v1.1: the previous tree's accepted path becomes agreed tokens (hash checked there)
            self.sessions.keep_path(req.session_id, req.prefix_len, req.prefix_hash, req.path.tolist())
        else:
            self.sessions.check_prefix(req.session_id, req.prefix_len, req.prefix_hash)
        self.sessions.admit(req.session_id, tree=req.parents is not None)
        self.runner.crop(req.session_id, req.prefix_len)
        shaping = self._shaping(req)
        scored_tokens = max(len(req.tokens) - 1, 0) if req.score_tokens else 0  # echo: the prompt's own rows too
        if req.parents is not None:  # a tree: the root's and every node's row in one forward
            return tree_item(req, self.runner.tokens(req.session_id)), scored_tokens, shaping
        tokens = [*req.tokens.tolist(), *req.draft.tolist()]
        return self.runner.append_item(req.session_id, tokens, len(req.draft) + 1 + scored_tokens), scored_tokens, shaping

    def _shaping(self, req: VerifyRequest) -> Shaping | None:
        """The session's transform (set by a call that starts it, prefix_len 0) with the agreed
        tokens and each scored row's path after them: a chain's draft[:j], a tree node's path."""
        transforms = self.sessions.transforms
        if req.prefix_len == 0:
            transforms.pop(req.session_id, None)
            if req.transform is not None:
                transforms[req.session_id] = self._transformer(req.transform)
        transformer = transforms.get(req.session_id)
        if transformer is None:
            return None
        agreed = [*self.runner.tokens(req.session_id)[: req.prefix_len], *req.tokens.tolist()]
        draft = req.draft.tolist()
        if req.parents is None:
            return transformer, agreed, [draft[:j] for j in range(len(draft) + 1)]
        return transformer, agreed, [[], *tree_paths(draft, req.parents.tolist())]

    def _transformer(self, wire: dict[str, Any]) -> Transformer:
        try:
            spec = TransformSpec.from_wire(wire)
            return Transformer.build(spec, self.runner.info.vocab_size, self.grammars() if spec.grammar is not None else None)
        except ValueError as exc:  # GrammarError included
            raise InvalidRequest(str(exc), param="transform") from exc

    async def precompile(self, wire: dict[str, Any] | None, starts: bool) -> None:
        """Compile the grammar of a call that starts a session (``starts``) off the model thread,
        into the engine's cache by content: the step that builds the session's transform finds it
        there, and the sessions batched with it do not wait for a compile."""
        if not starts or not isinstance(wire, dict) or "grammar" not in wire:
            return
        try:
            spec = GrammarSpec.from_wire(wire["grammar"])
            await asyncio.to_thread(lambda: self.grammars().compile(spec))
        except ValueError as exc:  # GrammarError included
            raise InvalidRequest(f"transform: {exc}", param="transform") from exc

    def grammars(self) -> Grammars:
        """The grammar engine over this model's tokenizer (built on first use: ~0.25 s)."""
        if self._grammars is None:
            info = self.runner.info
            self._grammars = Grammars(self.runner.tokenizer, info.vocab_size, info.eos_ids, GrammarLimits(max_source_bytes=self.settings.max_grammar_bytes))
        return self._grammars

    def _prepare_stage(self, req: StageRequest) -> tuple[ForwardItem, int, None]:
        """A stage's segment: keep the rows that survive, check the rows held, the item to run."""
        self.stage_keep(req)
        if not len(req.tokens):
            raise InvalidRequest("a stage forward appends at least one row (a prune alone goes to /v1/stage/keep)", param="tokens")
        if req.prefix_len + len(req.tokens) > self.max_context:
            raise ContextOverflow(f"the session would hold {req.prefix_len + len(req.tokens)} rows, the context is {self.max_context}", param="tokens")
        self.sessions.admit(req.session_id, tree=True)
        if req.prefix_len == 0 and self.runner.is_last_stage:  # the session's transform, set by the message that starts it
            self.sessions.transforms.pop(req.session_id, None)
            if req.transform is not None:
                self.sessions.transforms[req.session_id] = self._transformer(req.transform)
        count = len(req.tokens)
        hidden = torch.from_numpy(np.array(req.hidden, dtype=np.float32)) if req.hidden is not None else None
        scored = list(range(req.score_from, count)) or [count - 1]
        parents = req.parents.tolist() if req.parents is not None else None
        return ForwardItem(req.session_id, req.prefix_len, req.tokens.tolist(), parents, scored, hidden), 0, None

    def _stage_shaping(self, req: StageRequest, held: int, scored: int) -> Shaping | None:
        """The last stage's ``_shaping``: the session's transform, and each of the ``scored``
        rows' prefix — the row's ancestors' tokens and its own — split into what they share and
        each row's rest."""
        transformer = self.sessions.transforms.get(req.session_id)
        if transformer is None:
            return None
        first = held - len(req.tokens) + req.score_from
        contexts = [self.runner.context(req.session_id, row) for row in range(first, first + scored)]
        agreed = contexts[0][: _common_prefix(contexts)]
        return transformer, agreed, [c[len(agreed) :] for c in contexts]

    def stage_keep(self, req: StageRequest) -> int:
        """Apply a stage message's ``keep`` and check the session then holds ``prefix_len``
        rows (409 session_short otherwise); the rows held."""
        check_stage_request(req, self.runner.info.vocab_size, self.runner.hidden_size, self.runner.is_first_stage)
        held = self.runner.length(req.session_id) if req.session_id in self.sessions else 0
        if req.keep is not None and held:
            try:
                self.runner.keep(req.session_id, req.keep.tolist())
            except ValueError as exc:
                raise InvalidRequest(f"keep: {exc}", param="keep") from exc
            held = self.runner.length(req.session_id)
        if held != req.prefix_len:
            raise SessionShort(req.session_id, held, f"the stage holds {held} rows, the call assumes {req.prefix_len}")
        return held

    def _stage_answer(self, req: StageRequest, output: torch.Tensor, model_ms: float) -> StageResponse | StageStates:
        """The last stage's payload at the scored rows; another stage's states, to send on."""
        held = self.runner.length(req.session_id)
        self.counters["positions_scored"] += len(req.tokens) - req.score_from
        if not self.runner.is_last_stage:
            return StageStates(output, model_ms, held)
        rows = output if req.score_from < len(req.tokens) else output[:0]
        as_verify = VerifyRequest(
            session_id=req.session_id, prefix_len=0, prefix_hash="", tokens=np.zeros(0, np.int64), draft=np.zeros(max(len(rows) - 1, 0), np.int64),
            temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, k=req.k, probs_dtype=req.probs_dtype, reconstruction=req.reconstruction,
            min_p=req.min_p,
        )
        if not len(rows):
            return StageResponse(held=held, stage_ms=np.array([model_ms], np.float32), hop_bytes=np.zeros(0, np.int32))
        shaping = self._stage_shaping(req, held, len(rows))
        if shaping is not None:  # DESIGN §3.9: each scored row by its own prefix
            transformer, agreed, paths = shaping
            rows = transformer.rows(rows, agreed, paths)
        scored = score(rows, as_verify, held, model_ms)
        return StageResponse(
            held=held, probs=scored.probs, tail_mass=scored.tail_mass, ids=scored.ids, recon_error=scored.recon_error,
            probs_dtype=scored.probs_dtype, stage_ms=np.array([model_ms], np.float32), hop_bytes=np.zeros(0, np.int32),
        )

    async def send_on(self, req: StageRequest, states: StageStates) -> StageResponse:
        """A stage before the last: its new rows' states to the next stage (after the emulated
        link's delay), and that stage's answer with this one's time in front."""
        urls = list(req.next) if req.next else ([self.settings.next] if self.settings.next else [])
        if not urls:
            raise InvalidRequest(
                f"this stage (layers {self.settings.layers}) is not the last: the call must name the next stages (next), or the worker its --next",
                param="next",
            )
        onward = replace(req, hidden=states.states.float().numpy(), next=urls[1:])
        payload, content_type = encode(onward, self.runner.info.vocab_size)
        if self.settings.link_rtt_ms or self.settings.link_mbps:
            rate = self.settings.link_mbps * 1e6 / 8
            await asyncio.sleep(self.settings.link_rtt_ms / 2e3 + (len(payload) / rate if rate else 0.0))
        headers = {"content-type": content_type}
        if self.settings.token:
            headers["authorization"] = f"Bearer {self.settings.token}"
        url = urls[0].rstrip("/")
        try:
            answer = await self.client().post(f"{url}/v1/stage/forward", content=payload, headers=headers)
        except httpx.HTTPError as exc:
            message = f"the next stage {url} is unreachable: {type(exc).__name__} {exc}"
            raise StageFailed(502, ErrorBody(message, "server_error", param=url, code="stage_unreachable")) from exc
        if answer.status_code != 200:
            try:
                body = ErrorBody.from_json(answer.content)
            except ProtocolError:
                body = ErrorBody(f"answered {answer.status_code}", "server_error")
            if answer.status_code >= 500 and body.code not in ("stage_unreachable", "stage_failed"):  # that stage failed itself
                body = replace(body, param=url, code="stage_failed")
            raise StageFailed(answer.status_code, replace(body, message=f"stage {url}: {body.message}"))
        try:
            resp = decode(StageResponse, answer.content, answer.headers.get("content-type"))
        except ProtocolError as exc:
            raise StageFailed(502, ErrorBody(f"stage {url} answered garbage: {exc}", "server_error", param=url, code="stage_failed")) from exc
        stage_ms = np.concatenate([[states.model_ms], np.asarray(resp.stage_ms if resp.stage_ms is not None else [], np.float32)]).astype(np.float32)
        hops = np.concatenate([[len(payload)], np.asarray(resp.hop_bytes if resp.hop_bytes is not None else [], np.int32)]).astype(np.int32)
        return replace(resp, stage_ms=stage_ms, hop_bytes=hops)

    def check_limits(self, req: VerifyRequest) -> None:
        check_verify_request(req, self.runner.info.vocab_size)
        if len(req.draft) > self.settings.max_draft:
            raise InvalidRequest(f"draft of {len(req.draft)} tokens exceeds max_draft {self.settings.max_draft}", param="draft")
        if req.tokens.size == 0 and req.prefix_len == 0:
            raise InvalidRequest("a session starts with at least one token", param="tokens")
        total = req.prefix_len + len(req.tokens) + len(req.draft)
        if total > self.max_context:
            raise ContextOverflow(
                f"prefix {req.prefix_len} + {len(req.tokens)} tokens + draft {len(req.draft)} "
                f"exceeds the context of {self.max_context}",
                param="draft",
            )


def _common_prefix(sequences: list[list[int]]) -> int:
    """How many leading tokens every sequence shares."""
    shortest = min(len(s) for s in sequences)
    return next((i for i in range(shortest) if any(s[i] != sequences[0][i] for s in sequences)), shortest)


Shaping = tuple[Transformer, list[int], list[list[int]]]  # a call's transform, its agreed tokens, each scored row's path after them


def tree_paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Each node's tokens from the root's child down to itself (parents come before children)."""
    paths: list[list[int]] = []
    for node, parent in enumerate(parents):
        paths.append([*(paths[parent] if parent >= 0 else []), tokens[node]])
    return paths


@dataclass
class StageStates:
    """A stage's output before the last: the new rows' states, to send on."""

    states: torch.Tensor  # [t, hidden]
    model_ms: float
    held: int


class StageFailed(Exception):
    """A later stage failed or could not be reached: its status and error, passed back."""

    def __init__(self, status: int, body: ErrorBody) -> None:
        super().__init__(body.message)
        self.status, self.body = status, body


class StageOrder:
    """Each session's stage messages in ``seq`` order: they come by different paths (from the
    stage before, or from the gateway) and may overtake each other."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}
        self._changed = asyncio.Condition()

    async def turn(self, session_id: str, seq: int, wait_s: float) -> None:
        """Return once every earlier message of the session was taken; 409 if ``seq`` was
        taken already, or the earlier ones do not come within ``wait_s``."""
        async with self._changed:
            if seq < self._next.get(session_id, 0):
                raise SessionShort(session_id, 0, f"message {seq} came after message {self._next[session_id] - 1}")
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self._next.get(session_id, 0) == seq), wait_s)
            except TimeoutError:
                raise SessionShort(session_id, 0, f"message {seq} waited {wait_s:g} s for message {self._next.get(session_id, 0)}") from None

    async def done(self, session_id: str, seq: int) -> None:
        async with self._changed:
            self._next[session_id] = max(self._next.get(session_id, 0), seq + 1)
            self._changed.notify_all()

    def forget(self, session_id: str) -> None:
        self._next.pop(session_id, None)


def create_app(settings: WorkerSettings, runner: ModelRunner | None = None, thread: ModelThread | None = None) -> FastAPI:
    """A worker app for ``settings``; loads the model at start-up unless ``runner`` is given
    (with the ``thread`` it was loaded on: every runner call then runs there)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if runner is None:
            own = ModelThread()
            loaded = await own.run(load_target, settings)
            await own.run(lambda: loaded.fingerprint)
            await own.run(loaded.warm_up)
            app.state.worker = WorkerState.build(settings, loaded, own)
        log.info("worker ready: %s on %s", settings.model, settings.backend.value)
        yield
        state: WorkerState | None = getattr(app.state, "worker", None)
        if state is not None:
            if runner is None:
                await state.scheduler.exclusive(state.runner.close)
            await state.scheduler.close()
            if state._client is not None:
                await state._client.aclose()
            if runner is None:
                state.thread.close()

    app = FastAPI(title="specgate worker", lifespan=lifespan)
    if runner is not None:
        app.state.worker = WorkerState.build(settings, runner, thread)
    app.state.draining = False

    def start_drain() -> None:  # SIGTERM: in-flight calls finish, new ones get a 503
        app.state.draining = True

    app.state.start_drain = start_drain
    app.add_middleware(Guard, token=settings.token, max_body_bytes=settings.max_body_bytes, is_draining=lambda: app.state.draining)
    _add_routes(app, settings)
    _add_error_handlers(app)
    return app


def _state(request: Request) -> WorkerState:
    return request.app.state.worker


def _stage_request(state: WorkerState, body: bytes, content_type: str | None) -> StageRequest:
    if not state.is_stage:
        raise InvalidRequest("this worker serves the whole model: it answers /v1/verify (start a stage with --layers first:end)", param="layers")
    return decode(StageRequest, body, content_type)


def _add_routes(app: FastAPI, settings: WorkerSettings) -> None:
    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        threads = {"model": _state(request).runner.threads, "torch": torch.get_num_threads()}
        return {"status": "ok", "instance_id": settings.instance_id, "threads": threads}

    @app.get("/v1/info")
    async def info(request: Request) -> Response:
        return Response(encode_json(_state(request).info()), media_type=JSON_CONTENT_TYPE)

    @app.post("/v1/verify")
    async def verify(request: Request) -> Response:
        state = _state(request)
        started = time.perf_counter()
        body = await request.body()  # the Guard capped its size
        req = decode(VerifyRequest, body, request.headers.get("content-type"))
        if state.is_stage:
            raise InvalidRequest(f"this worker is a pipeline stage (layers {state.settings.layers}): it answers /v1/stage/forward, not /v1/verify", param="mode")
        await state.precompile(req.transform, req.prefix_len == 0)
        decoded = time.perf_counter()
        timing: dict[str, float] = {}
        resp = await state.scheduler.verify(req, timing)
        encoding = time.perf_counter()
        as_json = JSON_CONTENT_TYPE in request.headers.get("accept", "")
        payload, content_type = encode(resp, state.runner.info.vocab_size, as_json=as_json)
        state.counters["requests"] += 1
        state.counters["bytes_in"] += len(body)
        state.counters["bytes_out"] += len(payload)
        done = time.perf_counter()
        queue = (encoding - decoded) * 1e3 - timing.get("model", 0.0) - timing.get("score", 0.0)  # waiting for its step, and the batch-mates' scoring
        timing.update(codec=(decoded - started + done - encoding) * 1e3, queue=max(queue, 0.0), total=(done - started) * 1e3)
        return Response(payload, media_type=content_type, headers={"server-timing": server_timing(timing)})

    @app.post("/v1/stage/forward")
    async def stage_forward(request: Request) -> Response:
        state = _state(request)
        body = await request.body()
        req = _stage_request(state, body, request.headers.get("content-type"))
        await state.precompile(req.transform, req.prefix_len == 0 and state.runner.is_last_stage)
        await state.order.turn(req.session_id, req.seq, state.settings.stage_wait_s)
        try:
            out = await state.scheduler.verify(req, {})
        finally:
            await state.order.done(req.session_id, req.seq)  # the next message may run while this one goes on
        resp = await state.send_on(req, out) if isinstance(out, StageStates) else out
        state.counters["requests"] += 1
        state.counters["bytes_in"] += len(body)
        payload, content_type = encode(resp, state.runner.info.vocab_size, as_json=JSON_CONTENT_TYPE in request.headers.get("accept", ""))
        state.counters["bytes_out"] += len(payload)
        return Response(payload, media_type=content_type)

    @app.post("/v1/stage/keep")
    async def stage_keep(request: Request) -> Response:
        state = _state(request)
        req = _stage_request(state, await request.body(), request.headers.get("content-type"))
        if len(req.tokens):
            raise InvalidRequest("/v1/stage/keep takes keep alone: no tokens", param="tokens")
        await state.order.turn(req.session_id, req.seq, state.settings.stage_wait_s)
        try:
            held = await state.scheduler.exclusive(state.stage_keep, req)
        finally:
            await state.order.done(req.session_id, req.seq)
        payload, content_type = encode(StageResponse(held=held), state.runner.info.vocab_size, as_json=JSON_CONTENT_TYPE in request.headers.get("accept", ""))
        return Response(payload, media_type=content_type)

    @app.delete("/v1/sessions/{session_id}", status_code=204)
    async def delete_session(session_id: str, request: Request) -> Response:
        state = _state(request)
        await state.scheduler.exclusive(state.sessions.free, session_id)  # after the step in progress
        state.order.forget(session_id)
        return Response(status_code=204)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        registry = CollectorRegistry()
        registry.register(_WorkerCollector(_state(request)))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


class _WorkerCollector(Collector):
    """The worker's ``/metrics``, read from its state at scrape time."""

    _COUNTERS = {
        "requests": "Verify calls answered.",
        "positions_scored": "Positions scored (γ+1 per call).",
        "model_seconds": "Seconds spent in the model.",
        "bytes_in": "Bytes of verify requests received.",
        "bytes_out": "Bytes of verify answers sent.",
    }

    def __init__(self, state: WorkerState) -> None:
        self.state = state

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        state = self.state
        for name, doc in self._COUNTERS.items():
            yield CounterMetricFamily(f"specgate:verify_{name}", doc, value=state.counters[name])
        errors = CounterMetricFamily("specgate:verify_errors", "Refused verify calls, by error code.", labels=["code"])
        for code, count in sorted(state.errors.items()):
            errors.add_metric([code], count)
        yield errors
        yield CounterMetricFamily("specgate:worker_restarts", "Times `specgate serve` restarted this worker after it died.", value=state.settings.restarts)
        yield GaugeMetricFamily("specgate:sessions", "Sessions held.", value=len(state.sessions))
        yield CounterMetricFamily("specgate:sessions_evicted", "Sessions evicted (LRU, TTL, memory).", value=state.sessions.num_evicted)
        yield GaugeMetricFamily("specgate:session_memory_bytes", "Memory the sessions' caches take.", value=state.runner.memory_bytes())


def server_timing(timing: dict[str, float]) -> str:
    """The W3C ``Server-Timing`` header of a verify call: where its milliseconds went (codec:
    decoding the request and encoding the answer; queue: waiting for the model; model; score:
    logits to payload; total: the handler, body read to answer encoded)."""
    return ", ".join(f"{name};dur={ms:.3f}" for name, ms in timing.items())


def _error(status: int, body: ErrorBody) -> Response:
    return Response(body.to_json(), status_code=status, media_type=JSON_CONTENT_TYPE)


def _add_error_handlers(app: FastAPI) -> None:
    def count(request: Request, code: str) -> None:
        state = getattr(request.app.state, "worker", None)
        if state is not None:
            state.errors[code] += 1

    @app.exception_handler(SessionShort)
    async def session_short(request: Request, exc: SessionShort) -> Response:
        count(request, "session_short")
        body = ErrorBody(str(exc), "session_short", param="prefix_len", code="session_short", held=exc.held)
        return _error(409, body)

    @app.exception_handler(StageFailed)
    async def stage_failed(request: Request, exc: StageFailed) -> Response:
        count(request, exc.body.code or "stage_failed")
        return _error(exc.status, exc.body)

    @app.exception_handler(ProtocolError)
    async def bad_request(request: Request, exc: ProtocolError) -> Response:
        code = "context_length_exceeded" if isinstance(exc, ContextOverflow) else "invalid_request"
        count(request, code)
        return _error(400, ErrorBody(str(exc), "invalid_request_error", param=exc.param, code=code))

    @app.exception_handler(WorkerFull)
    async def worker_full(request: Request, exc: WorkerFull) -> Response:
        count(request, "worker_full")
        response = _error(503, ErrorBody(str(exc), "server_error", code="worker_full"))
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    @app.exception_handler(SpecgateError)
    async def specgate_error(request: Request, exc: SpecgateError) -> Response:
        count(request, "server_error")
        return _error(500, ErrorBody(str(exc), "server_error", code="server_error"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error in %s", request.url.path)
        count(request, "server_error")
        return _error(500, ErrorBody(f"internal error: {type(exc).__name__}", "server_error", code="server_error"))

    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, ErrorBody(str(exc.detail), kind, code=str(exc.status_code)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error(400, ErrorBody(str(exc.errors()), "invalid_request_error", code="invalid_request"))
