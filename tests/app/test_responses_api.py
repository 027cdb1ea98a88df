"""``/v1/responses`` in-process over fake workers: the answer is the chat answer to the same conversation; the
stream's events come in OpenAI's order with sequence numbers, and every body and event passes OpenAI's
published schema; the store chains turns by id; what the gateway does not do is a 400 naming the field, and a
failure mid-stream is an ``error`` event and ``response.failed``. The SDK and the Agents SDK against real
models: tests/integration/test_responses_real.py."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from app.engine import SpecOptions
from app.requests import Job
from app.responses_api.output import ResponseBuilder, item_page
from app.responses_api.request import to_chat
from app.responses_api.schemas import ResponsesRequest
from app.usage import Usage
from core.grammar import strict
from core.names import Mode, Reconstruction
from tests.app.conftest import Gateway
from tests.app.fakes import FakeWorkerTransport
from tests.app.helpers import assert_error
from tests.app.test_openai_schema import check, event_schemas

BASE = {"model": "test-model", "max_output_tokens": 6, "seed": 3}
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def events(resp: httpx.Response) -> list[dict[str, Any]]:
    """The stream's events: each ``event:`` line's type must be its data's."""
    assert resp.status_code == 200, resp.text
    out = []
    for block in resp.text.strip().split("\n\n"):
        lines = [line for line in block.splitlines() if not line.startswith(":")]
        if not lines:
            continue
        kind = next(line[len("event: ") :] for line in lines if line.startswith("event: "))
        data = json.loads("".join(line[len("data: ") :] for line in lines if line.startswith("data: ")))
        assert data["type"] == kind
        out.append(data)
    return out


def checked(stream: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every event against OpenAI's schema, numbered 0, 1, 2 …, and in the order OpenAI sends them."""
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    for event in stream:
        check(event, event_schemas()[event["type"]])
    kinds = [e["type"] for e in stream]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed",
        "response.incomplete",
        "response.failed",
    )
    open_items: dict[int, str] = {}
    for event in stream[2:-1]:
        index = event.get("output_index")
        if event["type"] == "response.output_item.added":
            assert index not in open_items and not open_items  # one item written at a time
            open_items[index] = event["item"]["type"]
        elif event["type"] == "response.output_item.done":
            assert open_items.pop(index) == event["item"]["type"]
        elif index is not None:
            assert index in open_items, event  # deltas only inside an open item
    assert not open_items
    return stream


async def test_a_response_is_the_chat_answer_and_its_stream_adds_up_to_it(client: httpx.AsyncClient) -> None:
    chat = (
        await client.post(
            "/v1/chat/completions",
            json={
                "model": "test-model",
                "max_tokens": 6,
                "seed": 3,
                "temperature": 0,
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            },
        )
    ).json()
    body = {**BASE, "temperature": 0, "instructions": "Be brief.", "input": "Hi"}
    whole = (await client.post("/v1/responses", json=body)).json()
    check(whole, "Response")
    assert whole["object"] == "response" and whole["id"].startswith("resp_")
    [message] = whole["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    usage = whole["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (
        chat["usage"]["prompt_tokens"],
        chat["usage"]["completion_tokens"],
    )
    assert (
        usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        and usage["speculative"]["mode"] == "aggregate"
    )
    assert whole["status"] == (
        "incomplete" if chat["choices"][0]["finish_reason"] == "length" else "completed"
    )
    stream = checked(events(await client.post("/v1/responses", json={**body, "stream": True})))
    text = "".join(e["delta"] for e in stream if e["type"] == "response.output_text.delta")
    assert text == message["content"][0]["text"]
    final = stream[-1]["response"]
    assert (
        final["output"][0]["content"] == message["content"]
        and final["usage"]["output_tokens"] == usage["output_tokens"]
    )
    kinds = [e["type"] for e in stream]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]


