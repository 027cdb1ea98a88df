"""Tokens to streamed text, free of I/O: text leaves only when final, never half a UTF-8 character (U+FFFD)
nor what may begin a stop string."""

from __future__ import annotations

from typing import Any

from app.reasoning import ReasoningSplitter
from app.tools import ToolOutput

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feeds token ids, returns the new text that is final. As vLLM's, it decodes only a window
    (``tokens[prefix_offset:]``, its head for context such as a leading space): O(n), not O(n²)."""

    def __init__(self, tokenizer: Any, skipped: frozenset[int] | None = None) -> None:
        self.tokenizer = tokenizer
        # None: every special token left out; else these, and the others (markers) written out
        self.skipped = skipped
        self.tokens: list[int] = []
        self.prefix_offset = 0  # the window starts here
        self.read_offset = 0  # tokens before this were emitted whole
        self._emitted = 0  # characters of the window's new text already returned (an incomplete tail pending)
        self.num_decoded = 0  # tokens passed to the tokenizer so far (the cost)

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        prefix, text = self._window()
        # empty while only an incomplete character is new
        new = text[len(prefix) + self._emitted : len(text.rstrip(_REPLACEMENT))]
        self._emitted += len(new)
        if not text.endswith(_REPLACEMENT):
            self.prefix_offset, self.read_offset, self._emitted = self.read_offset, len(self.tokens), 0
        return new

    def flush(self) -> str:
        """Whatever is left at the end, replacement characters included."""
        prefix, text = self._window()
        new = text[len(prefix) + self._emitted :]
        self.prefix_offset, self.read_offset, self._emitted = self.read_offset, len(self.tokens), 0
        return new

    def _window(self) -> tuple[str, str]:
        """The text of the tokens emitted in the window, and of the whole window."""
        return self._decode(self.tokens[self.prefix_offset : self.read_offset]), self._decode(
            self.tokens[self.prefix_offset :]
        )

    def _decode(self, tokens: list[int]) -> str:
        self.num_decoded += len(tokens)
        if not tokens:
            return ""
        if self.skipped is None:
            return str(self.tokenizer.decode(tokens, skip_special_tokens=True))
        return str(
            self.tokenizer.decode([t for t in tokens if t not in self.skipped], skip_special_tokens=False)
        )


class StopMatcher:
    """Cuts the text at the first stop string; holds back a tail that may start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The part of ``text`` (after what is held back) that is final."""
        if self.stopped:
            return ""
        buffer = self._pending + text
        hit = min((i for i in (buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if hit >= 0:
            self.stopped, self._pending = True, ""
            return buffer[:hit]
        keep = self._held_back(buffer)
        self._pending = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def skip(self, text: str) -> str:
        """``text`` (after what is held back) as final, unsearched (min_tokens)."""
        return self.flush() + text if not self.stopped else ""

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _held_back(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:size]):
                    best = size
                    break
        return best


class ChoiceText:
    """One choice's tokens → the deltas its client sees (with tools: ``app.tools.ToolOutput``).
    Stop strings apply only where the model writes freely, so a stop string cannot cut a grammar's
    JSON into something that does not parse; as vLLM's min_tokens, none in the first tokens' text."""

    def __init__(
        self,
        tokenizer: Any,
        stops: list[str],
        min_tokens: int = 0,
        tools: ToolOutput | None = None,
        grammar: bool = False,
        reasoning: ReasoningSplitter | None = None,
        skipped: frozenset[int] | None = None,
    ) -> None:
        # skipped: the special tokens left out, where markers are written out
        self.detok = IncrementalDetokenizer(tokenizer, skipped)
        free = tools is not None and not tools.raw_response if grammar else True
        self.matcher = StopMatcher(stops if free else [])
        self.min_tokens = min_tokens
        self.tools = tools
        self.generated = 0
        # a thinking template's answer: its reasoning first, as {"reasoning_content"} deltas
        self.reasoning = reasoning
        self.reasoning_tokens = 0

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    def push(self, tokens: list[int]) -> list[dict[str, Any]]:
        """The deltas of ``tokens``: ``{"content": …}``, and ``{"tool_calls": […]}`` with tools."""
        if self.reasoning is not None:
            return self._push_thinking(tokens)
        early = max(0, min(len(tokens), self.min_tokens - self.generated))
        self.generated += len(tokens)
        head = self.detok.push(tokens[:early]) if early else ""
        rest = self.detok.push(tokens[early:])
        if self.tools is None:
            return _content((self.matcher.skip(head) if early else "") + self.matcher.push(rest))
        return self._stopped(self.tools.push(head + rest))

    def finish(self, reason: str) -> tuple[list[dict[str, Any]], str]:
        """The last deltas (what was held back) and the finish reason the client sees (``stop``,
        ``tool_calls``)."""
        if self.stopped:
            return [], "stop"
        tail = self.detok.flush()
        reasoning: list[dict[str, Any]] = []
        if self.reasoning is not None:
            (thought, tail), (held, rest) = self.reasoning.push(tail), self.reasoning.flush()
            reasoning, tail = _reasoning(thought + held), tail + rest
        if self.tools is None:
            deltas = _content(self.matcher.push(tail))
        else:
            deltas = self._stopped(self.tools.push(tail))
            if not self.stopped:
                deltas += self._stopped(self.tools.flush(cut=reason == "length"))
        deltas = reasoning + deltas + _content(self.matcher.flush())  # nothing once stopped
        if self.stopped:
            return deltas, "stop"
        called = self.tools is not None and reason == "stop" and self.tools.calls and self.tools.is_complete
        return deltas, "tool_calls" if called else reason

    def _push_thinking(self, tokens: list[int]) -> list[dict[str, Any]]:
        """A thinking answer's tokens, one at a time: the reasoning's text as reasoning deltas (its tokens
        counted), the rest as free text (stop strings apply to the answer, not the reasoning)."""
        assert self.reasoning is not None
        deltas: list[dict[str, Any]] = []
        for token in tokens:
            was_reasoning = self.reasoning.reasoning
            thought, text = self.reasoning.push(self.detok.push([token]))
            self.reasoning_tokens += was_reasoning or bool(thought)
            self.generated += 1
            deltas += _reasoning(thought)
            if text:
                deltas += (
                    _content(self.matcher.push(text))
                    if self.tools is None
                    else self._stopped(self.tools.push(text))
                )
            if self.stopped:
                break
        return _joined(deltas)

    def _stopped(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``deltas`` with the stop strings applied to their content, up to where one matched."""
        out: list[dict[str, Any]] = []
        for delta in deltas:
            if "content" not in delta:
                out.append(delta)
                continue
            out += _content(self.matcher.push(delta["content"]))
            if self.stopped:
                break
        return out


def _content(text: str) -> list[dict[str, Any]]:
    return [{"content": text}] if text else []


def _reasoning(text: str) -> list[dict[str, Any]]:
    return [{"reasoning_content": text}] if text else []


def _joined(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive reasoning pieces, and consecutive content pieces, as one."""
    out: list[dict[str, Any]] = []
    for delta in deltas:
        kind = next(iter(delta)) if len(delta) == 1 else None
        if out and kind in ("reasoning_content", "content") and set(out[-1]) == {kind}:
            out[-1] = {kind: out[-1][kind] + delta[kind]}
        else:
            out.append(delta)
    return out


def delta_text(deltas: list[dict[str, Any]]) -> str:
    """The content of ``deltas``, joined."""
    return "".join(d.get("content", "") for d in deltas)
