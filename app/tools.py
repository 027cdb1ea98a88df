"""Tool calls in the generic format (docs/design.md §3.9), free of I/O: the model answers
``{"tool_calls":[{"name":…,"arguments":{…}},…]}`` or ``{"response":"…"}``, described in a system message;
``ToolOutput`` reads it, as generated, into OpenAI's deltas."""

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


def generic_schema(
    tools: list[Tool], required: bool, parallel: bool, response: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The answer's schema: the calls (several with ``parallel``), or unless ``required`` a response
    (``response``'s schema, else a string)."""
    calls = {"anyOf": [call_schema(t) for t in tools]} if len(tools) > 1 else call_schema(tools[0])
    items: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
    if not parallel:
        items["maxItems"] = 1
    with_calls = {
        "type": "object",
        "properties": {"tool_calls": items},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    if required:
        return with_calls
    text = {
        "type": "object",
        "properties": {"response": response or {"type": "string"}},
        "required": ["response"],
        "additionalProperties": False,
    }
    return {"anyOf": [with_calls, text]}


def tools_prompt(tools: list[Tool], schema: dict[str, Any], required: bool) -> str:
    listing = "\n".join(
        json.dumps(
            {"name": t.name, "description": t.description, "parameters": t.parameters}, ensure_ascii=False
        )
        for t in tools
    )
    response = "" if required else ', or your answer to the user ("response")'
    return TOOL_PROMPT.format(tools=listing, response=response, schema=json.dumps(schema, ensure_ascii=False))


def render_messages(messages: list[dict[str, Any]], system: str | None) -> list[dict[str, str]]:
    """For the chat template: calls as the model's JSON, results as ``{"tool_response": {name, content}}``,
    ``system`` joined to the first."""
    names: dict[str, str] = {}
    out: list[dict[str, str]] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                names[call["id"]] = call["function"]["name"]
                calls.append(
                    {"name": call["function"]["name"], "arguments": _arguments(call["function"]["arguments"])}
                )
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


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolOutput:
    """Reads the generic format as it arrives into OpenAI deltas (``push``): a character scanner, as the
    grammar makes the JSON compact, ``name`` before ``arguments``. With ``raw_response`` (response_format) a
    response's JSON text is the content."""

    raw_response: bool = False
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    _buffer: str = ""
    _at: int = 0  # characters of the buffer read (shown or structure)
    _state: str = "start"
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    # how a call opens, up to its name (app.tool_formats: its own)
    _name_open: str = field(default='{"name":"', init=False, repr=False)
    # … from its name's end to its arguments
    _args_open: str = field(default='","arguments":', init=False, repr=False)

    @property
    def is_complete(self) -> bool:
        """The answer is whole: its JSON closed, and every call's arguments parse."""
        if self._state != "done" or self._buffer[self._at :].strip("}"):
            return False
        return all(_loads(call.arguments) is not _INVALID for call in self.calls)

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
        if self._state in ("value", "arguments"):
            # JSON as it comes: a call's arguments, or a response with a schema of its own
            return self._raw_value(rest, into_content=self._state == "value")
        if self._state == "between":  # "}" closes the call, then "," or "]"
            after = {"},": "call", "}]": "done"}.get(rest[:2])
            if after is None:
                return self._give_up() if len(rest) >= 2 else None
            self._at, self._state = self._at + 2, after
            return None
        if self._state == "done":  # the wrapper's closing braces
            closing = len(rest) - len(rest.lstrip("}"))
            self._at += closing
            return None if closing == len(rest) else self._give_up()
        step = {"start": self._opening, "text": self._text, "call": self._call}.get(self._state)
        return step(rest) if step is not None else self._give_up()  # raw: not the generic format

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
        opening, closing = self._name_open, self._args_open
        if not rest.startswith(opening[: len(rest)]):
            return self._give_up()
        end = rest.find('"', len(opening))
        if end < 0:
            return None
        if not rest[end:].startswith(closing):
            return None if closing.startswith(rest[end:]) else self._give_up()
        name = rest[len(opening) : end]
        self._at += end + len(closing)
        call = ToolCall(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", name)
        self.calls.append(call)
        self._state, self._depth = "arguments", 0
        return {
            "tool_calls": [
                {
                    "index": call.index,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            ]
        }

    def _text(self, rest: str) -> dict[str, Any] | None:
        """A string response's characters, escapes decoded (a surrogate pair as one character)."""
        out, i = [], 0
        while i < len(rest) and rest[i] != '"':
            decoded = _escape_at(rest, i) if rest[i] == "\\" else (rest[i], 1)
            if decoded is None:
                break  # the escape is not complete yet
            out.append(decoded[0])
            i += decoded[1]
        if rest[i : i + 1] == '"':
            i += 1
            self._state = "done"
        self._at += i
        piece = "".join(out)
        self.content += piece
        return {"content": piece} if piece else None

    def _raw_value(self, rest: str, into_content: bool) -> dict[str, Any] | None:
        """A value as raw JSON up to its end: the bracket that closes it, or (a scalar at the top) the
        wrapper's "}" after it."""
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
        return (
            {"tool_calls": [{"index": self.calls[-1].index, "function": {"arguments": piece}}]}
            if piece
            else None
        )

    def flush(self, cut: bool = False) -> list[dict[str, Any]]:
        """At the end: an opening never completed as content. With ``cut`` (max_tokens) a call or the wrapper
        cut short is never text: a call whose name was not finished is dropped, one cut in its arguments stays
        as it is (the client sees finish_reason ``length``, the Responses API an incomplete item); a
        response's own text or JSON keeps its rest."""
        if cut and self._state in _STRUCTURE:
            self._at = len(self._buffer)
            return []
        if not cut and self._state != "start":
            return []
        delta = self._give_up(whole=not (self.calls or self.content))
        return [delta] if delta else []

    def _give_up(self, whole: bool = False) -> dict[str, Any] | None:
        """Not the generic format after all (the grammar was cut short): the rest is content."""
        rest = self._buffer if whole else self._buffer[self._at :]
        self._at, self._state = len(self._buffer), "raw"
        self.content += rest
        return {"content": rest} if rest else None


# states inside the format's own JSON, not a response's text
_STRUCTURE = frozenset({"start", "call", "arguments", "between", "done"})
_HEX = frozenset("0123456789abcdefABCDEF")


def _escape_at(text: str, i: int) -> tuple[str, int] | None:
    """The JSON escape at ``text[i]``: (character, length), None while it may grow; a surrogate pair is one
    character, a lone one U+FFFD."""
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


def partial(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (without being all of it): what to hold
    back."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:n])), 0)


_INVALID = object()  # what _loads returns for text that is not JSON (or nests past the stack)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _INVALID


def _merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive content pieces as one, consecutive argument pieces of one call as one."""
    out: list[dict[str, Any]] = []
    for delta in deltas:
        last = out[-1] if out else None
        if last is not None and "content" in delta and "content" in last:
            last["content"] += delta["content"]
        elif (
            last is not None
            and "tool_calls" in delta
            and "tool_calls" in last
            and "id" not in delta["tool_calls"][0]
            and last["tool_calls"][0]["index"] == delta["tool_calls"][0]["index"]
        ):
            function = last["tool_calls"][0].setdefault("function", {})
            function["arguments"] = (
                function.get("arguments", "") + delta["tool_calls"][0]["function"]["arguments"]
            )
        else:
            out.append(delta)
    return out


def _arguments(value: str) -> Any:
    """A call's arguments as the JSON they hold (as sent when they hold none, or nest past the stack)."""
    parsed = _loads(value)
    return parsed if parsed is not _INVALID and json_depth(parsed) <= MAX_JSON_DEPTH else value


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def message_of(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message the ``deltas`` of one answer add up to, as a client reassembles a stream."""
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for piece in delta.get("tool_calls", []):
            call = calls.setdefault(
                piece["index"],
                {"id": piece.get("id"), "type": "function", "function": {"name": "", "arguments": ""}},
            )
            call["function"]["name"] += piece.get("function", {}).get("name", "")
            call["function"]["arguments"] += piece.get("function", {}).get("arguments", "")
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content if content or not calls else None,
        "refusal": None,
    }
    if any("reasoning_content" in d for d in deltas):  # a thinking template's answer: its reasoning apart
        message["reasoning_content"] = "".join(d.get("reasoning_content", "") for d in deltas)
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message
