"""Tool calls in the generic format (DESIGN §3.9, llama.cpp's anchor), free of I/O.

The model answers with one JSON object, constrained by a grammar: either the calls,
``{"tool_calls":[{"name":…,"arguments":{…}},…]}``, or a text answer, ``{"response":"…"}``
(``tool_choice: required`` or a named function allow only the calls; ``none`` drops the grammar).
The tools and that schema are described in a system message; earlier calls and tool results
in the conversation are rendered in the same format. ``ToolOutput`` reads the answer as it is
generated and turns it into OpenAI's shapes: ``content`` deltas for a response, and per call a
first ``delta.tool_calls`` piece with ``index``, ``id``, ``type`` and the name, then pieces of
``arguments`` (DESIGN §5).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from core.grammar import MAX_JSON_DEPTH, json_depth

TOOL_PROMPT = (
    "You can call these tools:\n{tools}\n\n"
    "Answer with one JSON object that follows this JSON schema: either the tool calls to make "
    '("tool_calls", each with the tool\'s "name" and its "arguments"){response}.\n{schema}'
)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema (an empty object schema when the tool takes none)


def call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def generic_schema(tools: list[Tool], required: bool, parallel: bool, response: dict[str, Any] | None = None) -> dict[str, Any]:
    """The schema of the answer: the calls (one or, with ``parallel``, several), or — unless
    ``required`` — a response (a string, or ``response``'s schema when response_format gives one)."""
    calls = {"anyOf": [call_schema(t) for t in tools]} if len(tools) > 1 else call_schema(tools[0])
    items: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
    if not parallel:
        items["maxItems"] = 1
    with_calls = {"type": "object", "properties": {"tool_calls": items}, "required": ["tool_calls"], "additionalProperties": False}
    if required:
        return with_calls
    text = {"type": "object", "properties": {"response": response or {"type": "string"}}, "required": ["response"], "additionalProperties": False}
    return {"anyOf": [with_calls, text]}


def tools_prompt(tools: list[Tool], schema: dict[str, Any], required: bool) -> str:
    listing = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters}, ensure_ascii=False) for t in tools)
    response = "" if required else ', or your answer to the user ("response")'
    return TOOL_PROMPT.format(tools=listing, response=response, schema=json.dumps(schema, ensure_ascii=False))


