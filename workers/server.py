"""The worker's FastAPI app (protocol v1, docs/design.md §4): routes, errors in the OpenAI envelope,
``/metrics``; its state is ``workers.state``."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson
import torch
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Receive, Scope, Send

from core.errors import (
    ContextOverflow,
    InvalidRequest,
    ProtocolError,
    SessionShort,
    SpecgateError,
    WorkerDraining,
    WorkerFull,
)
from core.protocol import (
    JSON_CONTENT_TYPE,
    ErrorBody,
    StageRequest,
    StageResponse,
    VerifyRequest,
    decode,
    encode,
    encode_json,
)
from core.runners import ModelRunner
from core.runners.model_thread import ModelThread
from core.serving import Guard
from workers.link import StageFailed
from workers.scheduler import Timing
from workers.sessions import RETRY_AFTER_S
from workers.settings import WorkerSettings, ready_target
from workers.stage import StageStates
from workers.state import WorkerState

log = logging.getLogger(__name__)

VERIFY_PATH = "/v1/verify"


class WorkerApp(FastAPI):
    """The worker's app. ``POST /v1/verify``, every round's call, is answered beside FastAPI's stack (its
    middleware, routing and request objects cost a few tenths of a millisecond a call): the same Guard in
    front, the same handler (``_verified``), the same error envelope (``_refused``). With ``fast_verify``
    False it takes FastAPI's route instead, which answers the same (tests/workers/test_fast_verify.py holds
    the two equal). Middleware or exception handlers added to the app after ``create_app`` do not see this
    route: add them to ``verify_front`` too."""

    fast_verify = True
    verify_front: ASGIApp | None = None  # Guard(_fast_verify), set by create_app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.fast_verify
            and self.verify_front is not None
            and scope["type"] == "http"
            and scope["path"] == VERIFY_PATH
            and scope["method"] == "POST"
        ):
            await self.verify_front(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def create_app(
    settings: WorkerSettings, runner: ModelRunner | None = None, thread: ModelThread | None = None
) -> WorkerApp:
    """A worker app for ``settings``; loads the model at start-up unless ``runner`` is given (with its
    ``thread``: every runner call runs there)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if runner is None:
            own = ModelThread()
            app.state.worker = WorkerState.build(settings, await own.run(ready_target, settings), own)
        kind = getattr(app.state.worker.runner, "forward_kind", None)
        log.info(
            "worker ready: %s on %s%s",
            settings.model,
            settings.backend.value,
            f" ({kind} forward)" if kind else "",
        )
        yield
        state: WorkerState | None = getattr(app.state, "worker", None)
        if state is not None:
            if runner is None:
                await state.scheduler.exclusive(state.runner.close)
            await state.scheduler.close()
            await state.link.close()
            if runner is None:
                state.thread.close()

    app = WorkerApp(title="specgate worker", lifespan=lifespan)
    if runner is not None:
        app.state.worker = WorkerState.build(settings, runner, thread)
    app.state.draining = False

    def start_drain() -> None:  # SIGTERM: its sessions go on, a new one gets 503 worker_draining, /health 503
        app.state.draining = True

    app.state.start_drain = start_drain
    app.add_middleware(Guard, token=settings.token, max_body_bytes=settings.max_body_bytes)
    app.verify_front = Guard(
        partial(_fast_verify, app), token=settings.token, max_body_bytes=settings.max_body_bytes
    )
    _add_routes(app, settings)
    _add_error_handlers(app)
    return app


def _state(request: Request) -> WorkerState:
    return request.app.state.worker


@contextmanager
def _counted(state: WorkerState) -> Iterator[None]:
    """A model call in flight: a draining worker leaves only when none is (``WorkerState.is_idle``)."""
    state.in_flight += 1
    try:
        yield
    finally:
        state.in_flight -= 1


def _refuse_new_while_draining(request: Request, state: WorkerState, session_id: str) -> None:
    """SIGTERM: the sessions it holds go on; a new one is refused (503 worker_draining: the gateway takes
    another replica)."""
    if request.app.state.draining and session_id not in state.sessions:
        raise WorkerDraining(RETRY_AFTER_S)


