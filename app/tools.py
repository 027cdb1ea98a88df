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
    OpenAI deltas: ``{"content": …}`` for a response's text, ``{"tool_calls": [piece]}`` for calls."""

    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    _buffer: str = ""
    _at: int = 0  # characters of the buffer read
    _state: str = "start"
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _escape: str = ""  # a response's pending escape (\uXXXX in the making)

    @property
    def is_calls(self) -> bool:
        return bool(self.calls)

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
            for opening, state in (('{"tool_calls":[', "call"), ('{"response":"', "text")):
                if rest.startswith(opening):
                    self._at += len(opening)
                    self._state = state
                    return None
            if rest.startswith('{"response":') and len(rest) > len('{"response":'):  # not a string: a value of its own schema
                self._at += len('{"response":')
                self._state = "value"
                return None
            return None if any(o.startswith(rest) for o in ('{"tool_calls":[', '{"response":"')) else self._give_up()
        if self._state == "text":
            return self._text_char(rest)
        if self._state == "value":  # a response with a schema of its own: its JSON, as it comes
            return self._raw_value(rest, into_content=True)
        if self._state == "call":
            opening = '{"name":"'
            if rest.startswith(opening) and '"' in rest[len(opening) :]:
                end = rest.index('"', len(opening))
                name = rest[len(opening) : end]
                if rest[end:].startswith('","arguments":'):
                    self._at += end + len('","arguments":')
                    call = ToolCall(len(self.calls), call_id(), name)
                    self.calls.append(call)
                    self._state, self._depth = "arguments", 0
                    return {"tool_calls": [{"index": call.index, "id": call.id, "type": "function", "function": {"name": name, "arguments": ""}}]}
                if len(rest) > end + len('","arguments":'):
                    return self._give_up()
            return None
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
        self._at = len(self._buffer)  # done: the closing braces
        return None

    def _text_char(self, rest: str) -> dict[str, Any] | None:
        out = []
        i = 0
        while i < len(rest):
            ch = rest[i]
            if self._escape:
                self._escape += ch
                i += 1
                decoded = _decode_escape(self._escape)
                if decoded is not None:
                    out.append(decoded)
                    self._escape = ""
                continue
            if ch == "\\":
                self._escape = ch
            elif ch == '"':
                i += 1
                self._state = "done"
                break
            else:
                out.append(ch)
            i += 1
        self._at += i
        piece = "".join(out)
        self.content += piece
        return {"content": piece} if piece else None

    def _raw_value(self, rest: str, into_content: bool) -> dict[str, Any] | None:
        """An object or array value, as raw JSON, up to the bracket that closes it."""
        i, ended = 0, False
        while i < len(rest) and not ended:
            ch = rest[i]
            i += 1
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
                self._depth -= 1
                ended = self._depth == 0
        piece = rest[:i]
        self._at += i
        if ended:
            self._state = "done" if into_content else "between"
        if into_content:
            self.content += piece
            return {"content": piece} if piece else None
        self.calls[-1].arguments += piece
        return {"tool_calls": [{"index": self.calls[-1].index, "function": {"arguments": piece}}]} if piece else None

    def flush(self) -> list[dict[str, Any]]:
        """At the end of the answer: an opening never completed (cut short) as content."""
        if self._state != "start":
            return []
        delta = self._give_up()
        return [delta] if delta else []

    def _give_up(self) -> dict[str, Any] | None:
        """Not the generic format after all (the grammar was cut short): the rest is content."""
        rest = self._buffer[self._at :]
        self._at = len(self._buffer)
        self._state = "raw"
        self.content += rest
        return {"content": rest} if rest else None


def _decode_escape(escape: str) -> str | None:
    """A JSON string escape once complete (``\\n``, ``\\u00e9``); None while it is not."""
    if len(escape) < 2:
        return None
    if escape[1] == "u":
        if len(escape) < 6:
            return None
        return chr(int(escape[2:6], 16))
    return json.loads(f'"{escape}"')


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
    try:
        return json.loads(value)
    except ValueError:
        return value


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
