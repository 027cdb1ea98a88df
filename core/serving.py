"""What the gateway and workers share as servers: a guard (drain, bearer token, body cap) and uvicorn with a
graceful SIGTERM."""

from __future__ import annotations

import hmac
import logging
import math
import signal
import time
from collections.abc import Callable
from types import FrameType

import orjson
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)


API_PREFIX = "/v1/"  # what the token guards and a drain refuses; /health, /metrics, the chat page stay open
GUARDED = (API_PREFIX, "/tokenize", "/detokenize")  # the API: /v1/…, and vLLM's tokenizer routes at the root


class Guard:
    """ASGI middleware, each refusal in the OpenAI envelope: 503 while ``is_draining()`` (the gateway's drain:
    every /v1 call; a worker drains by session, in its routes), 401 without the bearer token (when one is
    set), 413 for a body over ``max_body_bytes``. Usage: ``app.add_middleware(Guard, token=key,
    max_body_bytes=2**20)``"""

    def __init__(
        self,
        app: ASGIApp,
        token: str | None,
        max_body_bytes: int,
        is_draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self.app, self.token, self.max_body_bytes, self.is_draining = app, token, max_body_bytes, is_draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_api = scope["path"].startswith(GUARDED)
        if self.is_draining() and is_api:
            await _refuse(
                send,
                503,
                "the server is shutting down; retry on another instance",
                "server_error",
                "shutting_down",
                {"retry-after": "5"},
            )
        elif self.token and is_api and not _has_token(scope, self.token):
            await _refuse(
                send,
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                "authentication_error",
                "invalid_api_key",
            )
        else:
            body = await _read_body(scope, receive, self.max_body_bytes)
            if body is None:
                await _refuse(
                    send,
                    413,
                    f"request body over {self.max_body_bytes} bytes",
                    "invalid_request_error",
                    "payload_too_large",
                )
                return
            await self.app(scope, _replay(body, receive), send)


def _has_token(scope: Scope, token: str) -> bool:
    headers = dict(scope["headers"])
    given = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, value = given.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None once it passes ``limit`` (declared or received)."""
    declared = dict(scope["headers"]).get(b"content-length", b"")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break  # the client left: the app sees an empty body and then the disconnect
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return None
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later: the disconnect, for streams that watch for it

    return replayed


async def _refuse(
    send: Send, status: int, message: str, kind: str, code: str, headers: dict[str, str] | None = None
) -> None:
    body = orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


PROBES = ("/health", "/health/live", "/health/serving")  # what a kubelet asks: on every port
# what Prometheus and people ask: on the metrics port alone, where there is one
OPERATIONS = ("/metrics", "/health/ready")


class PortSplit:
    """ASGI middleware for a server with a metrics port: ``/metrics`` and ``/health/ready`` (which lists the
    replicas' addresses) answer there alone, the API on its own port alone, the probes on both; anything else
    is a 404 in the OpenAI envelope. A cluster then exposes the API port and lets only Prometheus reach the
    other."""

    def __init__(self, app: ASGIApp, metrics_port: int) -> None:
        self.app, self.metrics_port = app, metrics_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PROBES:
            server = scope.get("server") or (None, None)
            if (scope["path"] in OPERATIONS) != (server[1] == self.metrics_port):
                where = (
                    f"the metrics port ({self.metrics_port})"
                    if scope["path"] in OPERATIONS
                    else "the API port"
                )
                await _refuse(
                    send, 404, f"{scope['path']} is served on {where}", "invalid_request_error", "not_found"
                )
                return
        await self.app(scope, receive, send)


def run_server(
    app: ASGIApp,
    host: str,
    port: int,
    log_level: str,
    drain_timeout_s: float,
    on_drain: Callable[[], None],
    is_idle: Callable[[], bool],
    metrics_port: int | None = None,
) -> None:
    """uvicorn until SIGTERM (a drain, then exit 0: ``DrainingServer``) or SIGINT (it stops after the open
    requests); with ``metrics_port``, on that port too (``PortSplit`` says what each answers)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=math.ceil(drain_timeout_s) + 5,
    )
    server = DrainingServer(config, on_drain, is_idle, drain_timeout_s)
    if metrics_port is None:
        server.run()
        return
    server.run(
        sockets=[config.bind_socket(), uvicorn.Config(app, host=host, port=metrics_port).bind_socket()]
    )


LAST_WRITES_S = 5  # after a drain: the answers still being written get this long


class DrainingServer(uvicorn.Server):
    """A rollout's SIGTERM: ``on_drain()`` at once (readiness fails, new work is refused), and the listener
    stays open (its health answers, the work it holds goes on) until ``is_idle()`` or ``drain_timeout_s``;
    then uvicorn's shutdown. A second SIGTERM, or a SIGINT, during a drain stops it: the requests in flight
    get ``LAST_WRITES_S``."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_drain: Callable[[], None],
        is_idle: Callable[[], bool],
        drain_timeout_s: float,
    ) -> None:
        super().__init__(config)
        self.on_drain, self.is_idle, self.drain_timeout_s = on_drain, is_idle, drain_timeout_s
        self.drain_deadline: float | None = None  # time.monotonic() at which a drain gives up waiting

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.drain_deadline is None and not self.should_exit:
            log.info("SIGTERM: draining (at most %g s)", self.drain_timeout_s)
            self.drain_deadline = time.monotonic() + self.drain_timeout_s
            self.on_drain()
            return
        if self.drain_deadline is None and not self.should_exit:
            self.on_drain()
        elif self.drain_deadline is not None:
            # a second signal during a drain: only the answers being written
            self.config.timeout_graceful_shutdown = LAST_WRITES_S
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM and sig in self._captured_signals:
            self._captured_signals.remove(sig)  # stopped on request: exit 0, not re-raise SIGTERM

    async def on_tick(self, counter: int) -> bool:
        if (
            self.drain_deadline is not None
            and not self.should_exit
            and (self.is_idle() or time.monotonic() >= self.drain_deadline)
        ):
            log.info("drained: %s", "idle" if self.is_idle() else "deadline")
            self.config.timeout_graceful_shutdown = LAST_WRITES_S
            self.should_exit = True
        return await super().on_tick(counter)
