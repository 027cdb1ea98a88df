"""What every tool format is (``ToolFormat``: its detection, rendering, grammar and reader) and what they
share: the registry (``register``), the markers that a tokenizer may hold as one special token each
(``Markers``), and the conversation as templates take it."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from app.tools import Tool, ToolOutput, _arguments, _merged

# every format by name, in the order detection tries them (as llama.cpp's chat code)
FORMATS: dict[str, ToolFormat] = {}
# the JSON as the templates render it (transformers' tojson: json.dumps's separators), compact otherwise
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def register(cls: type[ToolFormat]) -> type[ToolFormat]:
    """A format class, registered under its ``name`` (its module's import is its registration:
    app.tool_formats)."""
    FORMATS[cls.name] = cls()
    return cls


@dataclass(frozen=True)
class Markers:
    """The marker strings of a format (and of a template's thinking) that the tokenizer holds as one special
    token each: a grammar names those by id (llguidance's ``<[id]>``), never as text the model would have to
    spell out of ordinary pieces; the detokenizer writes them out, where it skips other special tokens, so a
    reader sees them."""

    ids: dict[str, int] = field(default_factory=dict)
    skipped: frozenset[int] = frozenset()  # the tokenizer's other special tokens: what decoding leaves out

    @classmethod
    def of(cls, tokenizer: Any, candidates: tuple[str, ...]) -> Markers:
        """Which of ``candidates`` ``tokenizer`` holds as one special token."""
        special = special_ids(tokenizer)
        ids = {}
        for text in candidates:
            token = tokenizer.convert_tokens_to_ids(text) if text else None
            if isinstance(token, int) and token in special and tokenizer.convert_ids_to_tokens(token) == text:
                ids[text] = token
        return cls(ids, special - frozenset(ids.values()))

    def grammar(self, text: str) -> str:
        """``text`` in a Lark grammar: each marker in it by its special token's id, the rest as literals."""
        if not self.ids:
            return json.dumps(text)
        pieces = re.split(
            "(" + "|".join(re.escape(m) for m in sorted(self.ids, key=len, reverse=True)) + ")", text
        )
        return " ".join(f"<[{self.ids[p]}]>" if p in self.ids else json.dumps(p) for p in pieces if p) or '""'

    def __contains__(self, text: object) -> bool:
        return text in self.ids


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids a tokenizer decodes to nothing with ``skip_special_tokens``: its special tokens and its added
    tokens marked special."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(token_id))
    return frozenset(ids)


class ToolFormat:
    """A family's way of writing tool calls. A subclass, registered, says:

    - ``detects(template)``: whether a chat template renders calls its way (tried in registration order);
    - ``markers``: the strings that may be one special token in a tokenizer (its trigger, its separators);
    - ``template_messages``: the conversation as its template takes it (the default: arguments as objects, a
      result
      with its call's name; ``merge_roles`` for templates that need roles to alternate);
    - ``grammar(tools, required, parallel, markers)``: the Lark grammar of an answer (llguidance's);
    - ``reader(markers)``: what turns the answer's text into OpenAI's deltas (app.tools.ToolOutput's
      interface)."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()
    # the template refuses two user (or assistant) turns in a row, or a system turn past the first
    merge_roles: ClassVar[bool] = False
    # merging: an assistant's text and the calls after it one message (mistral-common v7+)
    text_with_calls: ClassVar[bool] = False

    def detects(self, template: str) -> bool:
        raise NotImplementedError

    def grammar(self, tools: list[Tool], required: bool, parallel: bool, markers: Markers) -> str:
        raise NotImplementedError

    def reader(self, markers: Markers, tools: dict[str, dict[str, Any]]) -> ToolOutput:
        raise NotImplementedError

    def call_id(self, given: str) -> str:
        """A call's id as the template takes it."""
        return given

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as a tool-calling template takes it: a call's arguments as the object they hold, a
        result with its call's name; roles merged where the template needs them to alternate."""
        names: dict[str, str] = {}
        out = []
        for m in messages:
            message = dict(m)
            if m.get("tool_calls"):
                calls = []
                for call in m["tool_calls"]:
                    names[call["id"]] = call["function"]["name"]
                    function = {
                        "name": call["function"]["name"],
                        "arguments": _arguments(call["function"]["arguments"]),
                    }
                    calls.append({"id": self.call_id(call["id"]), "type": "function", "function": function})
                message["tool_calls"] = calls
            elif m["role"] == "tool":
                message["tool_call_id"] = self.call_id(m["tool_call_id"])
                message["name"] = names.get(m["tool_call_id"], "")
            out.append(message)
        return merged_roles(out, self.text_with_calls) if self.merge_roles else out


@dataclass
class SteppedOutput(ToolOutput):
    """A native format's reader: ``push`` steps (``_step``) while a step moves on in the text or in its state,
    and ``_content`` takes free text as content."""

    def push(self, text: str) -> list[dict[str, Any]]:
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

    def _step(self) -> dict[str, Any] | None:
        raise NotImplementedError

    def _content(self, size: int) -> dict[str, Any] | None:
        piece = self._buffer[self._at : self._at + size]
        self._at += size
        self.content += piece
        return {"content": piece} if piece else None


def lark_regex(text: str) -> str:
    """``text`` as a Lark regex's body: escaped, a slash too (it would end the regex)."""
    return re.escape(text).replace("/", "\\/")


def after_trigger(trigger: str, body: str, required: bool, markers: Markers) -> tuple[str, list[str]]:
    """The start rule of a grammar whose calls (``body``) follow ``trigger``, and the rules it needs: the
    trigger first when a call is required; else free text that never holds the trigger's spelling, then the
    trigger (its special token, or its text, found lazily) and the calls."""
    token = markers.grammar(trigger)
    if required:
        return f"start: {token} {body}", []
    spelled = lark_regex(trigger)
    free = f"FREE: /(?s:.*)/ & ~/(?s:.*){spelled}(?s:.*)/"
    if trigger in markers:  # the trigger is a token no text can hold: free text, then the token
        return f"start: FREE | FREE {token} {body}", [free]
    return f"start: FREE | prefix {body}", [free, f"prefix[lazy]: /(?s:.*){spelled}/"]


def nine_character_id(given: str) -> str:
    """A call id as Mistral's templates take it: nine letters and digits."""
    return given if re.fullmatch(r"[A-Za-z0-9]{9}", given) else hashlib.sha256(given.encode()).hexdigest()[:9]


def merged_roles(messages: list[dict[str, Any]], text_with_calls: bool = False) -> list[dict[str, Any]]:
    """Messages as a template that needs roles to alternate takes them, as Mistral's own normaliser
    (mistral-common) and vLLM merge them: every system (and developer) message joined into the first,
    consecutive user messages joined, and consecutive assistant texts joined (a blank line between; their
    reasoning too). With ``text_with_calls`` (its v7+ tokenizers), an assistant's text and the calls after it
    are one message; v0.3's template counts the calls apart."""
    systems = [m for m in messages if m["role"] == "system"]
    out: list[dict[str, Any]] = []
    if systems:
        out.append({**systems[0], "content": "\n\n".join(str(m.get("content") or "") for m in systems)})
    for message in messages:
        if message["role"] == "system":
            continue
        last = (
            out[-1]
            if out and out[-1]["role"] == message["role"] and message["role"] in ("user", "assistant")
            else None
        )
        if (
            last is not None
            and not last.get("tool_calls")
            and (not message.get("tool_calls") or text_with_calls)
        ):
            joined = {
                **message,
                "content": "\n\n".join(str(t) for t in (last.get("content"), message.get("content")) if t)
                or message.get("content"),
            }
            thoughts = [t for t in (last.get("reasoning_content"), message.get("reasoning_content")) if t]
            if thoughts:
                joined["reasoning_content"] = "\n\n".join(thoughts)
            out[-1] = joined
        else:
            out.append(message)
    return out


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """``tools`` as chat templates take them (OpenAI's shape)."""
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
        }
        for t in tools
    ]
