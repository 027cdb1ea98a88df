"""A Responses request as the chat request the engine runs (``to_chat``): the same prompt, the same tools and grammar,
so a Responses answer is the chat answer to the same conversation, token for token; and the chat path's errors
renamed to the Responses fields that caused them (``renamed``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from app.errors import ApiError
from app.responses_api.schemas import (
    HOSTED_TOOLS, PASSED_OVER_INCLUDES, FunctionCallItem, FunctionCallOutputItem, FunctionChoice, FunctionTool, MessageItem, NamespaceTool,
    OtherItem, OtherTool, ReasoningItem, ResponsesRequest, UnsupportedPart,
)
from app.schemas import ChatCompletionRequest


@dataclass
class Translated:
    """What a Responses request becomes."""

    chat: ChatCompletionRequest
    items: list[dict[str, Any]]  # the conversation before the answer, as input items (stored, for previous_response_id)
    tools: list[dict[str, Any]]  # the function tools the model was offered, as the response echoes them
    namespaces: dict[str, str] = field(default_factory=dict)  # a namespaced function's name → its namespace
    tool_paths: list[str] = field(default_factory=list)  # each offered tool's place in the request (tools.2.tools.0)
    warnings: list[str] = field(default_factory=list)


def to_chat(body: ResponsesRequest, previous: list[dict[str, Any]] | None) -> Translated:
    """``body`` (after the ``previous`` conversation's items, from the store) as a chat request; a 400 naming the field for
    anything it asks that this gateway does not do."""
    _check_supported(body)
    if body.input is None and previous is None:
        raise ApiError(400, "input is required (a string or a list of items)", "input")
    items = list(previous or []) + _input_items(body)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + _messages(items)
    if not messages:
        raise ApiError(400, "input holds no message to answer", "input")
    translated = Translated(ChatCompletionRequest.model_construct(), items, [])
    tools = _tools(body, translated)
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens, "seed": body.seed, "user": body.user,
        "temperature": 1.0 if body.temperature is None else body.temperature, "top_p": 1.0 if body.top_p is None else body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls is not False, "tools": tools or None, "tool_choice": _tool_choice(body, bool(tools)),
        "response_format": _response_format(body), "speculative": body.speculative.model_dump(exclude_none=True) if body.speculative else None,
    }
    try:
        translated.chat = ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:  # what the Responses schema let through and chat's refuses
        first = exc.errors()[0]
        raise ApiError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}", "input") from None
    return translated


def _check_supported(body: ResponsesRequest) -> None:
    extras = sorted(body.model_extra or {})
    if extras:
        raise ApiError(400, "; ".join(f"{name} is not supported" for name in extras), extras[0], "unsupported_parameter")
    refusals = [
        (body.background, "background", "background: true is not supported: a response runs while its request is open"),
        (body.truncation == "auto", "truncation", "truncation: auto is not supported: an input over the context is a 400 here (truncation: disabled)"),
        (body.top_logprobs, "top_logprobs", "top_logprobs is not supported on /v1/responses: /v1/chat/completions gives logprobs"),
        (body.stream_options is not None and not body.stream, "stream_options", "stream_options is only allowed with stream: true"),
    ]
    for refused, param, message in refusals:
        if refused:
            raise ApiError(400, message, param, "unsupported_parameter")
    for i, name in enumerate(body.include or []):
        if name not in PASSED_OVER_INCLUDES:
            raise ApiError(400, f"include: {name!r} is not supported", f"include.{i}", "unsupported_parameter")


def _input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """This request's input as items (a string is one user message); reasoning items left out, anything else refused by name."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    out = []
    for i, item in enumerate(body.input):
        if isinstance(item, OtherItem):
            hint = ": send the item itself" if item.type == "item_reference" else ""
            raise ApiError(400, f"input[{i}]: items of type {item.type!r} are not supported{hint}", f"input.{i}.type", "unsupported_parameter")
        if isinstance(item, ReasoningItem):
            continue  # an earlier answer's thinking: chat templates leave it out of later turns too
        if isinstance(item, MessageItem) and not isinstance(item.content, str):
            for j, part in enumerate(item.content):
                if isinstance(part, UnsupportedPart):
                    raise ApiError(400, f"input[{i}].content[{j}]: {part.type} is not supported: this gateway serves text models", f"input.{i}.content.{j}.type", "unsupported_parameter")
        out.append(item.model_dump(exclude_none=True))
    return out


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as chat messages: consecutive calls one assistant message, an output a tool message."""
    messages: list[dict[str, Any]] = []
    for raw in items:
        kind = raw.get("type", "message")
        if kind == "function_call":
            call = FunctionCallItem.model_validate(raw)
            entry = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(entry)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [entry]})
        elif kind == "function_call_output":
            output = FunctionCallOutputItem.model_validate(raw)
            messages.append({"role": "tool", "tool_call_id": output.call_id, "content": output.text()})
        else:
            message = MessageItem.model_validate(raw)
            messages.append({"role": message.role, "content": message.text()})
    return messages


def _tools(body: ResponsesRequest, into: Translated) -> list[dict[str, Any]]:
    """The function tools, namespaces flattened to their functions; hosted tools left out, with a warning."""
    tools: list[dict[str, Any]] = []

    def offer(tool: FunctionTool, path: str, namespace: str | None) -> None:
        function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters, "strict": tool.strict}
        tools.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
        into.tools.append({"type": "function", "name": tool.name, "description": tool.description, "parameters": tool.parameters, "strict": tool.strict})
        into.tool_paths.append(path)
        if namespace is not None:
            into.namespaces[tool.name] = namespace

    for i, tool in enumerate(body.tools or []):
        if isinstance(tool, FunctionTool):
            offer(tool, f"tools.{i}", None)
        elif isinstance(tool, NamespaceTool):
            for j, inner in enumerate(tool.tools):
                offer(inner, f"tools.{i}.tools.{j}", tool.name)
        elif isinstance(tool, OtherTool) and tool.type in HOSTED_TOOLS:
            into.warnings.append(f"tools[{i}]: {tool.type} is a hosted tool, which this gateway does not run: it was left out of the prompt")
        elif isinstance(tool, OtherTool) and tool.type == "custom":
            raise ApiError(400, f"tools[{i}]: custom tools (free-form input) are not supported: give a function tool", f"tools.{i}.type", "unsupported_parameter")
        else:
            raise ApiError(400, f"tools[{i}]: tools of type {tool.type!r} are not supported", f"tools.{i}.type", "unsupported_parameter")
    return tools


def _tool_choice(body: ResponsesRequest, has_tools: bool) -> Any:
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, dict):
        kind = choice.get("type")
        why = "this gateway runs no hosted tool" if kind in HOSTED_TOOLS else f"a choice of type {kind!r} is not supported"
        raise ApiError(400, f"tool_choice: {why}: use none, auto, required or {{\"type\": \"function\", \"name\": …}}", "tool_choice", "unsupported_parameter")
    if choice == "auto" and not has_tools:
        return None  # hosted tools alone (left out): nothing to choose from
    return choice


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name, "description": fmt.description, "schema": fmt.json_schema, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


_MESSAGES = re.compile(r"^messages(\.\d+.*)?$")


def renamed(exc: ApiError, translated: Translated) -> ApiError:
    """A chat-path error with the Responses field that caused it as its param (and in its message)."""
    param = exc.param or ""
    message = exc.message.replace("max_completion_tokens", "max_output_tokens").replace("response_format.json_schema", "text.format.schema")
    message = message.replace("response_format", "text.format")
    tool = re.match(r"^tools\.(\d+)\.function(\..*)?$", param)
    if _MESSAGES.match(param):
        param, message = "input", message.replace(f"{exc.param}: ", "").replace("messages", "input")
    elif param in ("max_completion_tokens", "max_tokens"):
        param = "max_output_tokens"
    elif param.startswith("response_format"):
        param = "text.format.schema" if param == "response_format.json_schema" else "text.format"
    elif tool and int(tool.group(1)) < len(translated.tool_paths):
        param = translated.tool_paths[int(tool.group(1))] + (tool.group(2) or "")
        message = message.replace(exc.param or "", param)
    return ApiError(exc.status, message, param or None, exc.code, exc.kind)
