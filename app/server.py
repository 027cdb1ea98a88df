"""The gateway's FastAPI app (docs/design.md §5): OpenAI routes, SSE streaming, errors in the envelope. Route
handlers parse, call the Gateway (app.gateway), return."""

from __future__ import annotations

import asyncio
import html
import json
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import orjson
import torch
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException

from app.adaptive import MAX_AUTO_GAMMA
from app.admission import Admission, Release
from app.bodies import (
    Logprobs,
    chat_body,
    chat_chunks,
    completion_body,
    completion_chunks,
    envelope,
    usage,
)
from app.drafting import DraftModel
from app.engine.strategies import check_strategies
from app.errors import ApiError
from app.gateway import ChoiceEvent, Gateway
from app.metrics import GatewayMetrics
from app.requests import Job
from app.responses_api.output import ResponseBuilder, item_page
from app.responses_api.request import renamed, to_chat
from app.responses_api.schemas import ResponsesRequest
from app.responses_api.store import NONE as NO_STORE
from app.responses_api.store import ResponseStore
from app.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from app.targets.channel import Expected
from app.targets.failures import WorkerError
from app.targets.pool import TargetSet
from core.config import SpecgateConfig
from core.errors import ConfigError
from core.runners import ModelRunner, load_runner
from core.runners.model_thread import ModelThread
from core.runners.models import BUILTIN
from core.runners.tokenizer_only import NONE, tokenizer_only
from core.serving import Guard, PortSplit

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
T = TypeVar("T")
B = TypeVar("B", CompletionRequest, ChatCompletionRequest)
Chunks = Callable[[ChoiceEvent | None], list[dict[str, Any]]]
Whole = Callable[[list[ChoiceEvent]], dict[str, Any]]


def load_draft(config: SpecgateConfig) -> ModelRunner:
    """The draft runner, loaded on its own thread, fingerprinted and warmed up (the first request as fast as
    the next); ``draft.model: none``: a tokenizer."""
    draft = config.draft
    if draft.model == NONE:
        runner: ModelRunner = tokenizer_only(draft.tokenizer or BUILTIN, config.draft_context)
    else:
        runner = load_runner(
            draft.model,
            draft.backend.value,
            config.draft_context,
            draft.memory_cap_mb,
            draft.threads,
            draft.device,
            draft.dtype,
            forward=draft.forward,
        )
    runner.fingerprint  # noqa: B018 - computed before the first request
    runner.warm_up()
    return runner