def render_messages(messages: list[dict[str, Any]], system: str | None) -> list[dict[str, str]]:
    """The conversation as the chat template takes it: an assistant's calls as the JSON it would
    have answered, a tool's result as ``{"tool_response": {name, content}}``, and ``system``
    (the tools' description) joined to the first system message or put before the rest."""
    names: dict[str, str] = {}
    out: list[dict[str, str]] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                names[call["id"]] = call["function"]["name"]
                calls.append({"name": call["function"]["name"], "arguments": _arguments(call["function"]["arguments"])})
            out.append({"role": "assistant", "content": _compact({"tool_calls": calls})})
        elif m["role"] == "tool":
            response = {"name": names.get(m["tool_call_id"], ""), "content": m["content"]}
            out.append({"role": "tool", "content": _compact({"tool_response": response})})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if system:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolOutput:
    """Reads an answer in the generic format as it arrives (a character scanner: the grammar makes
    the JSON compact, with ``name`` before ``arguments``). ``push`` returns what is new as
    OpenAI deltas: ``{"content": …}`` for a response's text, ``{"tool_calls": [piece]}`` for calls.

    ``raw_response``: the response has a schema of its own (response_format), so its JSON text is
    the content; otherwise it is a string, whose decoded text is the content. The text read so
    far is either shown (content, call pieces) or structure (the wrapper's keys and brackets);
    ``flush`` at a cut (``max_tokens``) shows what is neither yet — a half-written opening or
    call name — as content, so an answer cut short loses none of what was generated.
    """

    raw_response: bool = False
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    _buffer: str = ""
    _at: int = 0  # characters of the buffer read (shown or structure)
    _state: str = "start"
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    @property
    def is_calls(self) -> bool:
        return bool(self.calls)

    @property
    def is_complete(self) -> bool:
        """The answer is whole: its JSON closed, and every call's arguments parse."""
        if self._state != "done" or self._buffer[self._at :].strip("}"):
            return False
        return all(_parses(call.arguments) for call in self.calls)

    @property
    def is_free_text(self) -> bool:
        """What is read now is a string response's text (where stop strings apply)."""
        return self._state in ("text", "raw")

    def push(self, text: str) -> list[dict[str, Any]]:
        self._buffer += text
        deltas: list[dict[str, Any]] = []
        while self._at < len(self._buffer):
            before = self._at
            delta = self._step()
            if delta:
                deltas.append(delta)
            if self._at == before:
                break  # waits for more text
        return _merged(deltas)

    def _step(self) -> dict[str, Any] | None:
        rest = self._buffer[self._at :]
        if self._state == "start":
            return self._opening(rest)
        if self._state == "text":
            return self._text(rest)
        if self._state == "value":  # a response with a schema of its own: its JSON, as it comes
            return self._raw_value(rest, into_content=True)
        if self._state == "call":
            return self._call(rest)
        if self._state == "arguments":
            return self._raw_value(rest, into_content=False)
        if self._state == "between":  # "}" closes the call, then "," or "]"
            if rest.startswith("},"):
                self._at += 2
                self._state = "call"
            elif rest.startswith("}]"):
                self._at += 2
                self._state = "done"
            elif len(rest) >= 2:
                return self._give_up()
            return None
        if self._state == "done":  # the wrapper's closing braces
            closing = len(rest) - len(rest.lstrip("}"))
            self._at += closing
            return None if closing == len(rest) else self._give_up()
        return self._give_up()  # raw: not the generic format

    def _opening(self, rest: str) -> dict[str, Any] | None:
        calls, response = '{"tool_calls":[', '{"response":'
        if rest.startswith(calls):
            self._at += len(calls)
            self._state = "call"
        elif rest.startswith(response) and len(rest) > len(response):
            is_text = rest[len(response)] == '"' and not self.raw_response  # else: a value of its own schema
            self._at += len(response) + is_text
            self._state = "text" if is_text else "value"
        elif not (calls.startswith(rest) or response.startswith(rest)):
            return self._give_up()
        return None

    def _call(self, rest: str) -> dict[str, Any] | None:
        opening, closing = '{"name":"', '","arguments":'
        if not rest.startswith(opening[: len(rest)]):
            return self._give_up()
        end = rest.find('"', len(opening))
        if end < 0:
            return None
        if not rest[end:].startswith(closing):
            return None if closing.startswith(rest[end:]) else self._give_up()
        name = rest[len(opening) : end]
        self._at += end + len(closing)
        call = ToolCall(len(self.calls), call_id(), name)
        self.calls.append(call)
        self._state, self._depth = "arguments", 0
        return {"tool_calls": [{"index": call.index, "id": call.id, "type": "function", "function": {"name": name, "arguments": ""}}]}

    def _text(self, rest: str) -> dict[str, Any] | None:
        """A string response's characters, escapes decoded (a surrogate pair as one character)."""
        out, i = [], 0
        while i < len(rest):
            ch = rest[i]
            if ch == '"':
                i += 1
                self._state = "done"
                break
            if ch != "\\":
                out.append(ch)
                i += 1
                continue
            decoded = _escape_at(rest, i)
            if decoded is None:
                break  # the escape is not complete yet
            out.append(decoded[0])
            i += decoded[1]
        self._at += i
        piece = "".join(out)
        self.content += piece
        return {"content": piece} if piece else None

    def _raw_value(self, rest: str, into_content: bool) -> dict[str, Any] | None:
        """A value as raw JSON, up to its end: the bracket that closes an object or array, or —
        for a number, string, true, false or null at the top — the wrapper's "}" after it."""
        i, ended = 0, False
        while i < len(rest) and not ended:
            ch = rest[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                if self._depth == 0:  # the wrapper's: a scalar value ended before it
                    ended = True
                    break
                self._depth -= 1
                ended = self._depth == 0
            i += 1
        piece = rest[:i]
        self._at += i
        if ended:
            self._state = "done" if into_content else "between"
        if into_content:
            self.content += piece
            return {"content": piece} if piece else None
        self.calls[-1].arguments += piece
        return {"tool_calls": [{"index": self.calls[-1].index, "function": {"arguments": piece}}]} if piece else None

    def flush(self, cut: bool = False) -> list[dict[str, Any]]:
        """At the end of the answer: text read but not yet shown, as content. An opening never
        completed is content at any end; ``cut`` (the answer ended at max_tokens) shows the
        rest too — a half-written call or escape — and, when nothing was shown at all, the
        whole text generated (a cut before the first call's name)."""
        if not cut and self._state != "start":
            return []
        rest = self._buffer[self._at :] if self.calls or self.content else self._buffer
        self._at, self._state = len(self._buffer), "raw"
        self.content += rest
        return [{"content": rest}] if rest else []

    def _give_up(self) -> dict[str, Any] | None:
        """Not the generic format after all (the grammar was cut short): the rest is content."""
        rest = self._buffer[self._at :]
        self._at = len(self._buffer)
        self._state = "raw"
        self.content += rest
        return {"content": rest} if rest else None


_HEX = frozenset("0123456789abcdefABCDEF")


def _escape_at(text: str, i: int) -> tuple[str, int] | None:
    """The JSON string escape at ``text[i]`` (a backslash): its character and length; None
    while it may still grow. A surrogate pair (two \\uXXXX) is one character; a lone
    surrogate, which no text can hold, is U+FFFD."""
    if len(text) < i + 2:
        return None
    if text[i + 1] != "u":
        try:
            return json.loads(f'"{text[i : i + 2]}"'), 2
        except ValueError:
            return text[i + 1], 2  # not an escape JSON has (the grammar allows none): kept as written
    if len(text) < i + 6:
        return None
    code = _hex(text[i + 2 : i + 6])
    if code is None:
        return text[i : i + 6], 6
    if 0xD800 <= code < 0xDC00:  # a high surrogate: its low half follows as \uXXXX, or it is alone
        tail = text[i + 6 : i + 12]
        if len(tail) < 6 and "\\u".startswith(tail[:2]) and set(tail[2:]) <= _HEX:
            return None
        low = _hex(tail[2:]) if tail.startswith("\\u") else None
        if low is not None and 0xDC00 <= low < 0xE000:
            return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), 12
        return "\ufffd", 6
    return ("\ufffd" if 0xDC00 <= code < 0xE000 else chr(code)), 6


