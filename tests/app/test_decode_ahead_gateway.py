"""The gateway's side of decoding ahead: ``ahead`` goes to a worker whose ``/v1/info`` says it decodes ahead,
and the worker then answers the next call from its head start; a worker that refuses the field (an older one
that came back at the address) gets the call again without it, and the request answers as before."""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from app.server import create_app
from core.protocol import VerifyRequest, decode
from core.runners import ModelRunner, load_runner
from core.serving import _read_body, _replay
from tests.app.fake_engine import Router
from tests.app.helpers import gateway_config
from workers.server import create_app as create_worker
from workers.settings import WorkerSettings

BODY = {
    "model": "test-model",
    "prompt": "Once upon a time",
    "max_tokens": 8,
    "temperature": 0.0,
    "speculative": {"mode": "autoregressive"},
}


class _Older:
    """The worker's app as a worker from before ``ahead`` answers a frame that carries it: 400, the field
    named."""

    def __init__(self, app: Any) -> None:
        self.app, self.refused = app, 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/verify":
            await self.app(scope, receive, send)
            return
        body = await _read_body(scope, receive, 2**24) or b""
        headers = dict(scope["headers"])
        if decode(VerifyRequest, body, headers.get(b"content-type", b"").decode()).ahead:
            self.refused += 1
            error = orjson.dumps(
                {
                    "error": {
                        "message": "unknown fields ['ahead']",
                        "type": "invalid_request_error",
                        "param": "ahead",
                        "code": "invalid_request",
                    }
                }
            )
            await send(
                {
                    "type": "http.response.start",
                    "status": 400,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": error})
            return
        await self.app(scope, _replay(body, receive), send)


async def _complete(
    draft: ModelRunner, target: ModelRunner, older: bool
) -> tuple[str, dict[str, float], int]:
    draft.free_all()
    target.free_all()
    worker = create_worker(
        WorkerSettings(model="tiny-random", backend="transformers", decode_ahead=True), runner=target
    )
    front = _Older(worker) if older else worker
    config = gateway_config(workers=[{"url": "http://w0:1", "weight": 1.0}])
    app = create_app(config, draft_runner=draft, transport=Router({"w0": httpx.ASGITransport(app=front)}))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=60
        ) as client:
            resp = await client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200, resp.text
    return (
        resp.json()["choices"][0]["text"],
        dict(worker.state.worker.counters),
        front.refused if isinstance(front, _Older) else 0,
    )


async def test_ahead_reaches_a_worker_that_decodes_ahead_and_an_older_one_is_sent_the_call_again() -> None:
    draft, target = load_runner("tiny-random", "transformers"), load_runner("tiny-random", "transformers")
    text, counters, _ = await _complete(draft, target, older=False)
    assert counters["taken_ahead"] >= 1 and counters["decoded_ahead"] >= counters["taken_ahead"]
    again, counters, refused = await _complete(draft, target, older=True)
    assert again == text and refused >= 1  # refused once, then sent without the field: the same text
    assert counters.get("taken_ahead", 0) == 0