async def test_max_output_tokens_makes_an_incomplete_response(client: httpx.AsyncClient) -> None:
    body = {**BASE, "max_output_tokens": 2, "input": "Tell me a long story", "temperature": 0}
    whole = (await client.post("/v1/responses", json=body)).json()
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["output"][0]["status"] == "incomplete" and whole["usage"]["output_tokens"] == 2
    stream = checked(events(await client.post("/v1/responses", json={**body, "stream": True})))
    assert stream[-1]["type"] == "response.incomplete" and stream[-1]["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"
    }


def test_calls_make_function_call_items_and_their_events_in_openais_shapes() -> None:
    """The fake workers do not follow a grammar, so tool calls are built here from the chat path's deltas (the
    real model calls tools in tests/integration/test_responses_real.py): text, then two calls, one of them
    namespaced."""
    body = ResponsesRequest.model_validate(
        {
            **BASE,
            "input": "x",
            "tools": [TOOL, {"type": "namespace", "name": "ns", "tools": [{**TOOL, "name": "inner"}]}],
        }
    )
    translated = to_chat(body, None)
    builder = ResponseBuilder(
        body,
        translated,
        Job(
            "chatcmpl-1",
            0,
            "test-model",
            [],
            [],
            Usage(
                SpecOptions(
                    mode=Mode.AGGREGATE, num_draft_tokens=3, k=None, reconstruction=Reconstruction.RENORMALIZE
                ),
                4,
            ),
        ),
        store=False,
    )
    stream = builder.start()
    for deltas in (
        [{"content": "Let me look."}],
        [
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ]
            }
        ],
        [
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
        ],
        [
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "call_b",
                        "type": "function",
                        "function": {"name": "ns__inner", "arguments": "{}"},
                    }
                ]
            }
        ],
    ):
        stream += builder.push(deltas)
    stream += builder.finish("tool_calls")
    checked(stream)
    whole = builder.response()
    check(whole, "Response")
    assert [
        (i["type"], i.get("name"), i.get("arguments"), i.get("namespace"), i["status"])
        for i in whole["output"]
    ] == [
        ("message", None, None, None, "completed"),
        ("function_call", "get_weather", '{"city":"Paris"}', None, "completed"),
        ("function_call", "inner", "{}", "ns", "completed"),
    ]
    done = [e for e in stream if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"], e["output_index"]) for e in done] == [
        ("get_weather", '{"city":"Paris"}', 1),
        ("inner", "{}", 2),
    ]
    assert [{k: v for k, v in item.items() if k != "id"} for item in builder.conversation()[-2:]] == [
        {
            "type": "function_call",
            "call_id": "call_a",
            "name": "get_weather",
            "arguments": '{"city":"Paris"}',
        },
        {"type": "function_call", "call_id": "call_b", "name": "inner", "arguments": "{}", "namespace": "ns"},
    ]


async def test_a_tool_result_sent_back_or_chained_by_id_makes_one_prompt(gateway: Gateway) -> None:
    async with gateway(
        responses={"store": "memory"}, limits={"max_tokens": 64, "max_prompt_tokens": 400}
    ) as client:
        call = {
            "type": "function_call",
            "call_id": "call_a",
            "name": "get_weather",
            "arguments": '{"city":"Paris"}',
        }
        result = {"type": "function_call_output", "call_id": "call_a", "output": "18 C, sunny"}
        first = (
            await client.post(
                "/v1/responses",
                json={
                    **BASE,
                    "input": [{"role": "user", "content": "Weather in Paris?"}, call],
                    "tools": [TOOL],
                },
            )
        ).json()
        by_items = (
            await client.post(
                "/v1/responses",
                json={
                    **BASE,
                    "temperature": 0,
                    "tools": [TOOL],
                    "input": [
                        {"role": "user", "content": "Weather in Paris?"},
                        call,
                        {
                            "type": "message",
                            "role": "assistant",
                            "content": [
                                {"type": "output_text", "text": first["output"][0]["content"][0]["text"]}
                            ],
                        },
                        result,
                    ],
                },
            )
        ).json()
        by_id = (
            await client.post(
                "/v1/responses",
                json={
                    **BASE,
                    "temperature": 0,
                    "input": [result],
                    "tools": [TOOL],
                    "previous_response_id": first["id"],
                },
            )
        ).json()
        assert by_items["usage"]["input_tokens"] == by_id["usage"]["input_tokens"]
        assert by_items["output"][0]["content"] == by_id["output"][0]["content"]
        orphan = await client.post(
            "/v1/responses",
            json={**BASE, "input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]},
        )
        assert_error(orphan, 400, "input", "answers no call")


async def test_text_format_is_echoed_and_a_bad_schema_named(client: httpx.AsyncClient) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    body = {
        **BASE,
        "max_output_tokens": 20,
        "input": "Answer in JSON",
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
    }
    whole = (await client.post("/v1/responses", json=body)).json()
    check(whole, "Response")
    assert whole["text"]["format"]["type"] == "json_schema" and whole["text"]["format"]["schema"] == schema
    bad = await client.post(
        "/v1/responses",
        json={
            **body,
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": "wat"}}},
                }
            },
        },
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format.schema", bad.text


