"""A Responses request as the chat request the engine runs (``to_chat``): the same prompt, the same tools and
grammar, so a Responses answer is the chat answer to the same conversation, token for token; and the chat
path's errors renamed to the Responses fields that caused them (``renamed``)."""

from __future__ import annotations

import difflib
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from app.errors import ApiError
from app.responses_api.client_tools import (
    INPUT,
    Offer,
    as_call,
    client_function,
    custom_function,
    output_text,
    qualified,
)
from app.responses_api.schemas import (
    CLIENT_TOOLS,
    HOSTED_TOOLS,
    PASSED_OVER_INCLUDES,
    ClientCallItem,
    CustomTool,
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionTool,
    MessageItem,
    NamespaceTool,
    OtherItem,
    OtherTool,
    ReasoningItem,
    ResponsesRequest,
    UnsupportedPart,
)
from app.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("specgate.responses")
_PASSED_OVER_SEEN: set[str] = set()  # unknown fields already logged (once each)


@dataclass
class Translated:
    """What a Responses request becomes."""

    chat: ChatCompletionRequest
    items: list[dict[str, Any]]  # the conversation before the answer, as input items
    tools: list[dict[str, Any]]  # the tools the model was offered, as the response echoes them
    # what this request's input added to it (stored, for previous_response_id)
    new_items: list[dict[str, Any]] = field(default_factory=list)
    # each function the model was offered → the tool it stands for
    offers: dict[str, Offer] = field(default_factory=dict)
    # each offered tool's place in the request (tools.2.tools.0)
    tool_paths: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def to_chat(body: ResponsesRequest, previous: list[dict[str, Any]] | None) -> Translated:
    """``body`` (after the ``previous`` conversation's items, from the store) as a chat request; a 400 naming
    the field for anything it asks that this gateway does not do."""
    _check_supported(body)
    if body.input is None and previous is None:
        raise ApiError(400, "input is required (a string or a list of items)", "input")
    new_items = _input_items(body)
    items = list(previous or []) + new_items
    translated = Translated(ChatCompletionRequest.model_construct(), items, [], new_items)
    tools = _tools(body, translated)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + _messages(
        items, translated.offers
    )
    if not any(m["role"] != "system" for m in messages):
        raise ApiError(400, "input holds no message to answer", "input")
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "seed": body.seed,
        "user": body.user,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tools": tools or None,
        "tool_choice": _tool_choice(body, translated.offers),
        "response_format": _response_format(body),
        "speculative": body.speculative.model_dump(exclude_none=True) if body.speculative else None,
    }
    try:
        translated.chat = ChatCompletionRequest.model_validate(
            {k: v for k, v in chat.items() if v is not None}
        )
    except ValidationError as exc:  # what the Responses schema let through and chat's refuses
        first = exc.errors()[0]
        raise ApiError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}", "input") from None
    return translated


def _check_supported(body: ResponsesRequest) -> None:
    """Fields this gateway does not know are passed over (the spec's next hints must not break clients),
    except a near miss of a field it knows (a 400 naming the field meant); known fields that would change the
    answer and are not served: a 400."""
    for name in sorted(body.model_extra or {}):
        if name in ANSWER_FIELDS:
            use = f"use {_CHAT_FIELDS[name]}" if name in _CHAT_FIELDS else "/v1/chat/completions takes it"
            raise ApiError(
                400,
                f"{name} is not a field of /v1/responses and would change the answer: {use}",
                name,
                "unsupported_parameter",
            )
        meant = difflib.get_close_matches(name, KNOWN_FIELDS, n=1, cutoff=0.85)
        if meant:
            raise ApiError(
                400,
                f"{name} is not a field of this API: did you mean {meant[0]}?",
                name,
                "unsupported_parameter",
            )
        if name not in _PASSED_OVER_SEEN:
            _PASSED_OVER_SEEN.add(name)
            log.info("response: the field %s is not known here and is passed over", name)
    refusals = [
        (
            body.background,
            "background",
            "background: true is not supported: a response runs while its request is open",
        ),
        (
            body.truncation == "auto",
            "truncation",
            "truncation: auto is not supported: an input over the context is a 400 here "
            "(truncation: disabled)",
        ),
        (
            body.top_logprobs,
            "top_logprobs",
            "top_logprobs is not supported on /v1/responses: /v1/chat/completions gives logprobs",
        ),
        (
            body.stream_options is not None and not body.stream,
            "stream_options",
            "stream_options is only allowed with stream: true",
        ),
    ]
    for refused, param, message in refusals:
        if refused:
            raise ApiError(400, message, param, "unsupported_parameter")
    for i, name in enumerate(body.include or []):
        if name not in PASSED_OVER_INCLUDES:
            raise ApiError(
                400, f"include: {name!r} is not supported", f"include.{i}", "unsupported_parameter"
            )


