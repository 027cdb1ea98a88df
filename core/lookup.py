"""Lookup drafting (docs/design.md §3.10): ``PromptLookup`` (vLLM's ``ngram``) matches the context's last
n-gram in its own context; ``SuffixIndex`` (vLLM's ``suffix``) continues its longest suffix found in recent
outputs."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LookupParams:
    """``min_n``..``max_n``: the n-gram lengths matched (longest first); ``max_tokens``: L, the
    tokens proposed at most; the suffix index keeps ``max_index_tokens`` tokens of outputs in
    substrings of at most ``depth`` tokens."""

    min_n: int = 1
    max_n: int = 4
    max_tokens: int = 8
    depth: int = 12
    max_index_tokens: int = 65536

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"lookup n-grams need 1 ≤ min_n ≤ max_n, got {self.min_n}..{self.max_n}")
        if self.max_tokens < 1 or self.depth < 2 or self.max_index_tokens < 1:
            raise ValueError("lookup max_tokens ≥ 1, depth ≥ 2 and max_index_tokens ≥ 1")


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    match: int  # tokens of the context matched (0: nothing found)


NO_PROPOSAL = Proposal([], 0)


class PromptLookup:
    """One session's context indexed by its n-grams, kept in step with ``sync``."""

    def __init__(self, params: LookupParams | None = None) -> None:
        self.params = params or LookupParams()
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> the positions it ends at, in order

    def sync(self, context: list[int]) -> None:
        """Make the indexed tokens ``context``: what differs is taken back (a rejected draft), what is new is
        added."""
        common = next(
            (i for i, (held, wanted) in enumerate(zip(self.tokens, context)) if held != wanted),
            min(len(self.tokens), len(context)),
        )
        while len(self.tokens) > common:
            self._pop()
        for token in context[common:]:
            self._append(token)

    def propose(self, count: int) -> Proposal:
        """Up to ``count`` tokens that followed the longest n-gram ending the context, at its most recent
        earlier place."""
        end = len(self.tokens) - 1
        for n in range(min(self.params.max_n, end), self.params.min_n - 1, -1):
            ends = self._ends.get(tuple(self.tokens[-n:]), [])
            if len(ends) >= 2:  # the last is the context's own end
                start = ends[-2] + 1
                return Proposal(self.tokens[start : start + min(count, self.params.max_tokens)], n)
        return NO_PROPOSAL

    def _grams(self, end: int) -> list[tuple[int, ...]]:
        return [
            tuple(self.tokens[end - n + 1 : end + 1])
            for n in range(self.params.min_n, min(self.params.max_n, end + 1) + 1)
        ]

    def _append(self, token: int) -> None:
        self.tokens.append(token)
        end = len(self.tokens) - 1
        for gram in self._grams(end):
            self._ends.setdefault(gram, []).append(end)

    def _pop(self) -> None:
        end = len(self.tokens) - 1
        for gram in self._grams(end):
            ends = self._ends[gram]
            ends.pop()
            if not ends:
                del self._ends[gram]
        self.tokens.pop()


@dataclass(slots=True)
class _Node:
    count: int = 0
    children: dict[int, _Node] = field(default_factory=dict)


class SuffixIndex:
    """Recent outputs in a trie of every substring of ≤ ``depth`` tokens, with counts."""

    def __init__(self, params: LookupParams | None = None) -> None:
        self.params = params or LookupParams()
        self._root = _Node()
        self._held: deque[list[int]] = deque()
        self.num_tokens = 0
        self.num_nodes = 0

    def add(self, tokens: list[int]) -> None:
        """Index one output; the oldest leave while more than ``max_index_tokens`` are held."""
        tokens = list(tokens[-self.params.max_index_tokens :])
        if not tokens:
            return
        self._count(tokens, +1)
        self._held.append(tokens)
        self.num_tokens += len(tokens)
        while self.num_tokens > self.params.max_index_tokens:
            oldest = self._held.popleft()
            self._count(oldest, -1)
            self.num_tokens -= len(oldest)

    def propose(self, context: list[int], count: int) -> Proposal:
        """The longest suffix of ``context`` (< ``depth``) in the index, continued by the most frequent next
        token, up to ``count`` tokens."""
        count = min(count, self.params.max_tokens)
        for m in range(min(self.params.depth - 1, len(context)), 0, -1):
            node: _Node | None = self._root
            for token in context[-m:]:
                node = node.children.get(token) if node is not None else None
            if node is None or not node.children:
                continue
            out: list[int] = []
            while len(out) < count and node.children:
                token, node = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))
                out.append(token)
            return Proposal(out, m)
        return NO_PROPOSAL

    def _count(self, tokens: list[int], step: int) -> None:
        for begin in range(len(tokens)):
            node = self._root
            for token in tokens[begin : begin + self.params.depth]:
                child = node.children.get(token)
                if child is None:
                    if step < 0:  # never: what leaves was added
                        break
                    child = node.children[token] = _Node()
                    self.num_nodes += 1
                child.count += step
                if child.count == 0:
                    self.num_nodes -= _size(child)
                    del node.children[token]
                    break
                node = child


def _size(node: _Node) -> int:
    return 1 + sum(_size(child) for child in node.children.values())


class AcceptanceStats:
    """Measured acceptance by kind, with a prior worth ``weight`` observations; counts halve past ``horizon``,
    clear past ``max_keys`` kinds."""

    def __init__(self, weight: float = 2.0, horizon: int = 2000, max_keys: int = 4096) -> None:
        self.weight, self.horizon, self.max_keys = weight, horizon, max_keys
        self._counts: dict[Hashable, list[float]] = {}  # key -> [tested, accepted]

    def observe(self, key: Hashable, accepted: bool) -> None:
        counts = self._counts.get(key)
        if counts is None:
            if len(self._counts) >= self.max_keys:
                self._counts.clear()
            counts = self._counts[key] = [0.0, 0.0]
        counts[0] += 1
        counts[1] += accepted
        if counts[0] >= self.horizon:
            counts[0] /= 2
            counts[1] /= 2

    def rate(self, key: Hashable, prior: float, measured: bool = True) -> float:
        """Posterior mean acceptance of ``key``'s kind (``prior`` alone unless ``measured``: a seeded
        request's draft must not depend on earlier ones)."""
        counts = self._counts.get(key) if measured else None
        return prior if counts is None else (counts[1] + self.weight * prior) / (counts[0] + self.weight)