def _hex(digits: str) -> int | None:
    return int(digits, 16) if len(digits) == 4 and set(digits) <= _HEX else None


def _parses(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except (ValueError, RecursionError):
        return False
    return True


def _merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive content pieces as one, consecutive argument pieces of one call as one."""
    out: list[dict[str, Any]] = []
    for delta in deltas:
        last = out[-1] if out else None
        if last is not None and "content" in delta and "content" in last:
            last["content"] += delta["content"]
        elif last is not None and "tool_calls" in delta and "tool_calls" in last and "id" not in delta["tool_calls"][0] and last["tool_calls"][0]["index"] == delta["tool_calls"][0]["index"]:
            function = last["tool_calls"][0].setdefault("function", {})
            function["arguments"] = function.get("arguments", "") + delta["tool_calls"][0]["function"]["arguments"]
        else:
            out.append(delta)
    return out


def _arguments(value: str) -> Any:
    """A call's arguments as the JSON they hold (as sent when they hold none, or nest past the stack)."""
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        return value
    return parsed if json_depth(parsed) <= MAX_JSON_DEPTH else value


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def message_of(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message the ``deltas`` of one answer add up to, as a client reassembles a
    stream: content joined (None when the answer is calls alone), calls by index."""
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for piece in delta.get("tool_calls", []):
            call = calls.setdefault(piece["index"], {"id": piece.get("id"), "type": "function", "function": {"name": "", "arguments": ""}})
            call["function"]["name"] += piece.get("function", {}).get("name", "")
            call["function"]["arguments"] += piece.get("function", {}).get("arguments", "")
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None, "refusal": None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message