async def test_the_store_chains_turns_and_answers_get_and_delete(gateway: Gateway) -> None:
    async with gateway(
        responses={"store": "memory"}, limits={"max_tokens": 64, "max_prompt_tokens": 400}
    ) as client:
        first = (
            await client.post(
                "/v1/responses", json={**BASE, "input": "My name is Ada.", "metadata": {"k": "v"}}
            )
        ).json()
        assert first["store"] is True and first["metadata"] == {"k": "v"}
        got = await client.get(f"/v1/responses/{first['id']}")
        assert got.status_code == 200 and got.json() == first
        second = (
            await client.post(
                "/v1/responses",
                json={
                    **BASE,
                    "temperature": 0,
                    "input": "What is my name?",
                    "previous_response_id": first["id"],
                },
            )
        ).json()
        answer = first["output"][0]["content"][0]["text"]
        chat = (
            await client.post(
                "/v1/chat/completions",
                json={
                    "model": "test-model",
                    "max_tokens": 6,
                    "seed": 3,
                    "temperature": 0,
                    "messages": [
                        {"role": "user", "content": "My name is Ada."},
                        {"role": "assistant", "content": answer},
                        {"role": "user", "content": "What is my name?"},
                    ],
                },
            )
        ).json()
        assert (
            second["previous_response_id"] == first["id"]
            and second["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
        )
        assert second["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
        streamed = checked(
            events(
                await client.post(
                    "/v1/responses",
                    json={**BASE, "input": "Again", "previous_response_id": second["id"], "stream": True},
                )
            )
        )
        third = streamed[-1]["response"]
        assert (await client.get(f"/v1/responses/{third['id']}")).json()["status"] in (
            "completed",
            "incomplete",
        )
        listed = (
            await client.get(f"/v1/responses/{third['id']}/input_items", params={"order": "asc"})
        ).json()
        check(listed, "ResponseItemList")
        assert [(i["type"], i.get("role")) for i in listed["data"]] == [
            ("message", "user"),
            ("message", "assistant"),
        ] * 2 + [("message", "user")]
        assert listed["data"][1]["id"] == first["output"][0]["id"] and listed["data"][-1]["content"] == [
            {"type": "input_text", "text": "Again"}
        ]
        page = (await client.get(f"/v1/responses/{third['id']}/input_items", params={"limit": 2})).json()
        assert [i["id"] for i in page["data"]] == [i["id"] for i in listed["data"][::-1][:2]] and page[
            "has_more"
        ] is True
        deleted = await client.delete(f"/v1/responses/{first['id']}")
        assert deleted.json() == {"id": first["id"], "object": "response", "deleted": True}
        assert_error(await client.get(f"/v1/responses/{first['id']}"), 404, "response_id")
        assert_error(await client.delete(f"/v1/responses/{first['id']}"), 404, "response_id")
        gone = await client.post(
            "/v1/responses", json={**BASE, "input": "x", "previous_response_id": first["id"]}
        )
        assert_error(gone, 404, "previous_response_id", code="previous_response_not_found")
        after = await client.post(
            "/v1/responses", json={**BASE, "input": "x", "previous_response_id": second["id"]}
        )
        # its chain runs through the deleted one
        assert (
            after.status_code == 200
            and after.json()["usage"]["input_tokens"] > second["usage"]["input_tokens"]
        )
        unstored = (await client.post("/v1/responses", json={**BASE, "input": "x", "store": False})).json()
        assert unstored["store"] is False
        assert_error(await client.get(f"/v1/responses/{unstored['id']}"), 404)
    async with gateway(responses={"store": "none"}) as client:
        answered = (await client.post("/v1/responses", json={**BASE, "input": "x"})).json()
        assert answered["store"] is False
        assert_error(
            await client.post("/v1/responses", json={**BASE, "input": "x", "previous_response_id": "resp_1"}),
            400,
            "previous_response_id",
            "responses.store: none",
        )
        assert_error(await client.get("/v1/responses/resp_1"), 404)


@pytest.mark.parametrize(
    "extra, param, contains",
    [
        ({"frequency_penalty": 1}, "frequency_penalty", "/v1/chat/completions takes it"),
        # chat's own fields would change the answer: never passed over
        ({"max_tokens": 50}, "max_tokens", "use max_output_tokens"),
        ({"response_format": {"type": "json_object"}}, "response_format", "use text.format"),
        (
            {
                "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "f"},
            },
            "tools.1",
            "two tools",
        ),
        (
            {
                "input": [
                    {
                        "type": "function_call_output",
                        "call_id": "c",
                        "output": [{"type": "input_image", "image_url": "http://x"}],
                    }
                ]
            },
            "input.0.output.0.type",
            "text models",
        ),
        (
            {
                "tools": [
                    {
                        "type": "custom",
                        "name": "p",
                        "format": {"type": "grammar", "syntax": "regex", "definition": "a)|(b"},
                    }
                ]
            },
            "tools.0.format.definition",
            "never opened",
        ),
        ({"background": True}, "background", "background"),
        ({"truncation": "auto"}, "truncation", "truncation"),
        ({"include": ["message.output_text.logprobs"]}, "include.0", "not supported"),
        ({"max_output_token": 5}, "max_output_token", "did you mean max_output_tokens"),
        ({"tools": [{"type": "tool_search"}]}, "tools.0.type", "tool_search"),
        (
            {
                "tools": [
                    {
                        "type": "custom",
                        "name": "p",
                        "format": {"type": "grammar", "syntax": "lark", "definition": 'start: a\na: "x" a'},
                    }
                ]
            },
            "tools.0.format.definition",
            "recursive",
        ),
        (
            {
                "tools": [
                    {"type": "function", "name": "f"},
                    {"type": "namespace", "name": "n", "tools": [{"type": "custom", "name": "f"}]},
                    {"type": "function", "name": "n__f"},
                ]
            },
            "tools.2",
            "n__f",
        ),
        ({"tools": [{"type": "teleport"}]}, "tools.0.type", "teleport"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice", "hosted"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "send the item itself"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
            "input.0.content.0.type",
            "text models",
        ),
        ({"input": None}, "input", "input is required"),
        ({"max_output_tokens": 100_000}, "max_output_tokens", "max_output_tokens"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "wat"}}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools.0.parameters",
            "",
        ),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options", "stream: true"),
        ({"input": "\ud83d"}, "input", "surrogate"),
    ],
)
async def test_what_the_gateway_does_not_do_is_a_400_naming_the_field(
    gateway: Gateway, extra: dict[str, Any], param: str, contains: str
) -> None:
    body = {**BASE, "input": "Hi", **extra}
    async with gateway(limits={"max_tokens": 64, "max_prompt_tokens": 400}) as client:
        resp = await client.post(
            "/v1/responses", content=json.dumps(body), headers={"content-type": "application/json"}
        )
    error = assert_error(resp, 400, param, contains)
    check(resp.json(), "ErrorResponse")
    assert "messages" not in error["message"]


