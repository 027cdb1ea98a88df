"""Reasoning output, free of I/O (docs/tools.md, "Reasoning"): whether a chat template marks thinking
(``thinking_markers``), whether its generation prompt opens it (``opens_thinking``), the reader that splits an
answer, as generated, into its reasoning and its content (``ReasoningSplitter``), and a request's grammar
moved to after the reasoning (``after_reasoning``)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from app.tool_formats.base import Markers
from app.tools import partial
from core.grammar import JSON_OPTIONS, GrammarKind, GrammarSpec, load_schema, strict

MARKERS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))  # DeepSeek-R1, Qwen3, … ; Magistral


@dataclass(frozen=True)
class Thinking:
    """A template's thinking markers, and whether a request's prompt already opened them (DeepSeek-R1's
    templates do)."""

    open: str
    close: str
    inside: bool = False


def thinking_markers(template: str | None) -> Thinking | None:
    """The markers a chat template writes thinking between, if it has any."""
    for opening, closing in MARKERS:
        if template and opening in template and closing in template:
            return Thinking(opening, closing)
    return None


def opens_thinking(prompt_text: str, thinking: Thinking) -> Thinking:
    """``thinking`` for a prompt: ``inside`` when the prompt ends in an open thinking block (the answer starts
    reasoning)."""
    opened, closed = prompt_text.rfind(thinking.open), prompt_text.rfind(thinking.close)
    return Thinking(
        thinking.open,
        thinking.close,
        opened > closed and not prompt_text[opened + len(thinking.open) :].strip(" \n"),
    )


class ReasoningSplitter:
    """Splits an answer's text as it comes into (reasoning, content): the reasoning is what lies between the
    markers at the answer's start (or from its start, when the prompt opened it) up to the closing one; a
    piece that may begin a marker is held back until it is one or is not, so no marker is ever streamed; the
    blank lines after the closing marker are dropped."""

    def __init__(self, thinking: Thinking) -> None:
        self.thinking = thinking
        self.state = "inside" if thinking.inside else "before"
        self._pending = ""

    @property
    def reasoning(self) -> bool:
        """The next text would be reasoning."""
        return self.state == "inside"

    def push(self, text: str) -> tuple[str, str]:
        buffer, reasoning, content = self._pending + text, "", ""
        self._pending = ""
        while buffer:
            if self.state == "before":  # leading whitespace, then the opening marker or the content
                stripped = buffer.lstrip()
                if not stripped:
                    self._pending = buffer
                    break
                if stripped.startswith(self.thinking.open):
                    buffer, self.state = stripped[len(self.thinking.open) :], "inside"
                elif self.thinking.open.startswith(stripped):
                    self._pending = buffer
                    break
                else:
                    self.state = "content"
            elif self.state == "inside":
                at = buffer.find(self.thinking.close)
                if at >= 0:
                    reasoning += buffer[:at]
                    buffer, self.state = buffer[at + len(self.thinking.close) :], "after"
                    continue
                held = partial(buffer, self.thinking.close)
                reasoning += buffer[: len(buffer) - held]
                self._pending = buffer[len(buffer) - held :]
                break
            elif self.state == "after":  # the blank lines between the reasoning and the answer
                stripped = buffer.lstrip("\n")
                if not stripped:
                    break
                buffer, self.state = stripped, "content"
            else:
                content += buffer
                break
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """At the end: what was held back (a marker's start that never became one) as what it would have
        been."""
        pending, self._pending = self._pending, ""
        if self.state == "inside":
            return pending, ""
        return "", pending if self.state != "after" else ""


def after_reasoning(
    spec: GrammarSpec, thinking: Thinking, own: bool = False, markers: Markers | None = None
) -> GrammarSpec | None:
    """``spec`` with a thinking block allowed first (required when the prompt opened it), as a Lark grammar.
    ``own``: a Lark grammar of specgate's own (the native tool formats), whose ``start`` rule is renamed; None
    for a grammar a request gave as Lark or GBNF, and for the few that cannot be wrapped (a schema that allows
    nothing, a regex ending in a backslash): the request then has no reasoning told apart, and the grammar
    applies from the first token."""
    body: str | None = None
    if spec.kind is GrammarKind.JSON_SCHEMA:
        schema = strict(load_schema(spec.source))
        if schema is True or isinstance(schema, dict):
            body = (
                "%json "
                f"{json.dumps({**(schema if isinstance(schema, dict) else {}), 'x-guidance': JSON_OPTIONS})}"
            )
    elif spec.kind is GrammarKind.REGEX:
        if (len(spec.source) - len(spec.source.rstrip("\\"))) % 2 == 0:
            # an odd run of backslashes at the end would escape the closing slash
            # an unescaped slash would end the Lark regex
            body = "/" + re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", spec.source) + "/"
    elif spec.kind is GrammarKind.CHOICE:
        body = " | ".join(json.dumps(choice) for choice in json.loads(spec.source))
    elif own and spec.source.startswith("start:"):
        body = "specgate_body:" + spec.source.removeprefix("start:")
    if body is None:
        return None
    close = re.escape(thinking.close).replace("/", "\\/")  # a slash would end the Lark regex
    markers = markers or Markers()
    opening = "" if thinking.inside else markers.grammar(thinking.open) + " "
    if thinking.close in markers:
        # the closing marker is a special token (Magistral's [/THINK]): that token ends the reasoning
        reasoning = [
            f"specgate_reasoning: SPECGATE_THOUGHT {markers.grammar(thinking.close)}",
            f"SPECGATE_THOUGHT: /(?s:.*)/ & ~/(?s:.*){close}(?s:.*)/",
        ]
    else:
        reasoning = [f"specgate_reasoning[lazy]: /(?s:.*){close}/"]
    rules = [
        f"start: {opening}specgate_reasoning SPECGATE_BLANK specgate_body"
        + ("" if thinking.inside else " | specgate_body"),
        *reasoning,
        # the blank lines between the reasoning and the reply (the splitter drops them)
        r"SPECGATE_BLANK: /\n*/",
    ]
    if spec.kind is GrammarKind.GRAMMAR:
        return GrammarSpec(GrammarKind.GRAMMAR, "\n".join(rules) + "\n" + body)
    return GrammarSpec(GrammarKind.GRAMMAR, "\n".join([*rules, f"specgate_body: {body}"]) + "\n")
