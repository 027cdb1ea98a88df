"""From tokens to streamed text: incremental detokenisation and stop strings (no I/O).

Text leaves only when it is final: never half a UTF-8 character (the tokenizer's U+FFFD for
an incomplete byte sequence is held back), never the beginning of what may become a stop
string (held back until it is known not to be one).
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feeds token ids, returns the new text that is final.

    As vLLM's detokenizer: only a window is decoded each time — the tokens from
    ``prefix_offset`` on, where ``tokens[prefix_offset:read_offset]`` were decoded before (their
    text gives the context a token's text may depend on, e.g. a leading space) — so a choice of
    n tokens costs O(n) decoded tokens, not O(n²). The window moves on once its text ends in a
    whole character; until then the part before the incomplete character is emitted.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0  # the window starts here
        self.read_offset = 0  # tokens before this were emitted whole
        self._emitted = 0  # characters of the window's new text already returned (an incomplete tail pending)
        self.num_decoded = 0  # tokens passed to the tokenizer so far (the cost)

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        prefix, text = self._window()
        stable = len(text.rstrip(_REPLACEMENT))
        new = text[len(prefix) + self._emitted : stable] if stable > len(prefix) + self._emitted else ""
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
        return self._decode(self.tokens[self.prefix_offset : self.read_offset]), self._decode(self.tokens[self.prefix_offset :])

    def _decode(self, tokens: list[int]) -> str:
        self.num_decoded += len(tokens)
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True)) if tokens else ""


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
        """``text`` (after what is held back) as final, unsearched: vLLM's min_tokens looks for no
        stop string in the first tokens' text."""
        if self.stopped:
            return ""
        out, self._pending = self._pending + text, ""
        return out

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