def _input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """This request's input as items (a string is one user message); a type this gateway does not read refused
    by name."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    out = []
    for i, item in enumerate(body.input):
        if isinstance(item, OtherItem):
            hint = ": send the item itself" if item.type == "item_reference" else ""
            raise ApiError(
                400,
                f"input[{i}]: items of type {item.type!r} are not supported{hint}",
                f"input.{i}.type",
                "unsupported_parameter",
            )
        parts, field_name = (
            (item.content, "content")
            if isinstance(item, MessageItem)
            else (getattr(item, "output", None), "output")
        )
        if isinstance(parts, list):
            for j, part in enumerate(parts):
                if isinstance(part, UnsupportedPart):
                    raise ApiError(
                        400,
                        f"input[{i}].{field_name}[{j}]: {part.type} is not supported: this "
                        "gateway serves text models",
                        f"input.{i}.{field_name}.{j}.type",
                        "unsupported_parameter",
                    )
        if isinstance(item, ClientCallItem) and not (item.call_id or item.id):
            raise ApiError(400, f"input[{i}]: a {item.type} item needs its call_id", f"input.{i}.call_id")
        out.append(item.model_dump(exclude_none=True))
    return out


def _messages(items: list[dict[str, Any]], offers: dict[str, Offer]) -> list[dict[str, Any]]:
    """Items as chat messages. An assistant's text and the calls after it are one turn (as the model wrote
    them); a reasoning item goes with the assistant turn after it (``reasoning_content``: the template renders
    it where it renders thinking); every call by the name it was offered under; an output a tool message."""
    names = {(o.namespace, o.name, o.kind): name for name, o in offers.items()}
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []

    def assistant(content: str | None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = "\n\n".join(reasoning)
            reasoning.clear()
        messages.append(message)
        return message

    def call(call_id: str, name: str, arguments: str) -> None:
        last = messages[-1] if messages else None
        turn = last if last is not None and last["role"] == "assistant" and not reasoning else assistant(None)
        turn.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        )

    for raw in items:
        kind = raw.get("type", "message")
        if kind == "reasoning":
            text = ReasoningItem.model_validate(raw).text()
            if text:
                reasoning.append(text)
        elif kind == "function_call":
            fc = FunctionCallItem.model_validate(raw)
            call(
                fc.call_id,
                names.get((fc.namespace, fc.name, "function"), qualified(fc.namespace, fc.name)),
                fc.arguments,
            )
        elif kind == "custom_tool_call":
            cc = CustomToolCallItem.model_validate(raw)
            name = names.get((cc.namespace, cc.name, "custom"), qualified(cc.namespace, cc.name))
            call(cc.call_id, name, json.dumps({INPUT: cc.input}, ensure_ascii=False, separators=(",", ":")))
        elif kind == "function_call_output":
            output = FunctionCallOutputItem.model_validate(raw)
            messages.append({"role": "tool", "tool_call_id": output.call_id, "content": output.text()})
        elif kind == "custom_tool_call_output":
            custom = CustomToolCallOutputItem.model_validate(raw)
            messages.append({"role": "tool", "tool_call_id": custom.call_id, "content": custom.text()})
        elif kind.endswith("_call"):  # a client-run tool's call
            found = as_call(raw)
            if found is not None:
                call(*found)
        elif kind.endswith("_call_output"):
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": raw.get("call_id") or raw.get("id", ""),
                    "content": output_text(raw),
                }
            )
        else:
            message = MessageItem.model_validate(raw)
            if message.role == "assistant":
                assistant(message.text())
            else:
                # thinking no assistant turn followed (a cut turn): not carried into the next one
                reasoning.clear()
                messages.append({"role": message.role, "content": message.text()})
    return messages


def _tools(body: ResponsesRequest, into: Translated) -> list[dict[str, Any]]:
    """The tools as chat's function tools: functions as they are, freeform and client-run tools as functions
    (app.responses_api.client_tools), namespaces' tools by qualified names; hosted tools left out, with a
    warning."""
    tools: list[dict[str, Any]] = []

    def offer(
        function: dict[str, Any], path: str, kind: str, name: str, namespace: str | None, echo: dict[str, Any]
    ) -> None:
        offered = qualified(namespace, function["name"])
        if offered in into.offers:
            raise ApiError(400, f"{path}: two tools are offered as {offered!r}: give each its own name", path)
        tools.append(
            {
                "type": "function",
                "function": {**{k: v for k, v in function.items() if v is not None}, "name": offered},
            }
        )
        into.tools.append(echo)
        into.tool_paths.append(path)
        into.offers[offered] = Offer(kind, name, namespace)

    def one(tool: FunctionTool | CustomTool, path: str, namespace: str | None) -> None:
        echo = tool.model_dump(exclude_none=True, exclude={"defer_loading"}, by_alias=True)
        if isinstance(tool, CustomTool):
            offer(
                custom_function(tool.name, tool.description, tool.format, path),
                path,
                "custom",
                tool.name,
                namespace,
                echo,
            )
        else:
            function = {
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.parameters,
                "strict": tool.strict,
            }
            offer(
                function,
                path,
                "function",
                tool.name,
                namespace,
                {"type": "function", **{k: v for k, v in function.items() if k != "type"}},
            )

    for i, tool in enumerate(body.tools or []):
        if isinstance(tool, FunctionTool | CustomTool):
            one(tool, f"tools.{i}", None)
        elif isinstance(tool, NamespaceTool):
            for j, inner in enumerate(tool.tools):
                one(inner, f"tools.{i}.tools.{j}", tool.name)
        elif tool.type in CLIENT_TOOLS and _runs_here(tool):
            offer(
                client_function(tool.type),
                f"tools.{i}",
                tool.type,
                tool.type,
                None,
                {"type": tool.type, **(tool.model_extra or {})},
            )
        elif tool.type in CLIENT_TOOLS:  # a shell in OpenAI's container: hosted
            into.warnings.append(
                f"tools[{i}]: {tool.type} runs in a hosted environment here, which this gateway "
                "does not run: it was left out of the prompt"
            )
        elif tool.type in HOSTED_TOOLS:
            into.warnings.append(
                f"tools[{i}]: {tool.type} is a hosted tool, which this gateway does not run: it "
                "was left out of the prompt"
            )
        elif tool.type == "tool_search":
            raise ApiError(
                400,
                f"tools[{i}]: tool_search is not supported: this gateway offers every tool in "
                "the prompt (send them without defer_loading)",
                f"tools.{i}.type",
                "unsupported_parameter",
            )
        else:
            raise ApiError(
                400,
                f"tools[{i}]: tools of type {tool.type!r} are not supported",
                f"tools.{i}.type",
                "unsupported_parameter",
            )
    return tools


def _runs_here(tool: OtherTool) -> bool:
    """A client-run tool the client runs: a shell whose environment is not OpenAI's container (none, or
    local)."""
    environment = (tool.model_extra or {}).get("environment")
    return not isinstance(environment, dict) or environment.get("type") in (None, "local")


def _tool_choice(body: ResponsesRequest, offers: dict[str, Offer]) -> Any:
    choice = body.tool_choice
    kind, name, namespace = (
        (choice.type, choice.name, choice.namespace)
        if isinstance(choice, FunctionChoice)
        else (None, None, None)
    )
    if isinstance(choice, dict):
        kind, name, namespace = choice.get("type"), choice.get("name"), choice.get("namespace")
        if kind in CLIENT_TOOLS:
            name = kind
        elif kind != "custom":
            why = (
                "this gateway runs no hosted tool"
                if kind in HOSTED_TOOLS
                else f"a choice of type {kind!r} is not supported"
            )
            raise ApiError(
                400,
                f"tool_choice: {why}: use none, auto, required, or a function, custom or client tool by name",
                "tool_choice",
                "unsupported_parameter",
            )
    if kind is not None:
        wanted = "function" if kind == "function" else "custom" if kind == "custom" else kind
        named = [
            n
            for n, o in offers.items()
            if o.name == name and o.kind == wanted and (namespace is None or o.namespace == namespace)
        ]
        if len(named) > 1:
            raise ApiError(
                400, f"tool_choice: {name!r} is in several namespaces: give its namespace", "tool_choice"
            )
        offered = named[0] if named else name
        return {"type": "function", "function": {"name": offered}}
    if choice == "auto" and not offers:
        return None  # hosted tools alone (left out): nothing to choose from
    return choice


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {
        "name": fmt.name,
        "description": fmt.description,
        "schema": fmt.json_schema,
        "strict": fmt.strict,
    }
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


KNOWN_FIELDS = tuple(ResponsesRequest.model_fields)
_CHAT_FIELDS = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}
# chat's and completions' own fields, and the Responses API's that are not served here: each would change the
# answer
ANSWER_FIELDS = frozenset(
    (
        set(ChatCompletionRequest.model_fields)
        | set(CompletionRequest.model_fields)
        | {"prompt", "conversation", "functions", "function_call", "repetition_penalty"}
    )
    - set(ResponsesRequest.model_fields)
)
_MESSAGES = re.compile(r"^messages(\.\d+.*)?$")


def renamed(exc: ApiError, translated: Translated) -> ApiError:
    """A chat-path error with the Responses field that caused it as its param (and in its message)."""
    param = exc.param or ""
    message = exc.message.replace("max_completion_tokens", "max_output_tokens").replace(
        "response_format.json_schema", "text.format.schema"
    )
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