async def test_a_coding_agents_request_is_accepted_and_what_it_passes_over_is_said(gateway: Gateway) -> None:
    """The fields a coding agent sends with every request: developer messages of input_text parts, store:
    false, include reasoning.encrypted_content, reasoning.summary, prompt_cache_key, client_metadata, function
    tools with strict: false, a namespace of more tools and the hosted web_search. Its ~40 KB request (~10k
    tokens) is over a small model's context: a 400 in the error shape the agent prints; the same request with
    short instructions is answered, with a warning."""
    shell = {
        "type": "function",
        "name": "shell",
        "description": "Runs a shell command. " * 40,
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "array", "items": {"type": "string"}},
                "workdir": {"type": "string"},
            },
            "required": ["command"],
        },
    }
    namespace = {
        "type": "namespace",
        "name": "collaboration",
        "description": "Other agents.",
        "tools": [
            {
                "type": "function",
                "name": "spawn_agent",
                "description": "Spawns an agent.",
                "strict": False,
                "parameters": {
                    "type": "object",
                    "properties": {"message": {"type": "string"}},
                    "required": ["message"],
                },
            },
            {
                "type": "function",
                "name": "send_message",
                "description": "Messages an agent.",
                "strict": False,
                "parameters": {"type": "object", "properties": {"message": {"type": "string"}}},
            },
        ],
    }
    developer = {
        "type": "message",
        "role": "developer",
        "content": [
            {
                "type": "input_text",
                "text": "<permissions instructions>Sandbox: workspace-write.</permissions instructions>",
            }
        ],
    }
    user = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "List the files here."}],
    }
    body = {
        "model": "test-model",
        "instructions": "You are a coding agent. " * 1600,
        "input": [developer, user],
        "tools": [shell, namespace, {"type": "web_search", "external_web_access": False}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "019a-conversation",
        "client_metadata": {"originator": "codex_cli_rs"},
    }
    assert len(json.dumps(body)) > 38_000
    async with gateway(limits={"max_tokens": 64, "max_prompt_tokens": 1500}) as client:
        too_long = await client.post("/v1/responses", json=body)
        assert_error(too_long, 400, "input", "tokens", code="context_length_exceeded")
        check(too_long.json(), "ErrorResponse")
        short = {**body, "instructions": "You are a coding agent.", "max_output_tokens": 8}
        stream = checked(events(await client.post("/v1/responses", json=short)))
        final = stream[-1]["response"]
        assert final["store"] is False and [t["name"] for t in final["tools"]] == [
            "shell",
            "spawn_agent",
            "send_message",
        ]
        assert final["warnings"] == [
            "tools[2]: web_search is a hosted tool, which this gateway does not run: it was left "
            "out of the prompt"
        ]


async def test_a_failure_mid_stream_is_an_error_event_and_a_failed_response(
    gateway: Gateway, fakes: FakeWorkerTransport
) -> None:
    async with gateway() as client:
        fakes.behaviour["w1"] = "die-after:1"
        stream = checked(
            events(
                await client.post(
                    "/v1/responses", json={**BASE, "max_output_tokens": 30, "input": "Hi", "stream": True}
                )
            )
        )
        assert [e["type"] for e in stream[-2:]] == ["error", "response.failed"]
        assert stream[-2]["code"] == "worker_error" and "w1" in stream[-2]["message"]
        assert (
            stream[-1]["response"]["status"] == "failed"
            and stream[-1]["response"]["error"]["code"] == "server_error"
        )


PATCH_LARK = """start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change?
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line
change: (change_context | change_line)+
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
%import common.LF
"""
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edits files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_LARK},
}
A_PATCH = '*** Begin Patch\n*** Add File: hello.txt\n+Hello "world"\n*** End Patch\n'