def create_app(
    config: SpecgateConfig,
    draft_runner: ModelRunner | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    instance_id: str | None = None,
    model_thread: ModelThread | None = None,
) -> FastAPI:
    """The gateway for ``config``; ``draft_runner``, ``transport``: tests' stand-ins; ``/health`` reports
    ``instance_id`` (``specgate serve`` knows its own)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncGenerator[None, None]:
        runner, thread = draft_runner, model_thread or ModelThread()
        if runner is None:
            runner = await thread.run(load_draft, config)
        pool = TargetSet.from_config(
            config, Expected(runner.fingerprint, runner.info.vocab_size, runner.tokenizer), transport
        )
        metrics.watch(pool)
        draft_model = DraftModel(runner, thread, config.draft.max_batch_tokens)
        metrics.watch_draft(draft_model)
        gateway = app.state.gateway = Gateway(config, draft_model, pool, metrics)
        app.state.logprobs = Logprobs(gateway.tokenizer)
        app.state.draft_threads = runner.threads
        await pool.discover()
        for entry in await gateway.check_workers():
            if entry.get("fatal"):  # a pipeline whose stages answer but cannot make it (docs/design.md §3.7)
                log.error("%s", entry["error"])
                await pool.close()
                raise ConfigError(entry["error"])
            if not entry["ready"]:
                log.warning("worker %s not ready at start-up: %s", entry["name"], entry["error"])
        store = config.responses.store
        app.state.response_store = (
            None
            if store == NO_STORE
            else await asyncio.to_thread(
                ResponseStore, store, config.responses.retention_s, config.responses.max_bytes
            )
        )
        pool.start()
        yield
        await pool.close()
        if app.state.response_store is not None:
            app.state.response_store.close()
        if draft_runner is None:
            await thread.run(runner.close)
        if model_thread is None:
            thread.close()

    check_strategies()
    app = FastAPI(title="specgate", lifespan=lifespan)
    app.state.instance_id = instance_id or uuid.uuid4().hex
    limits = config.limits
    admission = app.state.admission = Admission(
        limits.max_concurrent_requests, limits.max_queued_requests, limits.queue_timeout_s
    )
    metrics = app.state.metrics = GatewayMetrics(admission)
    gamma = config.speculative.num_draft_tokens
    metrics.open_series(str(config.speculative.mode), gamma if isinstance(gamma, int) else MAX_AUTO_GAMMA + 1)
    app.add_middleware(
        Guard,
        token=config.api_key,
        max_body_bytes=limits.max_body_bytes,
        is_draining=lambda: admission.is_draining,
    )
    if config.metrics_port is not None:
        app.add_middleware(PortSplit, metrics_port=config.metrics_port)
    _add_routes(app)
    _add_error_handlers(app)
    return app


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def _add_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        threads = {
            "draft": getattr(request.app.state, "draft_threads", None),
            "torch": torch.get_num_threads(),
        }
        return {"status": "ok", "instance_id": request.app.state.instance_id, "threads": threads}

    @app.get("/health/live")
    async def live(request: Request) -> dict[str, Any]:
        """Liveness: the process and its event loop answer, draining or not (a drain must not end in a
        restart)."""
        return {
            "status": "draining" if request.app.state.admission.is_draining else "ok",
            "instance_id": request.app.state.instance_id,
        }

    @app.get("/health/serving")
    async def serving(request: Request) -> Response:
        """Readiness from the gateway's own state: it takes requests (its draft loaded, not draining). The
        targets are not asked: one target down must not take every gateway out of its Service (its requests
        get a JSON 503, and /health/ready says which target)."""
        if request.app.state.admission.is_draining:
            return JSONResponse(
                {"status": "draining", "instance_id": request.app.state.instance_id},
                status_code=503,
                headers={"Retry-After": "5"},
            )
        return JSONResponse({"status": "serving", "instance_id": request.app.state.instance_id})

    @app.get("/", include_in_schema=False)
    async def chat_page(request: Request) -> Response:
        """The chat page (app/static): plain HTML, CSS and JavaScript, nothing from outside."""
        page = (STATIC / "index.html").read_text()
        model = html.escape(_gateway(request).config.model, quote=True)
        return HTMLResponse(page.replace("<body>", f'<body data-model="{model}">', 1))

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/health/ready")
    async def ready(request: Request) -> Response:
        if request.app.state.admission.is_draining:  # SIGTERM: the Service stops routing here at once
            body = {"status": "draining", "instance_id": request.app.state.instance_id}
            return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
        gateway = _gateway(request)
        # within a probe's timeout, whatever hangs
        report = await gateway.check_workers(gateway.config.health.ready_timeout_s)
        ok = all(e["ready"] for e in report)
        draft = "loaded" if _gateway(request).draft.runner.has_weights else "none"
        body = {
            "status": "ready" if ok else "not_ready",
            "instance_id": request.app.state.instance_id,
            "draft": draft,
            "workers": report,
        }
        return JSONResponse(
            body, status_code=200 if ok else 503, headers=None if ok else {"Retry-After": "5"}
        )

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gateway = _gateway(request)
        # max_model_len as vLLM: the context a request may fill, the draft's and every worker's
        model = {
            "id": gateway.config.model,
            "object": "model",
            "created": 0,
            "owned_by": "specgate",
            "max_model_len": gateway.engine.max_context,
        }
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _respond(
            request, body, _gateway(request).requests.completion_job, completion_chunks, completion_body
        )

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await _respond(request, body, _gateway(request).requests.chat_job, chat_chunks, chat_body)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await _respond_responses(request, body)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> Response:
        found = await asyncio.to_thread(_store(request).get, response_id)
        if found is None:
            raise ApiError(
                404,
                f"no response {response_id!r} is stored here (never stored, deleted, or past "
                "responses.retention_s)",
                "response_id",
                "not_found",
                "not_found_error",
            )
        return Response(orjson.dumps(found[0]), media_type="application/json")

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        response_id: str, request: Request, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> Response:
        if not 1 <= limit <= 100:
            raise ApiError(400, "limit is between 1 and 100", "limit")
        if order not in ("asc", "desc"):
            raise ApiError(400, "order is asc or desc", "order")
        found = await asyncio.to_thread(_store(request).input_items, response_id)
        if found is None:
            raise ApiError(
                404,
                f"no response {response_id!r} is stored here (never stored, deleted, or past "
                "responses.retention_s)",
                "response_id",
                "not_found",
                "not_found_error",
            )
        return Response(
            orjson.dumps(item_page(response_id, found, limit, order, after)), media_type="application/json"
        )

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> Response:
        if not await asyncio.to_thread(_store(request).delete, response_id):
            raise ApiError(
                404,
                f"no response {response_id!r} is stored here",
                "response_id",
                "not_found",
                "not_found_error",
            )
        return Response(
            orjson.dumps({"id": response_id, "object": "response", "deleted": True}),
            media_type="application/json",
        )

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        return Response(
            orjson.dumps(_gateway(request).requests.tokenize(body)), media_type="application/json"
        )

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        return Response(
            orjson.dumps(_gateway(request).requests.detokenize(body)), media_type="application/json"
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def _respond(
    request: Request,
    body: B,
    to_job: Callable[[B], Job],
    chunks: Callable[[Logprobs, Job], Chunks],
    whole: Callable[[Logprobs, Job], Whole],
) -> Response:
    gateway, logprobs = _gateway(request), request.app.state.logprobs
    job = to_job(body)
    await gateway.compile(job)
    await gateway.ensure_workers()
    release = await request.app.state.admission.enter()  # 429 here, before any byte of a stream
    if not body.stream:
        try:
            events = await _unless_disconnected(request, gateway.collect(job))
        finally:
            release()
        return JSONResponse(whole(logprobs, job)(events))
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    stream = _sse(request, job, include_usage, chunks(logprobs, job), release)
    grace = gateway.config.limits.drain_timeout_s + 1  # our own deadline ends the stream first
    return _Stream(stream, release, ping=15, sep="\n", shutdown_grace_period=grace)


def _store(request: Request) -> ResponseStore:
    store: ResponseStore | None = request.app.state.response_store
    if store is None:
        raise ApiError(
            404,
            "this gateway keeps no responses (responses.store: none)",
            "response_id",
            "not_found",
            "not_found_error",
        )
    return store


async def _respond_responses(request: Request, body: ResponsesRequest) -> Response:
    """``POST /v1/responses``: the request run as its chat request (app.responses_api.request), the answer as
    a response object or its stream of events; kept in the store unless ``store: false``."""
    gateway, store = _gateway(request), request.app.state.response_store
    previous = None
    if body.previous_response_id is not None:
        if store is None:
            raise ApiError(
                400,
                "previous_response_id needs stored responses: this gateway runs with "
                "responses.store: none (send the whole conversation as input)",
                "previous_response_id",
            )
        found = await asyncio.to_thread(store.get, body.previous_response_id)
        if found is None:
            message = (
                f"previous response {body.previous_response_id!r} is not stored here (never stored, "
                "deleted, past responses.retention_s, or kept by another gateway)"
            )
            raise ApiError(
                404, message, "previous_response_id", "previous_response_not_found", "not_found_error"
            )
        previous = found[1]
    translated = to_chat(body, previous)
    for warning in translated.warnings:
        log.warning("response: %s", warning)
    try:
        job = gateway.requests.chat_job(translated.chat)
        await gateway.compile(job)
    except ApiError as exc:
        raise renamed(exc, translated) from None
    await gateway.ensure_workers()
    keep = store if body.store is not False else None
    builder = ResponseBuilder(body, translated, job, keep is not None)
    release = await request.app.state.admission.enter()
    if not body.stream:
        try:
            events = await _unless_disconnected(request, gateway.collect(job))
        finally:
            release()
        builder.push(_deltas(events[0]))
        builder.finish(events[0].finish_reason)
        await _keep(keep, builder)
        return Response(_json(builder.response()), media_type="application/json")
    grace = gateway.config.limits.drain_timeout_s + 1
    return _Stream(
        _response_events(request, job, builder, keep, release),
        release,
        ping=15,
        sep="\n",
        shutdown_grace_period=grace,
    )


def _deltas(event: ChoiceEvent) -> list[dict[str, Any]]:
    return event.deltas if event.deltas is not None else [{"content": event.text}] if event.text else []


async def _keep(store: ResponseStore | None, builder: ResponseBuilder) -> None:
    if store is None:
        return
    try:
        await asyncio.to_thread(
            store.put, builder.response(), builder.translated.new_items, builder.body.previous_response_id
        )
    except Exception:  # noqa: BLE001 - the answer is given; a store that fails loses only the chaining
        log.exception("response %s could not be stored", builder.id)


async def _response_events(
    request: Request, job: Job, builder: ResponseBuilder, store: ResponseStore | None, release: Release
) -> AsyncGenerator[dict[str, str], None]:
    """The Responses stream (``event: response.…``): created, in_progress, the items' events, then completed
    or incomplete; a failure is an ``error`` event and ``response.failed``, never a cut stream."""
    admission: Admission = request.app.state.admission
    try:
        for event in builder.start():
            yield _typed(event)
        finish = None
        async with aclosing(_gateway(request).events(job)) as events:
            async for choice_event in events:
                for event in builder.push(_deltas(choice_event)):
                    yield _typed(event)
                finish = choice_event.finish_reason or finish
                if admission.drain_expired():
                    raise ApiError(
                        503,
                        "the gateway shut down before this stream finished",
                        code="shutting_down",
                        kind="server_error",
                    )
        *closing, terminal = builder.finish(finish)
        for event in closing:
            yield _typed(event)
        release()
        await _keep(store, builder)  # stored before the terminal event: a client that chains at once finds it
        yield _typed(terminal)
    except Exception as exc:  # noqa: BLE001 - never a stream cut short: the error event, then response.failed
        if isinstance(exc, WorkerError):
            log.warning("response %s failed: %s", builder.id, exc)
        elif not isinstance(exc, ApiError):
            log.exception("response %s failed", builder.id)
        *closing, terminal = builder.fail(_api_error(exc))
        for event in closing:
            yield _typed(event)
        release()
        await _keep(store, builder)
        yield _typed(terminal)
    finally:
        release()


def _typed(event: dict[str, Any]) -> dict[str, str]:
    return {"event": event["type"], **_data(event)}


def _json(payload: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(payload)
    except orjson.JSONEncodeError:
        return json.dumps(payload, ensure_ascii=True, separators=(",", ":")).encode()


class _Stream(EventSourceResponse):
    """An SSE response that gives its admission slot back however it ends (even unstarted)."""

    def __init__(
        self, content: AsyncGenerator[dict[str, str], None], release: Release, **kwargs: Any
    ) -> None:
        super().__init__(content, **kwargs)
        self.release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``, cancelled if the client goes away first (then the engine frees its sessions)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ApiError(499, "the client closed the connection", code="client_closed")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _sse(
    request: Request, job: Job, include_usage: bool, chunks: Chunks, release: Release
) -> AsyncGenerator[dict[str, str], None]:
    """``data: {chunk}`` … ``data: [DONE]``; a failure mid-stream is an error event, then [DONE]. A client
    that goes away cancels this generator at its next await (the engine's ``finally`` frees the sessions)."""
    admission: Admission = request.app.state.admission
    usage_field = {"usage": None} if include_usage else {}
    try:
        for chunk in chunks(None):
            yield _data({**chunk, **usage_field})
        async with aclosing(_gateway(request).events(job)) as events:
            async for event in events:
                for chunk in chunks(event):
                    yield _data({**chunk, **usage_field})
                if admission.drain_expired():
                    raise ApiError(
                        503,
                        "the gateway shut down before this stream finished",
                        code="shutting_down",
                        kind="server_error",
                    )
        if include_usage:
            yield _data({**envelope(job), "choices": [], **usage(job)})
    except Exception as exc:  # noqa: BLE001 - never a stream cut short: an error event, then [DONE]
        if isinstance(exc, WorkerError):
            log.warning("stream %s failed: %s", job.id, exc)
        elif not isinstance(exc, ApiError):
            log.exception("stream %s failed", job.id)
        yield _data(_api_error(exc).body())
    finally:
        release()
    yield {"data": "[DONE]"}


def _data(payload: dict[str, Any]) -> dict[str, str]:
    try:
        return {"data": orjson.dumps(payload).decode()}
    except orjson.JSONEncodeError:  # a lone surrogate quoted from a request: JSON's escapes carry it
        return {"data": json.dumps(payload, ensure_ascii=True, separators=(",", ":"))}


class _AsciiJSON(JSONResponse):
    """JSON in ASCII: an error message may quote what a client sent, lone surrogates included."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def _api_error(exc: Exception) -> ApiError:
    """Any error as its client sees it: a worker's as ``worker_error``, an unexpected one as a 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, WorkerError):
        return ApiError(exc.status, str(exc), code="worker_error", kind="server_error")
    return ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error", kind="server_error")


def _error(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return _AsciiJSON(error.body(), status_code=error.status, headers=headers)


def _field(error: Any, body: Any) -> list[str]:
    """A validation error's place in the request as it was sent: the body walked along its ``loc``, pydantic's
    union labels (``str``, ``list[…]``, a tag) skipped; a missing field named."""
    loc = list(error.get("loc", ()))
    parts, node, out = loc[1:] if loc[:1] == ["body"] else loc, body, []
    for i, part in enumerate(parts):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif not (error.get("type") == "missing" and i == len(parts) - 1):
            continue
        out.append(str(part))
    return out


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error(exc, {"Retry-After": "1"} if exc.status in (429, 503) else None)

    @app.exception_handler(WorkerError)
    async def worker_error(request: Request, exc: WorkerError) -> Response:
        return _error(_api_error(exc), {"Retry-After": "5"} if exc.status == 503 else None)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0]
        loc = [str(p) for p in first.get("loc", ())]
        if first.get("type") == "json_invalid":
            return _error(ApiError(400, f"malformed JSON body: {first.get('msg')}", code="invalid_json"))
        if loc == ["body"]:
            # the body itself: not a JSON object (or sent without Content-Type: application/json)
            return _error(
                ApiError(
                    400,
                    "the body must be a JSON object, sent with Content-Type: application/json",
                    code="invalid_json",
                )
            )
        fields = [_field(e, exc.body) for e in errors]
        # of a union's branches, the one that got furthest
        deepest = max(range(len(errors)), key=lambda i: len(fields[i]))
        # the request's own field, as OpenAI names it
        first, param = errors[deepest], ".".join(fields[deepest])
        message = str(first.get("msg", "")).removeprefix("Value error, ")
        return _error(ApiError(400, f"{param}: {message}", param, "invalid_value"))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # FastAPI's, for JSON its parser cannot take
            return _error(
                ApiError(
                    400,
                    "malformed JSON body: it could not be parsed (nested too deeply?)",
                    code="invalid_json",
                )
            )
        return _error(ApiError(exc.status_code, str(exc.detail), kind=kind))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error in %s", request.url.path)
        return _error(_api_error(exc))
