"""The gateway in-process (ASGITransport) with fake workers (httpx.MockTransport) and the
tiny-random draft: the OpenAI surface, streaming, errors in the envelope."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import orjson
import pytest
import torch

from app.engine.spec import TokenLogprob
from app.schemas import ChatCompletionRequest
from app.server import create_app
from core.config import parse_config
from core.grammar import engine_version
from core.runners import ModelRunner
from core.transform import TransformSpec
from tests.app.conftest import Gateway
from tests.app.fakes import FAVOURITE, FakeWorkerTransport, V
from tests.app.helpers import assert_error, gateway_config, sse_events

CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}
COMPLETION = {"model": "test-model", "prompt": "Once upon a time", "max_tokens": 6}
DEEP_SCHEMA: dict[str, Any] = {"type": "integer"}
for _ in range(300):  # anyOf inside anyOf: the schema rewrite used to recurse past the stack (a 500)
    DEEP_SCHEMA = {"anyOf": [DEEP_SCHEMA]}


async def test_models_health_and_ready(client: httpx.AsyncClient) -> None:
    model = (await client.get("/v1/models")).json()["data"][0]
    # the smaller of the draft runner's and the workers' contexts
    assert model["id"] == "test-model" and model["max_model_len"] == 2048
    health = (await client.get("/health")).json()
    assert health["status"] == "ok" and len(health["instance_id"]) == 32
    ready = await client.get("/health/ready")
    assert ready.status_code == 200 and [w["ready"] for w in ready.json()["workers"]] == [True, True]
    assert ready.json()["instance_id"] == health["instance_id"]


async def test_limits_are_sized_by_the_smallest_context(
    fakes: FakeWorkerTransport, tiny_runner: ModelRunner
) -> None:
    """No limits configured: the context is the smallest of the draft's and the workers' (/v1/models), an
    absent max_tokens (max_output_tokens) is the context left after the prompt, a prompt is held only to the
    context (not to a fixed 1,536), a longer one is a 400 naming the context; a configured cap still caps."""
    fakes.behaviour["w1"] = "context:1800"
    app = create_app(gateway_config(limits={}), draft_runner=tiny_runner, transport=fakes.transport())
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g") as client,
    ):
        assert (await client.get("/v1/models")).json()["data"][0]["max_model_len"] == 1800
        requests = app.state.gateway.requests
        chat = requests.chat_job(
            ChatCompletionRequest(model="test-model", messages=[{"role": "user", "content": "Hi"}])
        )
        assert len(chat.choices[0].prompt) + chat.choices[0].max_tokens == 1800
        long = {
            "model": "test-model",
            "messages": [{"role": "user", "content": "word " * 1700}],
            "max_tokens": 2,
        }
        answer = await client.post("/v1/chat/completions", json=long)
        assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] > 1536, answer.text
        longer = {"model": "test-model", "messages": [{"role": "user", "content": "word " * 1900}]}
        assert_error(
            await client.post("/v1/chat/completions", json=longer),
            400,
            "messages",
            "the context is 1800",
            "context_length_exceeded",
        )
        item = {"model": "test-model", "input": "word " * 1900}
        assert_error(
            await client.post("/v1/responses", json=item),
            400,
            "input",
            "the context is 1800",
            "context_length_exceeded",
        )
    app = create_app(
        gateway_config(limits={"max_tokens": 5}), draft_runner=tiny_runner, transport=fakes.transport()
    )
    async with app.router.lifespan_context(app):
        await app.state.gateway.check_workers()
        chat = app.state.gateway.requests.chat_job(
            ChatCompletionRequest(
                model="test-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=99
            )
        )
        assert chat.choices[0].max_tokens == 5


async def test_ready_refuses_a_worker_with_another_tokenizer(
    gateway: Gateway, fakes: FakeWorkerTransport
) -> None:
    fakes.behaviour["w1"] = "other-tokenizer"
    async with gateway() as client:
        ready = await client.get("/health/ready")
        assert ready.status_code == 503 and "another tokenizer" in ready.json()["workers"][1]["error"]
        assert_error(await client.post("/v1/chat/completions", json=CHAT), 503, contains="w1")


async def test_a_grammar_needs_the_workers_to_end_with_the_drafts_eos(
    gateway: Gateway, fakes: FakeWorkerTransport, tiny_runner: Any
) -> None:
    """A worker whose grammar may end with an EOS id the gateway does not know (the gateway
    would take it for text its own grammar does not allow): a grammar gets a 400 naming the
    worker; the rest is served."""
    assert 7 not in tiny_runner.info.eos_ids
    fakes.behaviour["w1"] = "other-eos"
    async with gateway() as client:
        assert (await client.get("/health/ready")).status_code == 200
        body = {**CHAT, "response_format": {"type": "json_object"}}
        assert_error(
            await client.post("/v1/chat/completions", json=body), 400, "response_format", contains="w1"
        )
        assert (
            await client.post("/v1/chat/completions", json={**CHAT, "logit_bias": {"5": 1}})
        ).status_code == 200


@pytest.mark.parametrize(
    "behaviour, body, code",
    [
        (
            "grammar:llguidance 0.0.1:65536",
            {"response_format": {"type": "json_object"}},
            "grammar_engine_mismatch",
        ),
        (
            "grammar:SAME:40",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "n",
                        "schema": {"type": "object", "properties": {"answer": {"type": "string"}}},
                    },
                }
            },
            "grammar_too_large",
        ),
    ],
)
async def test_a_grammar_needs_the_workers_engine_and_limit(
    gateway: Gateway, fakes: FakeWorkerTransport, behaviour: str, body: dict[str, Any], code: str
) -> None:
    """Issue 46: a worker with another grammar engine, or a smaller max_grammar_bytes, as its
    /v1/info reports them: a grammar gets a 400 naming the worker and the reason (not a 502
    from the worker's refusal); the rest is served."""
    fakes.behaviour["w1"] = behaviour.replace("SAME", engine_version())
    async with gateway() as client:
        assert (await client.get("/health/ready")).status_code == 200
        assert_error(
            await client.post("/v1/chat/completions", json={**CHAT, **body}), 400, code=code, contains="w1"
        )
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    # the same engine, a limit that holds it: served
    fakes.behaviour["w1"] = f"grammar:{engine_version()}:65536"
    async with gateway() as client:
        assert (await client.post("/v1/chat/completions", json={**CHAT, **body})).status_code == 200


async def test_completion_with_usage(client: httpx.AsyncClient, fakes: FakeWorkerTransport) -> None:
    body = (await client.post("/v1/completions", json={**COMPLETION, "temperature": 0})).json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 6 and usage["total_tokens"] == usage["prompt_tokens"] + 6
    spec = usage["speculative"]
    assert spec["mode"] == "aggregate" and spec["k"] == "full" and spec["lossless"] is True
    assert spec["rounds"] >= 2 and spec["draft_tokens"] >= spec["accepted_tokens"] >= 0
    assert spec["bytes_to_workers"] > 0 and spec["bytes_from_workers"] > 6 * V * 4
    assert choice["text"].startswith(" " * 0)  # text, whatever the tiny draft proposed, is the target's
    tokens = {r.draft.tolist()[0] if len(r.draft) else None for _, r in fakes.requests}
    assert tokens  # the draft went to the workers


async def test_greedy_output_is_the_targets_choice(
    client: httpx.AsyncClient, tiny_runner: ModelRunner
) -> None:
    body = (
        await client.post("/v1/completions", json={**COMPLETION, "temperature": 0, "max_tokens": 4})
    ).json()
    assert body["choices"][0]["text"] == tiny_runner.tokenizer.decode([FAVOURITE] * 4)


async def test_chat_stream_shape(client: httpx.AsyncClient) -> None:
    req = {
        **CHAT,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.8,
        "seed": 3,
    }
    resp = await client.post("/v1/chat/completions", json=req)
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        finishes = [c for c in mine if c["finish_reason"]]
        assert len(finishes) == 1 and finishes[0] is mine[-1] and finishes[0]["finish_reason"] == "length"
        assert "".join(c["delta"].get("content", "") for c in mine)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_completion_stream_without_usage_has_no_usage_key(client: httpx.AsyncClient) -> None:
    events = sse_events((await client.post("/v1/completions", json={**COMPLETION, "stream": True})).text)
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_seed_reproduces(client: httpx.AsyncClient) -> None:
    req = {**CHAT, "temperature": 1.0, "seed": 11, "max_tokens": 8}
    first = (await client.post("/v1/chat/completions", json=req)).json()["choices"][0]["message"]["content"]
    second = (await client.post("/v1/chat/completions", json=req)).json()["choices"][0]["message"]["content"]
    assert first == second


async def test_stop_strings_and_echo(client: httpx.AsyncClient, tiny_runner: ModelRunner) -> None:
    piece = tiny_runner.tokenizer.decode([FAVOURITE])
    assert len(piece) >= 2
    stop = piece[1:] + piece  # begins inside the first token, ends in the second
    body = (
        await client.post("/v1/completions", json={**COMPLETION, "temperature": 0, "stop": ["never", stop]})
    ).json()
    assert body["choices"][0] == {"index": 0, "text": piece[:1], "logprobs": None, "finish_reason": "stop"}
    body = (
        await client.post(
            "/v1/completions", json={**COMPLETION, "temperature": 0, "echo": True, "max_tokens": 1}
        )
    ).json()
    assert body["choices"][0]["text"] == COMPLETION["prompt"] + piece


@pytest.mark.parametrize("mode", ["aggregate", "autoregressive", "exact"])
async def test_logprobs_report_the_target(client: httpx.AsyncClient, mode: str) -> None:
    spec = {"mode": mode}
    body = (
        await client.post(
            "/v1/completions", json={**COMPLETION, "temperature": 0, "logprobs": 2, "speculative": spec}
        )
    ).json()
    lp = body["choices"][0]["logprobs"]
    expected = float(torch.log_softmax(torch.tensor([3.0, 2.0] + [-10.0] * (V - 2)), 0)[0])
    assert len(lp["tokens"]) == 6 and all(
        v == pytest.approx(expected, abs=1e-4) for v in lp["token_logprobs"]
    )
    assert all(len(top) == 2 for top in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    chat = (
        await client.post(
            "/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 1, "speculative": spec}
        )
    ).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 6 and all(
        len(c["top_logprobs"]) == 1 and isinstance(c["bytes"], list) for c in content
    )


async def test_top_k_is_lossy_and_says_so(client: httpx.AsyncClient) -> None:
    body = (await client.post("/v1/completions", json={**COMPLETION, "speculative": {"k": 1}})).json()
    spec = body["usage"]["speculative"]
    assert spec["lossless"] is False and spec["logprobs_source"] == "reconstruction"
    assert (
        spec["bias_bound_mean"] > 0
        and 0 <= spec["reconstruction_error_mean"] <= spec["bias_bound_mean"] + 1e-6
    )


async def test_autoregressive_sends_four_byte_samples(
    client: httpx.AsyncClient, fakes: FakeWorkerTransport
) -> None:
    body = (
        await client.post("/v1/completions", json={**COMPLETION, "speculative": {"mode": "autoregressive"}})
    ).json()
    spec = body["usage"]["speculative"]
    assert spec["mode"] == "autoregressive" and spec["rounds"] == 6 and spec["draft_tokens"] == 0
    assert spec["bytes_from_workers"] < 6 * 2 * 200  # one int32 sample and a small header per call
    assert all(r.mode == "autoregressive" and not r.return_probs for _, r in fakes.requests)


async def test_a_worker_that_lost_its_session_gets_the_prefix_again(
    gateway: Gateway, fakes: FakeWorkerTransport
) -> None:
    fakes.behaviour["w0"] = "short-once"
    async with gateway() as client:
        resp = await client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200, resp.text
    w0 = [r for host, r in fakes.requests if host == "w0"]
    resent = [r for r in w0 if r.prefix_len == 0][1]  # the first call, then the resend from zero
    assert len(resent.tokens) > len(w0[0].tokens)


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({**CHAT, "model": "nope"}, 404, "model"),
        ({**CHAT, "max_tokens": "many"}, 400, "max_tokens"),
        ({**CHAT, "temperature": -1}, 400, "temperature"),
        ({**CHAT, "messages": []}, 400, "messages"),
        ({**CHAT, "suffix": "x"}, 400, "suffix"),
        ({**CHAT, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
        ({**CHAT, "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({**CHAT, "tool_choice": "required"}, 400, "tool_choice"),
        ({**CHAT, "logit_bias": {"twelve": 3}}, 400, "logit_bias"),
        ({**CHAT, "response_format": {"type": "yaml"}}, 400, "response_format.type"),
        ({**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        (
            {**CHAT, "speculative": {"mode": "autoregressive", "num_draft_tokens": 3}},
            400,
            "speculative.num_draft_tokens",
        ),
        ({**CHAT, "speculative": {"mode": "pipeline"}}, 400, "speculative.mode"),
        ({**CHAT, "speculative": {"mode": "tree", "tree": {"widths": [0]}}}, 400, "speculative.tree"),
        (
            {**CHAT, "speculative": {"mode": "tree", "tree": {"rule": "fixed", "widths": [2]}}},
            400,
            "speculative.tree",
        ),
        (
            {**CHAT, "speculative": {"mode": "tree", "num_draft_tokens": 3}},
            400,
            "speculative.num_draft_tokens",
        ),
        ({**CHAT, "speculative": {"mode": "split"}}, 400, "speculative.mode"),
        ({**CHAT, "speculative": {"mode": "exact", "k": 4}}, 400, "speculative.k"),
        ({**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
        ({**CHAT, "speculative": {"k": 0}}, 400, None),
        ({**CHAT, "messages": [{"role": "user", "content": "word " * 200}]}, 400, "messages"),
        # issue 46: what parsing user input used to raise on (500s), and what it used to take ambiguously
        ({**CHAT, "logit_bias": {"\u00b2": 3}}, 400, "logit_bias"),  # str.isdigit takes "²", int() does not
        ({**CHAT, "logit_bias": {"7": 3, "07": -3}}, 400, "logit_bias"),  # two spellings of one id
        ({**CHAT, "logit_bias": {"1" * 5000: 3}}, 400, "logit_bias"),  # int() refuses 5,000 digits
        (
            {
                **CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": DEEP_SCHEMA},
                },
            },
            400,
            "response_format.json_schema.schema",
        ),
        ({**CHAT, "structured_outputs": {"json": json.dumps(DEEP_SCHEMA)}}, 400, "structured_outputs.json"),
        (
            {
                **CHAT,
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": DEEP_SCHEMA}},
                        },
                    }
                ],
            },
            400,
            "tools.0.function.parameters",
        ),
        # a lone surrogate
        ({**CHAT, "messages": [{"role": "user", "content": "a \ud83d b"}]}, 400, "messages.0.content"),
        ({**CHAT, "stop": ["\udc00"]}, 400, "stop.0"),
        (
            {
                **CHAT,
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "tool", "content": "sunny", "tool_call_id": "call_x"},
                ],
            },
            400,
            "messages.1.tool_call_id",
        ),
    ],
)
async def test_bad_requests_get_the_envelope(
    client: httpx.AsyncClient, body: dict[str, Any], status: int, param: str | None
) -> None:
    content = json.dumps(body)  # ASCII JSON: a lone surrogate travels as its escape, as a client may send it
    assert_error(
        await client.post(
            "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
        ),
        status,
        param,
    )
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200  # still serving


@pytest.mark.parametrize("temperature, rule", [(1.0, "sampled_distinct"), (0.0, "fixed")])
async def test_a_tree_that_names_only_its_payload_takes_the_default_shape(
    client: httpx.AsyncClient, temperature: float, rule: str
) -> None:
    """``{"tree": {"payload": "exact"}}`` names no shape: the default by temperature (issue 32:
    it used to pick the fixed EAGLE-2 tree at T > 0 too, which the docs do not say)."""
    body = {**CHAT, "temperature": temperature, "speculative": {"mode": "tree", "tree": {"payload": "exact"}}}
    spec = (await client.post("/v1/chat/completions", json=body)).json()["usage"]["speculative"]
    assert spec["tree"]["rule"] == rule and spec["tree"]["payload"] == "exact" and spec["lossless"] is True


async def test_malformed_json_and_what_chat_uis_send(client: httpx.AsyncClient) -> None:
    resp = await client.post(
        "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert_error(resp, 400, contains="malformed JSON")
    deep = b'{"model": ' + b"[" * 5000 + b"]" * 5000 + b"}"  # past the parser's stack
    assert_error(
        await client.post("/v1/chat/completions", content=deep, headers={"content-type": "application/json"}),
        400,
        code="invalid_json",
    )
    for body, headers in ((b"[1, 2]", {"content-type": "application/json"}), (orjson.dumps(CHAT), {})):
        # not an object; no content type
        assert_error(
            await client.post("/v1/chat/completions", content=body, headers=headers),
            400,
            code="invalid_json",
            contains="JSON object",
        )
    accepted = {
        **CHAT,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "logit_bias": {},
        "user": "u1",
        "response_format": {"type": "text"},
    }
    assert (await client.post("/v1/chat/completions", json=accepted)).status_code == 200


@pytest.mark.parametrize("behaviour, status", [("down", 503), ("500", 502), ("garbage", 502)])
async def test_a_failing_worker_is_named(
    gateway: Gateway, fakes: FakeWorkerTransport, behaviour: str, status: int
) -> None:
    async with gateway() as client:
        assert (await client.get("/health/ready")).status_code == 200
        fakes.behaviour["w1"] = behaviour
        error = assert_error(await client.post("/v1/completions", json=COMPLETION), status, contains="w1")
        assert error["type"] == "server_error"
        events = sse_events((await client.post("/v1/completions", json={**COMPLETION, "stream": True})).text)
        assert events[-1] == "[DONE]" and "w1" in events[-2]["error"]["message"]
        fakes.behaviour["w1"] = ""
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200


async def test_a_down_worker_at_first_use_gets_503_with_retry_after(
    gateway: Gateway, fakes: FakeWorkerTransport
) -> None:
    fakes.behaviour["w0"] = "down"
    async with gateway() as client:
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert_error(resp, 503, contains="w0")
        assert resp.headers["retry-after"]


async def test_sessions_are_freed_after_each_request(
    client: httpx.AsyncClient, fakes: FakeWorkerTransport
) -> None:
    await client.post("/v1/completions", json={**COMPLETION, "n": 2})
    assert len(fakes.deleted) == 4  # two choices × two workers


def _linked(rtt_ms: float) -> list[dict[str, Any]]:
    return [
        {"url": "http://w0:1", "weight": 0.6, "link": {"rtt_ms": rtt_ms}},
        {"url": "http://w1:1", "weight": 0.4, "link": {"rtt_ms": rtt_ms}},
    ]


def test_link_delay_is_half_the_rtt_plus_serialisation() -> None:
    link = (
        parse_config(
            {"workers": [{"url": "http://w:1", "link": {"rtt_ms": 20, "up_mbps": 100, "down_mbps": 10}}]}
        )
        .workers[0]
        .link
    )
    assert link is not None
    assert link.delay_s(1_000_000, upstream=True) == pytest.approx(0.01 + 0.08)
    assert link.delay_s(1_000_000, upstream=False) == pytest.approx(0.01 + 0.8)
    assert link.delay_s(0, upstream=True) == pytest.approx(0.01)


async def test_a_100_ms_link_makes_a_round_take_at_least_100_ms(gateway: Gateway) -> None:
    async with gateway(workers=_linked(100)) as client:
        started = time.monotonic()
        body = (
            await client.post(
                "/v1/completions",
                json={**COMPLETION, "max_tokens": 1, "speculative": {"mode": "autoregressive"}},
            )
        ).json()
        assert time.monotonic() - started >= 0.1  # a lower bound: safe on a noisy machine
        assert body["usage"]["speculative"]["rounds"] == 1


async def test_a_slow_link_does_not_hold_up_other_requests(gateway: Gateway) -> None:
    finished: list[str] = []
    async with gateway(workers=_linked(300)) as slow, gateway() as fast:

        async def run(name: str, client: httpx.AsyncClient) -> None:
            await client.post("/v1/completions", json={**COMPLETION, "max_tokens": 2})
            finished.append(name)

        first = asyncio.create_task(run("slow", slow))
        await asyncio.sleep(0.05)
        await run("fast", fast)
        await first
    assert finished == ["fast", "slow"]


@pytest.mark.parametrize(
    "spec", [{"mode": "aggregate", "k": 8}, {"mode": "autoregressive"}, {"mode": "aggregate", "k": "full"}]
)
async def test_usage_bytes_are_the_bodies_on_the_wire(
    client: httpx.AsyncClient, fakes: FakeWorkerTransport, spec: dict[str, Any]
) -> None:
    body = (await client.post("/v1/completions", json={**COMPLETION, "speculative": spec})).json()
    usage = body["usage"]["speculative"]
    assert (usage["bytes_to_workers"], usage["bytes_from_workers"]) == (fakes.bytes_in, fakes.bytes_out)


async def test_stream_chunks_say_where_their_text_came_from(client: httpx.AsyncClient) -> None:
    req = {**CHAT, "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}, "seed": 5}
    events = sse_events((await client.post("/v1/chat/completions", json=req)).text)
    rounds = [e for e in events[:-1] if e.get("speculative")]
    assert rounds and all(
        set(e["speculative"]) == {"accepted", "drafted", "draft_chars", "bytes"} for e in rounds
    )
    for e in rounds:
        spec, content = e["speculative"], e["choices"][0]["delta"]["content"]
        assert (
            0 <= spec["accepted"] <= spec["drafted"]
            and 0 <= spec["draft_chars"] <= len(content)
            and spec["bytes"] > 0
        )
    usage = events[-2]["usage"]["speculative"]
    assert sum(e["speculative"]["accepted"] for e in rounds) == usage["accepted_tokens"]
    assert (
        sum(e["speculative"]["bytes"] for e in rounds)
        == usage["bytes_to_workers"] + usage["bytes_from_workers"]
    )


async def test_the_chat_page_is_served_open_and_self_contained(gateway: Gateway) -> None:
    async with gateway(api_key="sk-page") as client:
        page = await client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'data-model="test-model"' in page.text
        for asset in ("/static/chat.js", "/static/chat.css"):
            assert (await client.get(asset)).status_code == 200
        assert "http" not in page.text.replace('content="width', "")  # nothing loaded from outside
        assert (await client.get("/v1/models")).status_code == 401  # the key still guards the API


async def test_relaxed_verification_is_asked_for_and_reported(gateway: Gateway) -> None:
    """DSD's relaxation: off unless a request asks; the response then says lossy, with its τ
    settings and the mean distance τ (1 − β) of its positions."""
    async with gateway() as client:
        body = {"model": "test-model", "prompt": "hi", "max_tokens": 10, "seed": 1}
        plain = (await client.post("/v1/completions", json=body)).json()["usage"]["speculative"]
        assert "relaxation" not in plain and plain["lossless"] is True
        relaxed = {"mode": "aggregate", "relaxation": {"tau_max": 0.6, "kl_scale": 0.5}}
        spec = (await client.post("/v1/completions", json={**body, "speculative": relaxed})).json()["usage"][
            "speculative"
        ]
        assert spec["lossless"] is False and spec["relaxation"] == {"tau_max": 0.6, "kl_scale": 0.5}
        assert 0 <= spec["relaxed_tv_mean"] <= 0.6 and 0 <= spec["tau_mean"] < 0.6
        for bad, param in (
            ({"mode": "split", "relaxation": {}}, "speculative.relaxation"),
            ({"relaxation": {"tau_max": 1.0}}, None),
        ):
            resp = await client.post("/v1/completions", json={**body, "speculative": bad})
            assert_error(resp, 400, param, "relaxation")


@pytest.mark.parametrize("stream", [False, True])
async def test_vllm_per_request_speculative_metrics(client: httpx.AsyncClient, stream: bool) -> None:
    """vLLM's ``metrics.speculative_decoding`` beside ``usage``: the same numbers as our block."""
    req = {**CHAT, "max_tokens": 12, "seed": 2}
    if stream:
        events = sse_events(
            (
                await client.post(
                    "/v1/chat/completions",
                    json={**req, "stream": True, "stream_options": {"include_usage": True}},
                )
            ).text
        )
        body = events[-2]
        assert all("metrics" not in e for e in events[:-2])
    else:
        body = (await client.post("/v1/chat/completions", json=req)).json()
    spec, vllm = body["usage"]["speculative"], body["metrics"]["speculative_decoding"]
    histogram = vllm["acceptance_histogram"]
    assert (
        vllm["num_draft_tokens"] == spec["draft_tokens"]
        and vllm["num_accepted_draft_tokens"] == spec["accepted_tokens"]
    )
    assert vllm["num_spec_tokens"] == 3 and len(histogram) == 4
    assert (
        vllm["num_spec_steps"] == sum(histogram) >= 1
        and sum(a * n for a, n in enumerate(histogram)) == spec["accepted_tokens"]
    )
    assert vllm["draft_acceptance_rate"] == pytest.approx(spec["acceptance_rate"])
    assert vllm["mean_acceptance_length"] == pytest.approx(
        1 + spec["accepted_tokens"] / vllm["num_spec_steps"]
    )
    plain = (
        await client.post("/v1/chat/completions", json={**req, "speculative": {"mode": "autoregressive"}})
    ).json()
    assert "metrics" not in plain  # nothing drafted: no block, as vLLM without a speculator


async def test_vllm_benchmark_parameters_are_accepted(
    client: httpx.AsyncClient, fakes: FakeWorkerTransport
) -> None:
    """ignore_eos and min_tokens (vLLM's benchmark_serving and AIPerf send them) in every mode:
    min_tokens travels in the transform, on the call that starts the session."""
    for mode in ("autoregressive", "aggregate", "exact"):
        for extra in ({"ignore_eos": True}, {"min_tokens": 3}):
            fakes.requests.clear()
            body = {**COMPLETION, **extra, "max_tokens": 5, "speculative": {"mode": mode}}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 5
            verifies = [r for _, r in fakes.requests]
            if "min_tokens" in extra:
                starts = [r for r in verifies if r.prefix_len == 0]
                specs = [TransformSpec.from_wire(r.transform) for r in starts]
                # the draft's EOS ids
                assert specs and all(
                    (s.min_tokens, s.prompt_len) == (3, len(r.tokens)) and 2 in s.eos_ids
                    for s, r in zip(specs, starts)
                )
                assert all(r.transform is None for r in verifies if r.prefix_len)  # the session keeps it
            else:
                assert all(r.transform is None for r in verifies)
    too_many = {**COMPLETION, "min_tokens": 7, "max_tokens": 6}
    assert_error(
        await client.post("/v1/completions", json=too_many), 400, "min_tokens", contains="at most max_tokens"
    )
    assert_error(
        await client.post("/v1/completions", json={**COMPLETION, "min_tokens": -1}),
        400,
        contains="min_tokens",
    )


async def test_a_trees_default_payload_is_sparse_and_a_top_k_or_full_asked_for_gets_rows(
    client: httpx.AsyncClient, fakes: FakeWorkerTransport
) -> None:
    """Sized for a WAN: a tree with no payload named carries exact's sparse payload (supports, no rows); one
    that asks for k: 8 gets aggregate's top-8 rows, and k: "full" aggregate's full rows — as a tree with
    payload aggregate does."""
    cases = [
        ({}, "exact", None),
        ({"k": 8}, "aggregate", 8),
        ({"k": "full"}, "aggregate", None),
        ({"tree": {"payload": "aggregate"}}, "aggregate", None),
    ]
    for extra, mode, k in cases:
        fakes.requests.clear()
        body = {**COMPLETION, "max_tokens": 4, "temperature": 1.0, "speculative": {"mode": "tree", **extra}}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        verifies = [r for _, r in fakes.requests if r.parents is not None]
        assert verifies and all(r.mode == mode and r.k == k for r in verifies), (
            extra,
            {(r.mode, r.k) for r in verifies},
        )
        assert all((r.support_ids is not None) == (mode == "exact") for r in verifies)


async def test_min_tokens_looks_for_stop_strings_only_after_it(
    client: httpx.AsyncClient, tiny_runner: ModelRunner
) -> None:
    """As vLLM: the first min_tokens tokens' text is not searched for stop strings."""
    piece = tiny_runner.tokenizer.decode([FAVOURITE])
    body = {**COMPLETION, "temperature": 0, "stop": [piece]}
    assert (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"] == ""
    choice = (await client.post("/v1/completions", json={**body, "min_tokens": 3})).json()["choices"][0]
    assert choice["text"] == piece * 3 and choice["finish_reason"] == "stop"


async def test_chat_logprobs_join_to_the_content_without_the_end_token(
    tiny_runner: ModelRunner, fakes: FakeWorkerTransport
) -> None:
    """The end of the turn (<|im_end|>) is left out of message.content, so out of its logprobs
    too: the tokens join to the content, as OpenAI's do (issue 33)."""
    app = create_app(gateway_config(), draft_runner=tiny_runner, transport=fakes.transport())
    async with app.router.lifespan_context(app):
        gateway = app.state.gateway
        tokenizer = gateway.tokenizer
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        tokens = [*tokenizer.encode("Hello there"), end]
        logprobs = [TokenLogprob(t, -0.5, [(t, -0.5)]) for t in tokens]
        job = gateway.requests.chat_job(
            ChatCompletionRequest(
                model=gateway.config.model, messages=[{"role": "user", "content": "Hi"}], logprobs=True
            )
        )  # type: ignore[list-item]
        content = app.state.logprobs.chat(job, logprobs)
    assert content is not None and [c["token"] for c in content["content"]] == [
        tokenizer.decode([t]) for t in tokens[:-1]
    ]
    assert "".join(c["token"] for c in content["content"]) == tokenizer.decode(
        tokens, skip_special_tokens=True
    )


async def test_a_long_prompt_starts_without_the_draft(client: httpx.AsyncClient) -> None:
    """From ``draft.background_prefill_from`` tokens (64 by default) a drafting request's first round carries
    no draft — the workers sample it — while the draft prefills (app.engine.late); a seeded one exactly one
    such round."""
    long = (
        await client.post(
            "/v1/completions", json={**COMPLETION, "prompt": "Once upon a time " * 20, "seed": 3}
        )
    ).json()["usage"]
    assert (
        long["prompt_tokens"] >= 64
        and long["speculative"]["rounds_without_draft"] == 1
        and long["speculative"]["draft_tokens"] > 0
    )
    short = (await client.post("/v1/completions", json={**COMPLETION, "seed": 3})).json()["usage"][
        "speculative"
    ]
    assert short["rounds_without_draft"] == 0
    plain = (
        await client.post(
            "/v1/completions",
            json={
                **COMPLETION,
                "prompt": "Once upon a time " * 20,
                "speculative": {"mode": "autoregressive"},
            },
        )
    ).json()
    assert "rounds_without_draft" not in plain["usage"]["speculative"]  # nothing drafts, nothing waits


async def test_split_on_whole_rows_truncates_its_draft_and_the_worker_draws_at_a_rejection(
    gateway: Any, fakes: FakeWorkerTransport
) -> None:
    """Sized for a WAN (issue 61): split with no top-k asked (or k: "full") drafts on truncated supports
    (draft_top_k 32, as exact) and sends them with q̂ (support_q), so the worker draws the token at a
    rejection and sends no row back; a top-k asked keeps the row (p̂'s residual at the gateway, with its
    bound), and so does draft_top_k: 0 (the whole draft); T = 0 has no residual."""
    async with gateway(
        workers=[{"url": "http://w0:1", "weight": 1.0}], speculative={"mode": "split", "num_draft_tokens": 3}
    ) as client:
        cases = (
            ({}, 1.0, True),
            ({"k": "full"}, 1.0, True),
            ({"k": 8}, 1.0, False),
            ({}, 0.0, False),
            ({"draft_top_k": 0}, 1.0, False),
        )
        for extra, temperature, drawn in cases:
            fakes.requests.clear()
            body = {
                **COMPLETION,
                "max_tokens": 6,
                "temperature": temperature,
                "seed": 5,
                "speculative": {"mode": "split", **extra},
            }
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            block = resp.json()["usage"]["speculative"]
            verifies = [r for _, r in fakes.requests if len(r.draft)]
            assert verifies and all((r.support_q is not None) == drawn for r in verifies), (
                extra,
                temperature,
            )
            assert block.get("draft_top_k") == (
                32 if extra.get("k", "full") == "full" and "draft_top_k" not in extra else None
            ), block
            if drawn:
                assert all(r.support_sizes is not None and 0 < r.support_sizes.max() <= 32 for r in verifies)


TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


async def test_tokenize_counts_what_a_request_would_take_and_detokenize_writes_it_back(
    gateway: Any, tiny_runner: ModelRunner
) -> None:
    """Issue 62, item 4 — vLLM's ``/tokenize`` and ``/detokenize``: a prompt's count is the completion's
    ``usage.prompt_tokens``, messages' (with and without tools) the chat's; ``max_model_len`` is /v1/models';
    the tokens come back as text, special tokens written out; ``return_token_strs`` gives the pieces."""
    async with gateway(limits={"max_tokens": 64, "max_prompt_tokens": 1000}) as client:
        await _tokenize_checks(client, tiny_runner)


async def _tokenize_checks(client: httpx.AsyncClient, tiny_runner: ModelRunner) -> None:
    tokenized = (
        await client.post("/tokenize", json={"model": "test-model", "prompt": COMPLETION["prompt"]})
    ).json()
    completion = (
        await client.post("/v1/completions", json={**COMPLETION, "max_tokens": 1, "temperature": 0})
    ).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == completion["usage"]["prompt_tokens"]
    models = (await client.get("/v1/models")).json()["data"][0]
    assert tokenized["max_model_len"] == models["max_model_len"]
    for extra in ({}, {"tools": [TOOL]}):
        counted = (await client.post("/tokenize", json={"messages": CHAT["messages"], **extra})).json()
        chat = (
            await client.post(
                "/v1/chat/completions", json={**CHAT, **extra, "max_tokens": 1, "temperature": 0}
            )
        ).json()
        assert "usage" in chat and counted["count"] == chat["usage"]["prompt_tokens"], (extra, chat)
    open_turn = (
        await client.post("/tokenize", json={"messages": CHAT["messages"], "add_generation_prompt": False})
    ).json()
    assert open_turn["count"] < counted["count"] - 3  # no tools and no assistant header: fewer tokens
    back = (await client.post("/detokenize", json={"tokens": tokenized["tokens"]})).json()
    assert back == {"prompt": COMPLETION["prompt"]}
    chat_tokens = (await client.post("/tokenize", json={"messages": CHAT["messages"]})).json()["tokens"]
    assert "<|im_start|>" in (await client.post("/detokenize", json={"tokens": chat_tokens})).json()["prompt"]
    pieces = (await client.post("/tokenize", json={"prompt": "Hi there", "return_token_strs": True})).json()
    assert (
        pieces["token_strs"] == tiny_runner.tokenizer.convert_ids_to_tokens(pieces["tokens"])
        and len(pieces["token_strs"]) == pieces["count"]
    )


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "tools": [TOOL]}, 400, "prompt"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "b"}], "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        ("/tokenize", {"prompt": "a", "add_bos": True}, 400, "add_bos"),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
        ("/tokenize", {"prompt": "\ud83d"}, 400, "prompt"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens.1"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
async def test_tokenize_and_detokenize_refuse_bad_bodies_by_name(
    client: httpx.AsyncClient, path: str, body: dict, status: int, param: str
) -> None:
    resp = await client.post(
        path, content=json.dumps(body, ensure_ascii=True), headers={"content-type": "application/json"}
    )
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"], error


async def test_the_tokenizer_routes_need_the_api_key_where_one_is_set(gateway: Any) -> None:
    async with gateway(api_key="sk-tok") as client:
        assert (await client.post("/tokenize", json={"prompt": "a"})).status_code == 401
        assert (await client.post("/detokenize", json={"tokens": [1]})).status_code == 401
        ok = await client.post("/tokenize", json={"prompt": "a"}, headers={"authorization": "Bearer sk-tok"})
        assert ok.status_code == 200 and ok.json()["count"] >= 1