def _built(
    body: dict[str, Any], pieces: list[list[dict[str, Any]]], reason: str = "tool_calls"
) -> tuple[ResponseBuilder, list[dict[str, Any]]]:
    request = ResponsesRequest.model_validate({**BASE, **body})
    builder = ResponseBuilder(
        request,
        to_chat(request, None),
        Job(
            "chatcmpl-1",
            0,
            "test-model",
            [],
            [],
            Usage(
                SpecOptions(
                    mode=Mode.AGGREGATE, num_draft_tokens=3, k=None, reconstruction=Reconstruction.RENORMALIZE
                ),
                4,
            ),
        ),
        store=False,
    )
    stream = builder.start()
    for deltas in pieces:
        stream += builder.push(deltas)
    return builder, checked(stream + builder.finish(reason))


def _call(index: int, name: str, arguments: str, size: int = 7) -> list[list[dict[str, Any]]]:
    """A call as the chat path's deltas: its name, then its arguments in pieces of ``size`` characters."""
    pieces = [
        [
            {
                "tool_calls": [
                    {
                        "index": index,
                        "id": f"call_{index}",
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }
                ]
            }
        ]
    ]
    return pieces + [
        [{"tool_calls": [{"index": index, "function": {"arguments": arguments[i : i + size]}}]}]
        for i in range(0, len(arguments), size)
    ]


