"""From tokens to streamed text: incremental detokenisation and stop strings (no I/O).

Text leaves only when it is final: never half a UTF-8 character (the tokenizer's U+FFFD for
an incomplete byte sequence is held back), never the beginning of what may become a stop
string (held back until it is known not to be one).
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feeds token ids, returns the new text that is final."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self._emitted = 0  # characters of the decoded text already returned

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        text = self._decode()
        stable = len(text.rstrip(_REPLACEMENT)) if text.endswith(_REPLACEMENT) else len(text)
        if stable <= self._emitted:
            return ""
        new, self._emitted = text[self._emitted : stable], stable
        return new

    def flush(self) -> str:
        """Whatever is left at the end, replacement characters included."""
        text = self._decode()
        new, self._emitted = text[self._emitted :], len(text)
        return new

    def _decode(self) -> str:
        return str(self.tokenizer.decode(self.tokens, skip_special_tokens=True))


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
