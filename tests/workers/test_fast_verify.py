"""``POST /v1/verify`` beside FastAPI's stack (``WorkerApp.fast_verify``) answers as FastAPI's route does: the
same statuses, bodies, headers and error counts, for good calls and for every kind of bad one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
import orjson
import pytest

from core.names import Backend
from core.protocol import (
    BINARY_CONTENT_TYPE,
    JSON_CONTENT_TYPE,
    VerifyRequest,
    VerifyResponse,
    decode,
    encode,
)
from core.runners import ModelRunner
from workers.server import WorkerApp, create_app
from workers.settings import WorkerSettings

V = 49152
PROMPT = [504, 3458, 28, 638, 359, 346, 1485, 1834, 47, 378, 253, 1097]
TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _call(
    session: str, prefix: list[int], tokens: list[int], draft: list[int], **fields: Any
) -> tuple[bytes, dict[str, str]]:
    body, content_type = encode(VerifyRequest.after(session, prefix, tokens, draft, **fields), V)
    return body, {"content-type": content_type, "accept": content_type, **AUTH}


def _json(fields: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    return orjson.dumps(fields), {"content-type": JSON_CONTENT_TYPE, **AUTH}


def _headed(call: tuple[bytes, dict[str, str]], **changes: str | None) -> tuple[bytes, dict[str, str]]:
    body, headers = call
    headers = {**headers, **{k: v for k, v in changes.items() if v is not None}}
    return body, {k: v for k, v in headers.items() if changes.get(k, "") is not None}


# name -> (session suffix -> (body, headers)); each case runs once per route, on a session of its own
CASES: dict[str, Callable[[str], tuple[bytes, dict[str, str]]]] = {
    "good chain": lambda s: _call(s, [], PROMPT, [11, 22, 33]),
    "good json": lambda s: _headed(
        _call(s, [], PROMPT, [11], mode="exact", temperature=0.0), accept=JSON_CONTENT_TYPE
    ),
    "good seeded": lambda s: _call(
        s, [], PROMPT, [], mode="autoregressive", temperature=0.8, seed=7, return_probs=False
    ),
    "empty body": lambda s: (b"", {"content-type": BINARY_CONTENT_TYPE, **AUTH}),
    "garbage frame": lambda s: (b"\x00garbage", {"content-type": BINARY_CONTENT_TYPE, **AUTH}),
    "broken json": lambda s: (b"{not json", {"content-type": JSON_CONTENT_TYPE, **AUTH}),
    "no content type": lambda s: (b"{}", {**AUTH}),
    "json missing fields": lambda s: _json({"session_id": s}),
    "token out of range": lambda s: _call(s, [], [*PROMPT, V + 5], []),
    "unknown mode": lambda s: _call(s, [], PROMPT, [1], mode="nonsense"),
    "autoregressive with a draft": lambda s: _call(s, [], PROMPT, [1], mode="autoregressive"),
    "prefix the session lacks": lambda s: _call(s, PROMPT, [5], []),
    "context overflow": lambda s: _call(s, [], PROMPT * 200, []),
    "no key": lambda s: _headed(_call(s, [], PROMPT, []), authorization=None),
    "wrong key": lambda s: _headed(_call(s, [], PROMPT, []), authorization="Bearer nope"),
    "body over the cap": lambda s: (b"x" * 5000, {"content-type": BINARY_CONTENT_TYPE, **AUTH}),
}


def _same(response: httpx.Response) -> tuple[int, dict[str, str], Any]:
    """What must match between the routes: the status, the headers but their timing figures, the body (a good
    answer decoded, less its model time)."""
    # an answer's header carries its model ms
    skip = ("server-timing", "content-length") if response.status_code == 200 else ("server-timing",)
    headers = {k: v for k, v in response.headers.items() if k not in skip}
    timing = response.headers.get("server-timing")
    headers["server-timing parts"] = (
        ",".join(part.split(";")[0] for part in timing.split(", ")) if timing else ""
    )
    if response.status_code == 200:
        answer = decode(VerifyResponse, response.content, response.headers["content-type"])
        body: Any = replace(answer, model_ms=0.0)  # messages are equal when their fields and arrays are
    else:
        body = response.json()
    return response.status_code, headers, body


@pytest.mark.parametrize("name", list(CASES))
async def test_fast_verify_answers_as_fastapis_route(name: str, tiny_runner: ModelRunner) -> None:
    seen = []
    for fast in (True, False):
        # each route on an app of its own, the runner emptied: the same session ids, the same state
        tiny_runner.free_all()
        app = create_app(
            WorkerSettings(
                model="tiny-random", backend=Backend.TRANSFORMERS, token=TOKEN, max_body_bytes=4096
            ),
            runner=tiny_runner,
        )
        assert isinstance(app, WorkerApp) and app.fast_verify
        app.fast_verify = fast
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://worker"
        ) as client:
            body, headers = CASES[name](name)
            response = await client.post("/v1/verify", content=body, headers=headers)
        seen.append((_same(response), dict(app.state.worker.errors), app.state.worker.in_flight))
    assert seen[0] == seen[1], name
    (status, _, body), errors, in_flight = seen[0]
    assert in_flight == 0
    if name.startswith("good"):
        assert status == 200 and not errors
    else:
        assert status >= 400 and body["error"]["message"], name
        # the Guard's refusals are not the routes' errors
        assert body["error"]["code"] in errors or status in (401, 413), (name, errors)


async def test_a_draining_worker_refuses_a_new_session_on_both_routes(tiny_runner: ModelRunner) -> None:
    app = create_app(WorkerSettings(model="tiny-random", backend=Backend.TRANSFORMERS), runner=tiny_runner)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        body, headers = _call("held", [], PROMPT, [])
        assert (await client.post("/v1/verify", content=body, headers=headers)).status_code == 200
        app.state.start_drain()
        answers = []
        for fast in (True, False):
            app.fast_verify = fast
            refused = await client.post(
                "/v1/verify", content=_call(f"new-{fast}", [], PROMPT, [])[0], headers=headers
            )
            kept = await client.post("/v1/verify", content=_call("held", PROMPT, [7], [])[0], headers=headers)
            answers.append(
                (
                    refused.status_code,
                    refused.headers.get("retry-after"),
                    refused.json()["error"]["code"],
                    kept.status_code,
                )
            )
            app.state.worker.runner.crop("held", len(PROMPT))
    assert (
        answers[0] == answers[1]
        and answers[0][0] == 503
        and answers[0][1]
        and answers[0][2] == "worker_draining"
        and answers[0][3] == 200
    )


async def test_other_methods_and_routes_still_take_fastapis_stack(tiny_runner: ModelRunner) -> None:
    app = create_app(WorkerSettings(model="tiny-random", backend=Backend.TRANSFORMERS), runner=tiny_runner)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        assert (await client.get("/v1/verify")).status_code == 405
        assert (await client.post("/v1/verify/")).status_code in (307, 404)
        assert (await client.get("/health")).json()["status"] == "ok"