def test_a_freeform_tool_is_a_function_of_one_string_held_to_its_grammar() -> None:
    """Issue 75: a custom tool (a coding agent's apply_patch) was a 400. It is offered as a function whose one
    string parameter carries the tool's Lark grammar as its pattern; its call is a custom_tool_call item sent
    whole once its input is (cut, it is never sent), and sent back (with its output) it is the same call
    again."""
    translated = to_chat(
        ResponsesRequest.model_validate({**BASE, "input": "Add hello.txt", "tools": [APPLY_PATCH]}), None
    )
    [function] = [t.function for t in translated.chat.tools or []]
    assert function.name == "apply_patch" and (function.parameters or {})["required"] == ["input"]
    # the prompt shows the grammar
    assert (function.parameters or {})["properties"]["input"]["x-freeform"] == {
        "syntax": "lark",
        "definition": PATCH_LARK,
    }
    pattern = strict(function.parameters)["properties"]["input"]["pattern"]  # the grammar engine holds it
    assert re.fullmatch(pattern, A_PATCH) and not re.fullmatch(pattern, "rm -rf /\n")
    arguments = json.dumps({"input": A_PATCH}, separators=(",", ":"))
    builder, stream = _built(
        {"input": "Add hello.txt", "tools": [APPLY_PATCH]}, _call(0, "apply_patch", arguments, size=3)
    )
    [item] = builder.response()["output"]
    assert (
        item["type"] == "custom_tool_call"
        and item["name"] == "apply_patch"
        and item["input"] == A_PATCH
        and item["status"] == "completed"
    )
    check(item, "CustomToolCall")
    assert (
        "".join(e["delta"] for e in stream if e["type"] == "response.custom_tool_call_input.delta") == A_PATCH
    )
    assert [e["input"] for e in stream if e["type"] == "response.custom_tool_call_input.done"] == [A_PATCH]
    _, cut = _built(
        {"input": "Add hello.txt", "tools": [APPLY_PATCH]},
        _call(0, "apply_patch", arguments[:-12]),
        reason="length",
    )
    # a cut input is often a valid one: never sent, or a client would run it
    assert all(e.get("item", {}).get("type") != "custom_tool_call" for e in cut)
    _, unread = _built(
        {"input": "Add hello.txt", "tools": [APPLY_PATCH]}, _call(0, "apply_patch", '{"input": 5}')
    )
    # no input string: not a call to run
    assert all(e.get("item", {}).get("type") != "custom_tool_call" for e in unread)
    later = {
        "input": [
            *builder.conversation(),
            {"type": "custom_tool_call_output", "call_id": "call_0", "output": "Done!"},
        ],
        "tools": [APPLY_PATCH],
    }
    messages = to_chat(ResponsesRequest.model_validate({**BASE, **later}), None).chat.chat_messages()
    assert messages[-2]["tool_calls"][0]["function"] == {"name": "apply_patch", "arguments": arguments}
    assert messages[-1] == {"role": "tool", "content": "Done!", "tool_call_id": "call_0"}


