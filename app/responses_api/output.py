"""The Responses API's objects and stream events, built from the chat path's deltas (``ResponseBuilder``): one
builder makes the stream's events and the whole response alike, so a streamed answer and a whole one cannot
differ."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from app.errors import ApiError
from app.requests import Job
from app.responses_api.client_tools import INPUT, ITEM_PREFIX, Offer, call_item
from app.responses_api.request import Translated
from app.responses_api.schemas import ResponsesRequest

# sent as null; other fields are left out when unset
_NULLABLE = frozenset({"error", "incomplete_details", "instructions"})
# the codes a failed response's error may carry (else server_error)
_FAILED_CODES = {429: "rate_limit_exceeded", 400: "invalid_prompt"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """One response: ``start()`` → ``push(deltas)`` … → ``finish(reason)`` (or ``fail(error)``), each the
    stream events it makes; ``response()`` the object as it stands. ``deltas`` are the chat path's
    (``{"content"}``, ``{"tool_calls"}``)."""

    def __init__(self, body: ResponsesRequest, translated: Translated, job: Job, store: bool) -> None:
        self.body, self.translated, self.job, self.store = body, translated, job, store
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.status = "in_progress"
        self.output: list[dict[str, Any]] = []
        self.error: dict[str, str] | None = None
        self.incomplete: dict[str, str] | None = None
        self.completed_at: int | None = None
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the item being written
        self._calls: dict[int, _Call] = {}  # a call's index in the chat deltas → its call

    def response(self) -> dict[str, Any]:
        body, job = self.body, self.job
        fmt = (
            body.text.format.model_dump(by_alias=True, exclude_none=True)
            if body.text is not None and body.text.format is not None
            else {"type": "text"}
        )
        usage = job.usage
        out: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "completed_at": self.completed_at,
            "error": self.error,
            "incomplete_details": self.incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": job.model,
            "output": self.output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": self.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": fmt},
            "tool_choice": _echo_choice(body.tool_choice),
            "tools": self.translated.tools,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "user": body.user,
            "metadata": body.metadata or {},
            "usage": None
            if self.status == "in_progress"
            else {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens or 0},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                "speculative": usage.to_dict()["speculative"],
            },
        }
        out = {k: v for k, v in out.items() if v is not None or k in _NULLABLE}
        if self.translated.warnings:
            # what was left out (hosted tools): also in the gateway's log
            out["warnings"] = self.translated.warnings
        return out

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def push(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                events += self._text(delta["content"])
            for piece in delta.get("tool_calls", []):
                events += self._call(piece)
        return events

    def finish(self, reason: str | None) -> list[dict[str, Any]]:
        """The last events: what is open closed, then ``response.completed`` (or ``.incomplete`` at
        max_output_tokens)."""
        cut = reason == "length"
        answered = (
            any(item["type"] != "reasoning" for item in self.output)
            or (cut and self.output)
            or (self._open is not None and self._open not in self.output)
        )
        # an answer with nothing in it is still a message (reasoning cut short is not one)
        events = [] if answered else self._text("")
        events += self._close("incomplete" if cut else "completed")
        self.status = "incomplete" if cut else "completed"
        if cut:
            self.incomplete = {"reason": "max_output_tokens"}
        else:
            self.completed_at = int(time.time())
        return events + [self._event(f"response.{self.status}", response=self.response())]

    def fail(self, error: ApiError) -> list[dict[str, Any]]:
        """An error mid-way: the ``error`` event, then ``response.failed`` with the error in it."""
        events = self._close("incomplete")
        events.append(self._event("error", code=error.code, message=error.message, param=error.param))
        self.status = "failed"
        self.error = {"code": _FAILED_CODES.get(error.status, "server_error"), "message": error.message}
        return events + [self._event("response.failed", response=self.response())]

    def conversation(self) -> list[dict[str, Any]]:
        """The conversation this response ends, as input items: what a request naming it as
        ``previous_response_id`` continues."""
        return self.translated.items + self.output_items()

    def output_items(self) -> list[dict[str, Any]]:
        """The output as the input items that send it back (what the store keeps of it)."""
        return [as_input(item) for item in self.output]

    def _text(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self._open
        if item is None or item["type"] != "message":
            events += self._close("completed")
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {
                "id": new_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            events += self._add(item)
            item["content"].append(part)
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self._index,
                    content_index=0,
                    part=dict(part),
                )
            )
        if text:
            item["content"][0]["text"] += text
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=self._index,
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
            )
        return events

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        """A thinking template's reasoning: a ``reasoning`` item, its text as ``reasoning_text``
        (app.reasoning)."""
        events: list[dict[str, Any]] = []
        item = self._open
        if item is None or item["type"] != "reasoning":
            events += self._close("completed")
            item = {
                "id": new_id("rs"),
                "type": "reasoning",
                "status": "in_progress",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
            }
            events += self._add(item)
        item["content"][0]["text"] += text
        return events + [
            self._event(
                "response.reasoning_text.delta",
                item_id=item["id"],
                output_index=self._index,
                content_index=0,
                delta=text,
            )
        ]

    def _call(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        """A call's deltas as its item: a function's arguments as they come; a freeform or a client-run tool's
        item whole once its arguments are (a client runs what a done item holds: a freeform input cut short is
        often a valid one, and a client-run tool's action is made of the arguments), or never, when they are
        cut."""
        events: list[dict[str, Any]] = []
        function = piece.get("function", {})
        if "id" in piece:  # a new call
            events += self._close("completed")
            offered = function.get("name", "")
            offer = self.translated.offers.get(offered, Offer("function", offered))
            item: dict[str, Any] = {
                "id": new_id(ITEM_PREFIX[offer.kind]),
                "type": "function_call",
                "status": "in_progress",
                "call_id": piece["id"],
            }
            if offer.kind == "custom":
                item.update(type="custom_tool_call", name=offer.name, input="")
            elif offer.kind == "function":
                item.update(name=offer.name, arguments="")
            if offer.namespace is not None:
                item["namespace"] = offer.namespace
            self._calls[piece["index"]] = _Call(item, offer)
            if offer.kind == "function":
                events += self._add(item)
            else:
                self._open = item  # added whole, when its arguments are
        call = self._calls[piece["index"]]
        arguments = function.get("arguments", "")
        if not arguments:
            return events
        call.arguments += arguments
        index = self.output.index(call.item) if call.item in self.output else None
        if call.offer.kind == "function":
            call.item["arguments"] += arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=call.item["id"],
                    output_index=index,
                    delta=arguments,
                )
            )
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=self._index, item=_copy(item))]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        self._open = None
        call = next((c for c in self._calls.values() if c.item is item), None)
        if call is not None and call.offer.kind != "function":
            # a freeform or client-run tool's call: its item, whole
            whole = call.whole_input() if call.offer.kind == "custom" else ""
            if status != "completed" or whole is None:
                return []  # cut short (or not a call at all): never shown, so dropped (a client would run it)
            if call.offer.kind == "custom":
                item["input"] = whole
            else:
                item = call.item = call_item(call.offer, item["id"], item["call_id"], call.arguments, status)
            self.output.append(item)
            index = len(self.output) - 1
            events = [
                self._event(
                    "response.output_item.added",
                    output_index=index,
                    item={
                        **_copy(item),
                        "status": "in_progress",
                        **({"input": ""} if "input" in item else {}),
                    },
                )
            ]
            if call.offer.kind == "custom":
                events += [
                    self._event(
                        "response.custom_tool_call_input.delta",
                        item_id=item["id"],
                        output_index=index,
                        delta=item["input"],
                    ),
                    self._event(
                        "response.custom_tool_call_input.done",
                        item_id=item["id"],
                        output_index=index,
                        input=item["input"],
                    ),
                ]
            item["status"] = status
            return events + [self._event("response.output_item.done", output_index=index, item=_copy(item))]
        item["status"] = status
        index = self.output.index(item)
        events = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(
                self._event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                )
            )
        elif item["type"] == "message":
            part = item["content"][0]
            events.append(
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            events.append(
                self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=dict(part),
                )
            )
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        return events + [self._event("response.output_item.done", output_index=index, item=_copy(item))]

    @property
    def _index(self) -> int:
        return len(self.output) - 1

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": [dict(p) for p in item["content"]]} if "content" in item else dict(item)


def as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the input item that sends it back."""
    if item["type"] == "message":
        return {
            "id": item["id"],
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": p["text"]} for p in item["content"]],
        }
    if item["type"] == "reasoning":
        return {"id": item["id"], "type": "reasoning", "content": item["content"], "summary": []}
    return {k: v for k, v in item.items() if k != "status"}


class _Call:
    """A call being written: its item, the tool it stands for, and its arguments as generated (JSON)."""

    def __init__(self, item: dict[str, Any], offer: Offer) -> None:
        self.item, self.offer = item, offer
        self.arguments = ""

    def whole_input(self) -> str | None:
        """A freeform call's input: the string its finished arguments hold (None where they hold none)."""
        try:
            value = json.loads(self.arguments).get(INPUT)
        except (ValueError, AttributeError):
            return None
        return value if isinstance(value, str) else None


def _echo_choice(choice: Any) -> Any:
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str | dict) else choice.model_dump()


