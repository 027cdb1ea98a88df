"""An OpenAI-compatible engine's completions listing, token by token (docs/design.md §8): its
``EngineFormat``, its entries, ``TokenTable``'s ids."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import orjson

from app.targets.failures import ReplicaFailure

_ID_PREFIX = "token_id:"  # vLLM's return_tokens_as_token_ids


@dataclass(frozen=True)
class EngineFormat:
    """How one engine reads prompts and writes tokens, learnt by the probe."""

    ids_prompt: bool  # it takes token-id prompts; else text that must round-trip
    ids_tokens: bool  # it answers "token_id:N"; else token strings
    unlisted: frozenset[int]  # ids it leaves out of its echoed listing (llama-cpp-python: BOS)
    shifts: tuple[tuple[bool, int], ...]  # (prompt starts with an unlisted id?, s): the entry of
    # token i holds p(· | tokens < i + s). OpenAI's meaning is s = 0; llama-cpp-python 0.3 gives
    # s = 1 unless it stripped a leading BOS (its echo pairs each token with the next scores).

    def shift(self, tokens: list[int]) -> int | None:
        return dict(self.shifts).get(bool(tokens) and tokens[0] in self.unlisted)


class TokenTable:
    """The shared tokenizer seen as an engine sees it: each id's string, and the ids of a string."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special = set(tokenizer.all_special_ids) | {
            i for i, t in added.items() if getattr(t, "special", False)
        }
        pieces = tokenizer.batch_decode(
            [[i] for i in range(vocab_size)], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        self.strings = [plain(p) for p in pieces]
        self.ids_of: dict[str, list[int]] = defaultdict(list)
        for i, s in enumerate(self.strings):
            self.ids_of[s].append(i)
        for i in self.special:  # engines that skip special tokens print them as ""
            self.ids_of[""].append(i)
        self.ambiguous = sum(len(v) for v in self.ids_of.values() if len(v) > 1)

    def matches(self, token: int, text: str) -> bool:
        text = plain(text)
        return text == self.strings[token] or (text == "" and token in self.special)

    def id_of(self, text: str) -> int | None:
        """The one id a string names, or None when several share it."""
        ids = self.ids_of.get(plain(text), [])
        return ids[0] if len(ids) == 1 else None

    def text(self, tokens: list[int]) -> str:
        return str(
            self.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )

    def round_trips(self, tokens: list[int]) -> bool:
        return list(self.tokenizer.encode(self.text(tokens), add_special_tokens=False)) == tokens


def plain(text: str) -> str:
    """Token strings without U+FFFD: engines drop or replace the bytes of partial UTF-8 tokens."""
    return text.replace("\ufffd", "")


@dataclass(frozen=True)
class Entry:
    """One entry of an echoed listing: the token, its logprob, the top alternatives."""

    token: str
    logprob: float | None
    top: dict[str, float] | None


def parse_listing(body: bytes) -> list[Entry]:
    """The echoed tokens of a ``/v1/completions`` answer with ``logprobs``; anything else is garbage."""
    try:
        logprobs = orjson.loads(body)["choices"][0]["logprobs"]
        tokens, values, tops = logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]
        if not (
            isinstance(tokens, list)
            and isinstance(values, list)
            and isinstance(tops, list)
            and len(tokens) == len(values) == len(tops)
        ):
            raise TypeError("tokens, token_logprobs and top_logprobs must be lists of one length")
        entries = []
        for token, value, top in zip(tokens, values, tops):
            if (
                not isinstance(token, str)
                or not (value is None or isinstance(value, (int, float)))
                or not (top is None or isinstance(top, dict))
            ):
                raise TypeError(f"bad entry {token!r}, {value!r}")
            if top is not None and not all(
                isinstance(k, str) and isinstance(v, (int, float)) for k, v in top.items()
            ):
                raise TypeError(f"bad top_logprobs {top!r}"[:200])
            entries.append(Entry(token, None if value is None else float(value), top))
        return entries
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
        raise ReplicaFailure("garbage", f"the engine's logprobs are unusable: {exc}") from exc


def token_id(text: str) -> int | None:
    """The id of a "token_id:N" string, else None."""
    digits = text.removeprefix(_ID_PREFIX)
    return int(digits) if digits != text and digits.isdigit() else None