def _encode(
    state: WorkerState, request: Request, resp: Any, received: int | None = None
) -> tuple[bytes, str]:
    """The answer's payload as the client accepts it; an answered call of ``received`` bytes counted."""
    return _encoded(state, resp, JSON_CONTENT_TYPE in request.headers.get("accept", ""), received)


def _encoded(state: WorkerState, resp: Any, as_json: bool, received: int | None = None) -> tuple[bytes, str]:
    payload, content_type = encode(resp, state.runner.info.vocab_size, as_json=as_json)
    if received is not None:
        state.counters["requests"] += 1
        state.counters["bytes_in"] += received
        state.counters["bytes_out"] += len(payload)
    return payload, content_type


def _stage_request(state: WorkerState, body: bytes, content_type: str | None) -> StageRequest:
    if not state.is_stage:
        raise InvalidRequest(
            "this worker serves the whole model: it answers /v1/verify (start a stage with "
            "--layers first:end)",
            param="layers",
        )
    return decode(StageRequest, body, content_type)


async def _verified(
    app: FastAPI, body: bytes, content_type: str | None, accept: str
) -> tuple[bytes, str, str]:
    """``POST /v1/verify``: a call's answer (payload, content type, Server-Timing), whichever route took it;
    an error raises. The route counts the call (``_counted``) until its answer is sent."""
    state: WorkerState = app.state.worker
    started = time.perf_counter()
    req = decode(VerifyRequest, body, content_type)
    if app.state.draining and req.session_id not in state.sessions:
        raise WorkerDraining(RETRY_AFTER_S)
    if state.is_stage:
        raise InvalidRequest(
            f"this worker is a pipeline stage (layers {state.settings.layers}): it answers "
            "/v1/stage/forward, not /v1/verify",
            param="mode",
        )
    await state.steps.transforms.precompile(req.transform, req.prefix_len == 0)
    decoded = time.perf_counter()
    timing = Timing()
    resp = await state.scheduler.verify(req, timing)
    encoding = time.perf_counter()
    payload, answer_type = _encoded(state, resp, JSON_CONTENT_TYPE in accept, len(body))
    done = time.perf_counter()
    # waiting for its step, and the batch-mates' scoring
    queue = (encoding - decoded) * 1e3 - timing.model - timing.score
    timing.codec, timing.queue = (decoded - started + done - encoding) * 1e3, max(queue, 0.0)
    timing.total = (done - started) * 1e3
    return payload, answer_type, timing.header()