def item_page(
    response_id: str, items: list[dict[str, Any]], limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: a page of ``items`` (OpenAI's list shape); an item stored
    without an id gets one made of the response's id and its place, the same at every call."""
    named, seen = [], set()
    for i, item in enumerate(items):
        # every listed id its own (a local shell call's output shares its call's): a cursor finds one place
        listed = item.get("id") or f"item_{response_id.removeprefix('resp_')}_{i}"
        listed = listed if listed not in seen else f"{listed}_{i}"
        seen.add(listed)
        named.append(_resource({**item, "id": listed}))
    ordered = named if order == "asc" else named[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(ordered) if item["id"] == after), None)
        if at is None:
            raise ApiError(400, f"after: no item {after!r} in this response's input", "after")
        ordered = ordered[at + 1 :]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }


def _resource(item: dict[str, Any]) -> dict[str, Any]:
    """A stored input item as the API lists it: a message's content as parts (an assistant's as output text),
    and the fields its type's resource requires (``status``, a shell output's ``max_output_length``)."""
    kind = item.get("type", "message")
    out = {**item, "type": kind}
    if kind == "message":
        content = item.get("content")
        parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else list(content or [])
        if item.get("role") == "assistant":
            parts = [
                {
                    "type": "output_text",
                    "text": p.get("text", p.get("refusal", "")),
                    "annotations": [],
                    "logprobs": [],
                }
                for p in parts
            ]
        out["content"] = parts
    if kind == "reasoning":
        out.setdefault("summary", [])
    elif kind != "local_shell_call_output":
        out.setdefault("status", "completed")
    if kind == "shell_call_output":
        out.setdefault("max_output_length", None)
    if kind == "shell_call":
        out.setdefault("environment", None)
    return out