@pytest.mark.parametrize(
    "tool, arguments, schema, expected",
    [
        (
            "local_shell",
            {"command": ["ls", "-la"], "workdir": "/src"},
            "LocalShellToolCall",
            {"action": {"type": "exec", "command": ["ls", "-la"], "env": {}, "working_directory": "/src"}},
        ),
        (
            "shell",
            {"commands": ["ls", "pwd"]},
            "FunctionShellCall",
            {"action": {"commands": ["ls", "pwd"], "timeout_ms": None, "max_output_length": None}},
        ),
        (
            "apply_patch",
            {"type": "create_file", "path": "a.txt", "diff": "+hi\n"},
            "ApplyPatchToolCall",
            {"operation": {"type": "create_file", "path": "a.txt", "diff": "+hi\n"}},
        ),
    ],
)
def test_a_client_run_tool_is_called_as_its_own_item(
    tool: str, arguments: dict[str, Any], schema: str, expected: dict[str, Any]
) -> None:
    """Issue 75: local_shell, shell and apply_patch were left out as if OpenAI ran them. The model gets each
    as a function; its call comes back as the tool's own item (the client runs it), whole once its arguments
    are; the item and its output, sent back, are the call and a tool message again."""
    text = json.dumps(arguments, separators=(",", ":"))
    builder, stream = _built({"input": "x", "tools": [{"type": tool}]}, _call(0, tool, text))
    [item] = builder.response()["output"]
    assert item["type"] == f"{tool}_call" and item["call_id"] == "call_0" and item["status"] == "completed"
    assert {k: item[k] for k in expected} == expected
    check(item, schema)
    assert [e["type"] for e in stream[2:-1]] == ["response.output_item.added", "response.output_item.done"]
    output = {
        "type": f"{tool}_call_output",
        "call_id": "call_0",
        "output": [{"stdout": "a\n", "stderr": "", "outcome": {"type": "exit", "exit_code": 0}}]
        if tool == "shell"
        else "a\n",
    }
    messages = to_chat(
        ResponsesRequest.model_validate(
            {**BASE, "input": [*builder.conversation(), output], "tools": [{"type": tool}]}
        ),
        None,
    ).chat.chat_messages()
    assert messages[-2]["tool_calls"][0]["function"] == {"name": tool, "arguments": text}
    assert messages[-1]["role"] == "tool" and messages[-1]["content"].startswith("a\n")
    _, cut = _built({"input": "x", "tools": [{"type": tool}]}, _call(0, tool, text[:-4]), reason="length")
    # cut: never run
    assert cut[-1]["response"]["output"] == [] or all(
        i["type"] == "message" for i in cut[-1]["response"]["output"]
    )


