"""Tool calls in the model's own format, free of I/O (docs/tools.md): which format a chat template was trained on
(``detect``), the conversation as that template takes it (``template_messages``), the lazy grammar that leaves text free
until the format's trigger and then holds the call to the tool's parameters (``native_grammar``), and the reader that
turns the answer, as generated, into OpenAI's deltas (``NativeToolOutput``). The generic format (app.tools) is the fallback."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from app.tools import _INVALID, Tool, ToolOutput, _arguments, _loads, _merged, partial
from core.grammar import strict


class ToolFormat(StrEnum):
    GENERIC = "generic"  # app.tools: a system message and one JSON object (what the built-in model gets)
    HERMES = "hermes"  # Hermes 2 Pro, Qwen2.5: <tool_call>\n{"name": …, "arguments": …}\n</tool_call>
    LLAMA3_JSON = "llama3_json"  # Llama 3.1 / 3.2 / 3.3: {"name": …, "parameters": …} as the whole answer
    MISTRAL = "mistral"  # Mistral v0.3, Nemo: [TOOL_CALLS] [{"name": …, "arguments": …}, …]


@dataclass(frozen=True)
class CallStyle:
    """How a format writes its calls: ``trigger`` starts them (empty: the answer itself, starting with ``{``); then one of
    ``after_trigger``; each call ``{"name": …, "<args_key>": …}``; ``separator`` between calls, ``end`` after the last."""

    trigger: str
    after_trigger: tuple[str, ...]
    args_key: str
    separator: str | None  # None: one call an answer
    end: str


STYLES = {
    ToolFormat.HERMES: CallStyle("<tool_call>", ("\n",), "arguments", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>"),
    ToolFormat.LLAMA3_JSON: CallStyle("", ("",), "parameters", None, ""),
    ToolFormat.MISTRAL: CallStyle("[TOOL_CALLS]", (" [", "["), "arguments", ", ", "]"),
}
# the JSON as the templates render it (transformers' tojson: json.dumps's separators), compact otherwise
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def detect(template: str | None) -> ToolFormat:
    """The format a chat template renders tool calls in, by its signature strings (as llama.cpp tells them apart); a
    template that takes no ``tools`` gets the generic format."""
    if not template or "tools" not in template:
        return ToolFormat.GENERIC
    if "<tool_call>" in template:
        return ToolFormat.HERMES
    if "<|python_tag|>" in template or "<|start_header_id|>ipython<|end_header_id|>" in template:
        return ToolFormat.LLAMA3_JSON
    if "[TOOL_CALLS]" in template:
        return ToolFormat.MISTRAL
    return ToolFormat.GENERIC


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """``tools`` as chat templates take them (OpenAI's shape)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}} for t in tools]


def template_messages(messages: list[dict[str, Any]], fmt: ToolFormat) -> list[dict[str, Any]]:
    """The conversation as a tool-calling template takes it: a call's arguments as the object they hold, a result with its
    call's name; for Mistral, call ids of nine letters and digits (its templates refuse others)."""
    names: dict[str, str] = {}

    def call_id(given: str) -> str:
        return hashlib.sha256(given.encode()).hexdigest()[:9] if fmt is ToolFormat.MISTRAL else given

    out = []
    for m in messages:
        message = dict(m)
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                names[call["id"]] = call["function"]["name"]
                function = {"name": call["function"]["name"], "arguments": _arguments(call["function"]["arguments"])}
                calls.append({"id": call_id(call["id"]), "type": "function", "function": function})
            message["tool_calls"] = calls
        elif m["role"] == "tool":
            message["tool_call_id"] = call_id(m["tool_call_id"])
            message["name"] = names.get(m["tool_call_id"], "")
        out.append(message)
    return out


def native_grammar(fmt: ToolFormat, tools: list[Tool], required: bool, parallel: bool) -> str:
    """A Lark grammar (llguidance) for an answer in ``fmt``: free text until the trigger, then calls that follow their tool's
    parameters and the closing marker; with ``required`` (tool_choice required or named), calls from the first token."""
    style = STYLES[fmt]
    schemas = [strict({
        "type": "object", "properties": {"name": {"const": t.name}, style.args_key: t.parameters},
        "required": ["name", style.args_key], "additionalProperties": False,
    }) for t in tools]
    call = {"anyOf": schemas} if len(schemas) > 1 else schemas[0]
    calls = f"call ({_literal(style.separator)} call)*" if parallel and style.separator is not None else "call"
    after = " | ".join(_literal(a) for a in style.after_trigger)
    body = f"({after}) {calls}" + (f" {_literal(style.end)}" if style.end else "")
    rules = [f"call: %json {json.dumps({**call, 'x-guidance': JSON_STYLE})}"]
    if not style.trigger:  # the call is the whole answer; free text may not start as one
        start = "start: call" if required else "start: FREE | call"
        rules.append(r"FREE: /(?s:.*)/ & ~/\{(?s:.*)/")
    elif required:
        start = f"start: {_literal(style.trigger)} {body}"
    else:
        trigger = re.escape(style.trigger).replace("/", "\\/")  # a slash would end the Lark regex
        start = f"start: FREE | prefix {body}"
        rules += [f"FREE: /(?s:.*)/ & ~/(?s:.*){trigger}(?s:.*)/", f"prefix[lazy]: /(?s:.*){trigger}/"]
    return "\n".join([start, *rules]) + "\n"


def _literal(text: str) -> str:
    return json.dumps(text)


@dataclass
class NativeToolOutput(ToolOutput):
    """Reads an answer in a native format as it arrives into OpenAI deltas: free text as content, a possible trigger held
    back until it is one (never streamed as text), then each call's name and its arguments as they come."""

    style: CallStyle = field(default_factory=lambda: STYLES[ToolFormat.HERMES])

    def __post_init__(self) -> None:
        self._name_open = '{"name": "'
        self._args_open = f'", "{self.style.args_key}": '

    def push(self, text: str) -> list[dict[str, Any]]:
        """As ``ToolOutput.push``, going on while a step moves on in the text or in its state."""
        self._buffer += text
        deltas: list[dict[str, Any]] = []
        while self._at < len(self._buffer):
            before = (self._at, self._state)
            delta = self._step()
            if delta:
                deltas.append(delta)
            if (self._at, self._state) == before:
                break  # waits for more text
        return _merged(deltas)

    @property
    def is_complete(self) -> bool:
        if self._state == "between" and self._buffer[self._at :] == "}" + self.style.end:
            return all(_loads(call.arguments) is not _INVALID for call in self.calls)
        return self._state == "done" and all(_loads(call.arguments) is not _INVALID for call in self.calls)

    def _step(self) -> dict[str, Any] | None:
        rest = self._buffer[self._at :]
        if self._state == "arguments":
            return self._raw_value(rest, into_content=False)
        if self._state in ("start", "text"):
            return self._free(rest)
        if self._state == "after":
            return self._after(rest)
        if self._state == "call":
            return self._call(rest)
        if self._state == "between":
            return self._between(rest)
        return self._give_up()  # done or raw: anything more is text (the grammar allows none)

    def _free(self, rest: str) -> dict[str, Any] | None:
        trigger = self.style.trigger
        if not trigger:  # the answer is a call when it starts with "{", else text to its end
            if self._state == "start" and rest.startswith("{"):
                self._state = "call"
                return self._call(rest)
            self._state = "text"
            return self._content(len(rest))
        at = rest.find(trigger)
        if at >= 0:
            delta = self._content(at)
            self._state = "after"  # the trigger stays unread until what follows it is seen
            return delta
        held = partial(rest, trigger)
        return self._content(len(rest) - held)

    def _content(self, size: int) -> dict[str, Any] | None:
        piece = self._buffer[self._at : self._at + size]
        self._at += size
        self.content += piece
        return {"content": piece} if piece else None

    def _after(self, rest: str) -> dict[str, Any] | None:
        """The trigger and what must follow it (a newline, an opening bracket); not a call after all: text, trigger included."""
        options = [self.style.trigger + option for option in self.style.after_trigger]
        for option in sorted(options, key=len, reverse=True):
            if rest.startswith(option):
                self._at += len(option)
                self._state = "call"
                return None
        return None if any(option.startswith(rest) for option in options) else self._give_up()

    def _between(self, rest: str) -> dict[str, Any] | None:
        """After a call's arguments: "}" and the separator to the next call, or "}" and the end."""
        separator = None if self.style.separator is None else "}" + self.style.separator
        end = "}" + self.style.end
        if separator is not None and rest.startswith(separator):
            self._at, self._state = self._at + len(separator), "call"
        elif rest.startswith(end) and (separator is None or not separator.startswith(rest)):
            self._at, self._state = self._at + len(end), "done"
        elif not (end.startswith(rest) or (separator is not None and separator.startswith(rest))):
            return self._give_up()
        return None

    def flush(self, cut: bool = False) -> list[dict[str, Any]]:
        rest = self._buffer[self._at :]
        if self._state == "between" and rest == "}" + self.style.end:  # the end, which could have been a separator's start
            self._at, self._state = len(self._buffer), "done"
            return []
        if self._state in ("start", "text"):  # a held-back piece that never became the trigger: text after all
            delta = self._content(len(rest))
            return [delta] if delta else []
        if cut and self._state in ("after", "call", "arguments", "between"):  # a call cut by max_tokens: never text (ToolOutput.flush)
            self._at = len(self._buffer)
            return []
        return super().flush(cut)