async def _fast_verify(app: FastAPI, scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v1/verify`` beside FastAPI's stack (behind the Guard, which read the body): ``_verified``, or
    ``_refused``."""
    body, more = b"", True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break
        body += message.get("body", b"")
        more = message.get("more_body", False)
    content_type, accept = None, ""
    for name, value in scope["headers"]:
        if name == b"content-type" and content_type is None:
            content_type = value.decode("latin-1")
        elif name == b"accept" and not accept:
            accept = value.decode("latin-1")
    state: WorkerState | None = getattr(app.state, "worker", None)
    if state is not None:
        # the call counts until its answer is sent (a gateway asking /health meanwhile sees it)
        state.in_flight += 1
    try:
        try:
            payload, answer_type, timing = await _verified(app, body, content_type, accept)
            status, headers = 200, [(b"server-timing", timing.encode("latin-1"))]
        except Exception as exc:  # noqa: BLE001 - the error handlers' answer, as FastAPI's route would give it
            status, payload, extra = _refused(app, VERIFY_PATH, exc)
            answer_type, headers = (
                JSON_CONTENT_TYPE,
                [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()],
            )
        start = [
            (b"content-length", str(len(payload)).encode()),
            (b"content-type", answer_type.encode("latin-1")),
            *headers,
        ]
        await send({"type": "http.response.start", "status": status, "headers": start})
        await send({"type": "http.response.body", "body": payload})
    finally:
        if state is not None:
            state.in_flight -= 1


def _add_routes(app: FastAPI, settings: WorkerSettings) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        threads = {"model": _state(request).runner.threads, "torch": torch.get_num_threads()}
        draining = request.app.state.draining  # a rollout's SIGTERM: readiness fails, the DNS name drops it
        # calls: verify and stage calls being answered; stalled_s: how long its model has finished no step (or
        # decode) while work waits, 0 idle. A gateway waits on a slow call while both say busy and progressing
        # (app.targets.channel)
        state = _state(request)
        body = {
            "status": "draining" if draining else "ok",
            "instance_id": settings.instance_id,
            "threads": threads,
            "calls": state.in_flight,
            "stalled_s": round(state.scheduler.stalled_s, 3),
        }
        return Response(
            orjson.dumps(body), status_code=503 if draining else 200, media_type="application/json"
        )

    @app.get("/health/live")
    async def live(request: Request) -> Response:
        """Liveness: the process and its event loop answer, draining or not (a drain must not end in a
        restart)."""
        body = {
            "status": "draining" if request.app.state.draining else "ok",
            "instance_id": settings.instance_id,
        }
        return Response(orjson.dumps(body), media_type="application/json")

    @app.get("/v1/info")
    async def info(request: Request) -> Response:
        return Response(encode_json(_state(request).info()), media_type=JSON_CONTENT_TYPE)

    @app.post(VERIFY_PATH)
    async def verify(request: Request) -> Response:
        headers = request.headers
        with _counted(_state(request)):
            payload, content_type, timing = await _verified(
                request.app, await request.body(), headers.get("content-type"), headers.get("accept", "")
            )
        return Response(payload, media_type=content_type, headers={"server-timing": timing})

    @app.post("/v1/stage/forward")
    async def stage_forward(request: Request) -> Response:
        with _counted(_state(request)):
            return await _stage_forward(request)

    async def _stage_forward(request: Request) -> Response:
        state = _state(request)
        body = await request.body()
        req = _stage_request(state, body, request.headers.get("content-type"))
        if state.runner.layer_range is not None and state.runner.layer_range[0] == 0:
            # the first stage: where a session starts
            _refuse_new_while_draining(request, state, req.session_id)
        await state.steps.transforms.precompile(
            req.transform, req.prefix_len == 0 and state.runner.is_last_stage
        )
        async with state.order.turn(req.session_id, req.seq, state.settings.stage_wait_s):
            out = await state.scheduler.verify(req, Timing())
        resp = await state.link.send_on(req, out) if isinstance(out, StageStates) else out
        payload, content_type = _encode(state, request, resp, len(body))
        return Response(payload, media_type=content_type)

    @app.post("/v1/stage/keep")
    async def stage_keep(request: Request) -> Response:
        state = _state(request)
        req = _stage_request(state, await request.body(), request.headers.get("content-type"))
        if len(req.tokens):
            raise InvalidRequest("/v1/stage/keep takes keep alone: no tokens", param="tokens")
        async with state.order.turn(req.session_id, req.seq, state.settings.stage_wait_s):
            held = await state.scheduler.exclusive(state.steps.stage.keep, req)
        payload, content_type = _encode(state, request, StageResponse(held=held))
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


@dataclass(eq=False)  # hashable: the registry keys on it
class _WorkerCollector(Collector):
    """The worker's ``/metrics``, read from its state at scrape time."""

    state: WorkerState

    _COUNTERS = {
        "requests": "Verify calls answered.",
        "positions_scored": "Positions scored (γ+1 per call).",
        "positions_scored_on_device": (
            "Of those, positions scored together where the logits are, one copy back per step "
            "(--scoring device)."
        ),
        "model_seconds": "Seconds spent in the model.",
        "bytes_in": "Bytes of verify requests received.",
        "bytes_out": "Bytes of verify answers sent.",
        "decoded_ahead": (
            "Autoregressive answers' tokens decoded while idle, before the next call carries them "
            "(decode_ahead)."
        ),
        "taken_ahead": "Calls that found their decode done ahead.",
    }

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        state = self.state
        for name, doc in self._COUNTERS.items():
            yield CounterMetricFamily(f"specgate:verify_{name}", doc, value=state.counters[name])
        errors = CounterMetricFamily(
            "specgate:verify_errors", "Refused verify calls, by error code.", labels=["code"]
        )
        for code, count in sorted(state.errors.items()):
            errors.add_metric([code], count)
        yield errors
        step = state.runner.step_info()
        if "forwards" in step:  # the static forward (core/runners/static_forward.py)
            yield CounterMetricFamily(
                "specgate:step_forwards",
                "Forwards of the static forward (a step runs one, and one per seeded call in it).",
                value=step["forwards"],
            )
            yield CounterMetricFamily(
                "specgate:step_forwards_eager",
                "Of those, forwards outside every captured bucket: on a GPU no graph to replay "
                "(a prefill past the largest).",
                value=step["eager_forwards"],
            )
        yield CounterMetricFamily(
            "specgate:worker_restarts",
            "Times `specgate serve` restarted this worker after it died.",
            value=state.settings.restarts,
        )
        yield GaugeMetricFamily("specgate:sessions", "Sessions held.", value=len(state.sessions))
        chains, trees = state.sessions.live()
        yield GaugeMetricFamily(
            "specgate:sessions_live",
            "Sessions used in the last session_live_s (they keep their KV places).",
            value=len(chains) + len(trees),
        )
        yield GaugeMetricFamily(
            "specgate:session_slots",
            "Sessions served at once: --max-sessions, or the KV places where fewer (a new "
            "session past them: 503 worker_full).",
            value=state.sessions.slots,
        )
        yield GaugeMetricFamily(
            "specgate:sessions_ratio",
            "How full: 1 where a new session gets worker_full or --max-sessions are held (what "
            "an autoscaler reads).",
            value=state.sessions.fill(),
        )
        yield GaugeMetricFamily(
            "specgate:queue_length",
            "Calls waiting for the model's next step.",
            value=state.scheduler.queue_length,
        )
        yield CounterMetricFamily(
            "specgate:sessions_evicted",
            "Sessions evicted (LRU, TTL, memory).",
            value=state.sessions.num_evicted,
        )
        yield GaugeMetricFamily(
            "specgate:session_memory_bytes",
            "Memory the sessions' caches take.",
            value=state.runner.memory_bytes(),
        )


def _error(status: int, body: ErrorBody) -> Response:
    return Response(body.to_json(), status_code=status, media_type=JSON_CONTENT_TYPE)


def _refusal(exc: Exception) -> tuple[int, ErrorBody]:
    """The status and body of an error a route raised (its code is what ``/metrics`` counts)."""
    if isinstance(exc, SessionShort):
        return 409, ErrorBody(
            str(exc), "session_short", param="prefix_len", code="session_short", held=exc.held
        )
    if isinstance(exc, StageFailed):
        return exc.status, exc.body
    if isinstance(exc, ProtocolError):
        code = "context_length_exceeded" if isinstance(exc, ContextOverflow) else "invalid_request"
        return 400, ErrorBody(str(exc), "invalid_request_error", param=exc.param, code=code)
    if isinstance(exc, WorkerFull):
        return 503, ErrorBody(str(exc), "server_error", code="worker_full")
    if isinstance(exc, WorkerDraining):
        return 503, ErrorBody(str(exc), "server_error", code="worker_draining")
    if isinstance(exc, SpecgateError):
        return 500, ErrorBody(str(exc), "server_error", code="server_error")
    return 500, ErrorBody(f"internal error: {type(exc).__name__}", "server_error", code="server_error")


def _refused(app: FastAPI, path: str, exc: Exception) -> tuple[int, bytes, dict[str, str]]:
    """An error a route raised: its status, its body in the envelope, its headers; counted by code
    (``/metrics``)."""
    if not isinstance(exc, (SpecgateError, StageFailed)):
        log.error("unexpected error in %s", path, exc_info=exc)
    status, body = _refusal(exc)
    state = getattr(app.state, "worker", None)
    if state is not None:
        state.errors[body.code or "stage_failed"] += 1
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, (WorkerFull, WorkerDraining)) else {}
    return status, body.to_json(), headers


def _add_error_handlers(app: FastAPI) -> None:
    async def refused(request: Request, exc: Exception) -> Response:
        status, body, headers = _refused(request.app, request.url.path, exc)
        return Response(body, status_code=status, media_type=JSON_CONTENT_TYPE, headers=headers)

    for kind in (SpecgateError, StageFailed, Exception):  # subclasses by their MRO
        app.add_exception_handler(kind, refused)

    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, ErrorBody(str(exc.detail), kind, code=str(exc.status_code)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error(400, ErrorBody(str(exc.errors()), "invalid_request_error", code="invalid_request"))