def test_namespaces_keep_tools_of_one_name_apart_and_a_turn_stays_one() -> None:
    """Issue 75: two namespaces with a tool of one name were "two functions share a name"; an assistant's text
    and its calls became two assistant turns; reasoning items were dropped. Now each namespaced tool is
    offered by its qualified name and called back with its namespace; text and calls are one turn; reasoning
    goes with the turn it precedes."""
    search = {"type": "function", "name": "search", "parameters": {"type": "object", "properties": {}}}
    tools = [
        {"type": "namespace", "name": "docs", "tools": [search]},
        {"type": "namespace", "name": "code", "tools": [search]},
    ]
    builder, _ = _built({"input": "x", "tools": tools}, _call(0, "code__search", "{}"))
    [item] = builder.response()["output"]
    assert (item["name"], item["namespace"]) == ("search", "code")
    history = [
        {"role": "user", "content": "Find it."},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Search the code."}],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "c1", "name": "search", "namespace": "code", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "search", "namespace": "docs", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "found"},
        {"type": "function_call_output", "call_id": "c2", "output": "none"},
    ]
    messages = to_chat(
        ResponsesRequest.model_validate({**BASE, "input": history, "tools": tools}), None
    ).chat.chat_messages()
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    turn = messages[1]
    assert turn["content"] == "Looking." and turn["reasoning_content"] == "Search the code."
    assert [c["function"]["name"] for c in turn["tool_calls"]] == ["code__search", "docs__search"]


async def test_hints_and_newer_fields_are_passed_over(gateway: Gateway) -> None:
    """Issue 75: reasoning.context / mode, effort "max", prompt_cache_options, fields newer than this gateway
    (at the top, in items and parts, in tools) were 400s. A shell in OpenAI's container is hosted: left out,
    with a warning."""
    newer_items = [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Hi", "colour": 1}],
            "end_turn": True,
        }
    ]
    body = {
        **BASE,
        "input": newer_items,
        "reasoning": {"effort": "max", "context": "all", "mode": "fast"},
        "prompt_cache_options": {"ttl": "1h"},
        "omit_null_encrypted_content": True,
        "some_future_field": {"a": 1},
        "tools": [
            {
                "type": "function",
                "name": "f",
                "parameters": {"type": "object"},
                "output_schema": {"type": "string"},
                "allowed_callers": ["x"],
            },
            {"type": "shell", "environment": {"type": "container_auto"}},
        ],
    }
    async with gateway(limits={"max_tokens": 64, "max_prompt_tokens": 400}) as client:
        resp = await client.post("/v1/responses", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["warnings"] == [
        "tools[1]: shell runs in a hosted environment here, which this gateway does not run: it "
        "was left out of the prompt"
    ]


def test_every_item_a_conversation_holds_is_listed_in_openais_shape() -> None:
    """``GET /v1/responses/{id}/input_items``: each kind of item a stored conversation holds, as OpenAI's
    ItemResource."""
    items = [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {
            "id": "rs_1",
            "type": "reasoning",
            "content": [{"type": "reasoning_text", "text": "hm"}],
            "summary": [],
        },
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "ok"}],
        },
        {"id": "fc_1", "type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"id": "ctc_1", "type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": A_PATCH},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"},
        {
            "id": "lsh_1",
            "type": "local_shell_call",
            "call_id": "c3",
            "action": {"type": "exec", "command": ["ls"], "env": {}},
        },
        {"id": "lsh_1", "type": "local_shell_call_output", "call_id": "c3", "output": "a"},
        {
            "id": "sh_1",
            "type": "shell_call",
            "call_id": "c4",
            "action": {"commands": ["ls"], "timeout_ms": None, "max_output_length": None},
        },
        {
            "type": "shell_call_output",
            "call_id": "c4",
            "output": [{"stdout": "a", "stderr": "", "outcome": {"type": "exit", "exit_code": 0}}],
        },
        {
            "id": "apc_1",
            "type": "apply_patch_call",
            "call_id": "c5",
            "operation": {"type": "delete_file", "path": "a"},
        },
        {"type": "apply_patch_call_output", "call_id": "c5", "status": "completed"},
    ]
    page = item_page("resp_1", items, 100, "asc", None)
    check(page, "ResponseItemList")
    # a local shell call's output shares its call's id: listed apart
    assert len({item["id"] for item in page["data"]}) == len(items)
    for at in range(len(items) - 1):  # a cursor at each place goes on from there
        assert (
            item_page("resp_1", items, 3, "asc", page["data"][at]["id"])["data"]
            == page["data"][at + 1 : at + 4]
        )
