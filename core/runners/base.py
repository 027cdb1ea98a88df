"""The ModelRunner interface (docs/design.md §7): one per backend, used for the draft and the target.

A runner holds sessions: rows of tokens with their KV cache. Rows ``[0, chain)`` are a causal
chain; rows after it are tree rows, each attending to its ancestors only. The caller owns the
sequence; the runner's copy is a cache it may drop and rebuild from the tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

import torch

from core.errors import ContextOverflow
from core.math.tree import path_of


@dataclass(frozen=True)
class RunnerInfo:
    """What a loaded model is: reported by a worker's ``/v1/info``."""

    model_id: str
    backend: str
    vocab_size: int
    max_context: int
    eos_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.vocab_size <= 0 or self.max_context <= 0:
            raise ValueError(f"vocab_size and max_context must be > 0: {self}")


@dataclass(frozen=True)
class ForwardItem:
    """One session's share of a ``forward``. ``prefix_len``: held rows to keep (later ones are
    dropped first). ``parents``: per new row, the absolute row it follows; ``None`` = a chain.
    ``logits_at``: which new rows (0-based among the new) return logits; ``None`` = the last."""

    session_id: str
    prefix_len: int
    tokens: list[int]
    parents: list[int] | None = None
    logits_at: list[int] | None = None
    # [len(tokens), hidden]: a pipeline stage's input states (stages after the first)
    hidden: torch.Tensor | None = None
    # its logits as this item alone would get them, whatever shares the step (a seeded call:
    # docs/performance.md)
    alone: bool = False


@dataclass
class Rows:
    """A session's rows: tokens, parent rows (−1 for row 0), depths (= positions)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    chain: int = 0  # rows [0, chain) are a causal chain; later rows are tree rows

    def __len__(self) -> int:
        return len(self.tokens)

    def truncate(self, length: int) -> None:
        del self.tokens[length:], self.parents[length:], self.depths[length:]
        self.chain = min(self.chain, length)

    def extend(self, tokens: list[int], parents: list[int]) -> None:
        for token, parent in zip(tokens, parents):
            self.tokens.append(int(token))
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1 if parent >= 0 else 0)


@dataclass
class Staged:
    """An item whose rows were added: its session, the rows, where they start, logits rows."""

    session_id: str
    rows: Rows
    start: int
    logits_rows: list[int]
    hidden: torch.Tensor | None = None  # a stage's input states of rows [start, len(rows))
    alone: bool = False  # ForwardItem.alone


class ModelRunner(ABC):
    """Forward rows (chains and trees), keep a path, free a session."""

    info: RunnerInfo
    tokenizer: Any  # the HF tokenizer; the same object for every runner of one model
    # a pipeline stage's layers [first, end); None = the whole model
    layer_range: tuple[int, int] | None = None
    # ``forward_each``'s logits stay where the model computed them (its caller scores them there); else on the
    # host
    logits_on_device = False
    keeps_subtrees = False  # ``keep`` takes a prefix plus a subtree (FlowSpec's prune), not only a path
    hidden_size = 0  # the model's hidden states' width (what a stage passes on)
    num_layers: int | None = None  # the whole model's decoder layers, where the backend says (a stage must)
    threads: int | None = None  # the CPU threads its model and torch's pool run on (``load_runner`` sets it)
    # time.monotonic() when a runner that decodes a forward in parts (llama.cpp) last finished one
    progress_at = 0.0
    _kv_bytes = 0  # KV cache bytes per row
    has_weights = True  # False: a tokenizer alone (``draft.model: none``)

    def step_info(self) -> dict[str, Any]:
        """How this runner's forward runs, for ``/v1/info``."""
        return {"forward": self.info.backend}

    @property
    def is_first_stage(self) -> bool:
        """A stage that embeds tokens (the whole model does too)."""
        return self.layer_range is None or self.layer_range[0] == 0

    @property
    def is_last_stage(self) -> bool:
        """A stage that ends with the head and answers logits (the whole model does too)."""
        return True

    def __init__(self) -> None:
        self._rows: dict[str, Rows] = {}

    @cached_property
    def fingerprint(self) -> str:
        """The tokenizer fingerprint (docs/design.md §4) that gateway and workers must share."""
        from core.runners.tokenizer import per_tokenizer, tokenizer_fingerprint

        return per_tokenizer(self.tokenizer, ("fingerprint",), lambda: tokenizer_fingerprint(self.tokenizer))

    def has_session(self, session_id: str) -> bool:
        return session_id in self._rows

    def tokens(self, session_id: str) -> list[int]:
        """The tokens of the session's rows (a copy); empty for an unknown session."""
        return list(self._rows.get(session_id, Rows()).tokens)

    def context(self, session_id: str, row: int) -> list[int]:
        """The tokens row ``row`` reads: its ancestors' and its own, from row 0."""
        rows = self._rows[session_id]
        return [rows.tokens[r] for r in path_of(row, rows.parents)]

    def length(self, session_id: str) -> int:
        return len(self._rows.get(session_id, Rows()))

    def sequence_length(self, session_id: str) -> int:
        """Rows that read as one sequence from row 0 (each the child of the row before)."""
        rows = self._rows.get(session_id, Rows())
        n = rows.chain
        while n < len(rows) and rows.parents[n] == n - 1:
            n += 1
        return n

    def tree_nodes(self, session_id: str, base: int) -> tuple[list[int], list[int]] | None:
        """The tree after the first ``base`` rows: tokens and parents (−1 = row ``base − 1``); None unless
        ``[0, base)`` is one sequence."""
        rows = self._rows.get(session_id, Rows())
        if not 0 < base < len(rows):
            return None
        if (
            any(rows.parents[i] != i - 1 for i in range(rows.chain, base))
            or min(rows.parents[base:]) < base - 1
        ):
            return None
        return rows.tokens[base:], [p - base for p in rows.parents[base:]]

    def session_ids(self) -> list[str]:
        return list(self._rows)

    def forward(self, items: Sequence[ForwardItem]) -> list[torch.Tensor]:
        """Append each item's rows; per item, fp32 logits ``[len(logits_at), V]``."""
        return [self._forward_item(item) for item in items]

    def forward_each(self, items: Sequence[ForwardItem]) -> list[torch.Tensor | Exception]:
        """``forward`` of items of distinct sessions: per item its logits, or the exception that left its
        session as it was."""
        out: list[torch.Tensor | Exception | None] = [None] * len(items)
        staged: list[tuple[int, Staged]] = []
        for i, item in enumerate(items):
            try:
                staged.append((i, self._stage(item)))
            except Exception as exc:  # noqa: BLE001 - handed to the item's caller
                out[i] = exc
        try:
            results = self._compute_each([work for _, work in staged])
        except BaseException:
            for _, work in staged:
                self._unstage(work)
            raise
        for (i, work), result in zip(staged, results):
            if isinstance(result, Exception):
                self._unstage(work)
            out[i] = result
        return [r for r in out if r is not None]

    def keep(self, session_id: str, rows: Sequence[int]) -> None:
        """Compact the session to ``rows``: a root-to-row path (it becomes a chain), or where
        ``keeps_subtrees`` a path plus a subtree."""
        held = self._rows.get(session_id)
        if held is None:
            if len(rows):
                raise ValueError(f"session {session_id!r} holds no rows to keep")
            return
        if isinstance(rows, range) and rows.start == 0 and rows.step == 1 and 0 <= rows.stop <= held.chain:
            # a crop within the chain: nothing to check row by row
            self._keep_prefix(session_id, held, rows.stop)
            return
        kept = [int(r) for r in rows]
        place = {row: i for i, row in enumerate(kept)}
        path = True
        for i, row in enumerate(kept):
            if not 0 <= row < len(held) or (i and row <= kept[i - 1]):
                raise ValueError(
                    f"rows to keep must be increasing rows of the session: row {row} at place {i}"
                )
            parent = held.parents[row]
            if parent != (kept[i - 1] if i else -1):
                path = False
                if not self.keeps_subtrees:
                    raise ValueError(
                        f"rows to keep must be a root-to-row path of the session: row {row} at place {i}"
                    )
                if parent not in place:
                    raise ValueError(f"rows to keep must hold each kept row's parent: row {row} at place {i}")
        if kept == list(range(len(held))) and held.chain == len(held):
            return
        self._keep_cache(session_id, held, kept)
        if kept == list(range(len(kept))):
            held.truncate(len(kept))
            if path:
                held.chain = len(kept)
        else:  # renumbered: a path comes out a chain
            self._rows[session_id] = _pruned(held, kept, place)

    def _keep_prefix(self, session_id: str, held: Rows, length: int) -> None:
        """``keep`` of the chain's first ``length`` rows: a path, so a chain (what every crop of a chain
        session is)."""
        if length == len(held):
            return
        self._keep_cache(session_id, held, range(length))
        held.truncate(length)
        held.chain = length

    def adopt(self, session_id: str, tokens: list[int]) -> int:
        """How many of ``tokens`` (< ``len(tokens)``) a new session takes from a prompt cache as held rows; 0
        without one."""
        return 0

    def expect_tree(self, session_id: str) -> None:  # noqa: B027 - a hook, nothing by default
        """The session's rows will hold a tree (its prompt comes first, in pieces): a runner that keeps tree
        sessions apart (llama.cpp: a context of their own) places it there from its first rows, not after
        them."""

    def free(self, session_id: str) -> None:
        """Forget the session and release its KV cache (a prompt cache may keep it: ``_retire``)."""
        rows = self._rows.pop(session_id, None)
        if rows is not None:
            self._retire(session_id, rows)
            self._free_cache(session_id)

    def prefill(self, session_id: str, tokens: list[int], num_logits: int = 1) -> torch.Tensor:
        """Start ``session_id`` afresh with ``tokens``; logits of the last ``num_logits``."""
        self.free(session_id)
        return self.append(session_id, tokens, num_logits)

    def append(self, session_id: str, tokens: list[int], num_logits: int) -> torch.Tensor:
        """Append a chain; fp32 logits ``[num_logits, V]`` of the last positions (held ones fed again if need
        be)."""
        return self._forward_item(self.append_item(session_id, tokens, num_logits))

    def append_item(self, session_id: str, tokens: list[int], num_logits: int) -> ForwardItem:
        """The ``ForwardItem`` that ``append`` forwards (for a batch of several sessions)."""
        held = self.tokens(session_id)
        total = len(held) + len(tokens)
        if not 0 < num_logits <= total:
            raise ValueError(f"num_logits {num_logits} outside [1, {total}]")
        rows = self._rows.get(session_id)
        if rows is not None and rows.chain < len(rows):
            raise ValueError(f"session {session_id!r} holds tree rows: keep a path before appending a chain")
        prefix = min(len(held), total - num_logits)
        new = held[prefix:] + [int(t) for t in tokens]
        return ForwardItem(session_id, prefix, new, logits_at=list(range(len(new) - num_logits, len(new))))

    def crop(self, session_id: str, length: int) -> None:
        """Keep the first ``length`` rows of the session (and their KV entries)."""
        if length < self.length(session_id):
            self.keep(session_id, range(max(length, 0)))

    def is_full(self, chains: Collection[str], trees: Collection[str], tree: bool = False) -> bool:
        """Whether a new session (``tree``: a tree call) would take the KV place of one of the live ``chains``
        and ``trees``."""
        return False

    @property
    def session_places(self) -> int | None:
        """How many live sessions the KV cache holds before a new one is refused (``is_full``); None: no such
        limit."""
        return None

    def places_held(self, chains: Collection[str], trees: Collection[str]) -> int:
        """How many of ``session_places`` the live ``chains`` and ``trees`` hold."""
        return len(set(chains) | set(trees))

    def memory_bytes(self) -> int:
        """Bytes held by session caches (what a memory cap counts)."""
        return sum(len(r) for r in self._rows.values()) * self.kv_bytes_per_token()

    def free_all(self) -> None:
        for session_id in self.session_ids():
            self.free(session_id)

    def warm_up(self) -> None:
        """A prefill and a decode, so the first request does not pay seconds to page in weights (issue 33);
        whole models only."""
        if self.layer_range is not None or not self.has_weights:
            return
        session = "__warm_up__"
        ids = [i % self.info.vocab_size for i in range(1, 41)]  # 40 tokens: a decode batch of 32, then 8
        try:
            self.prefill(session, ids, num_logits=1)
            self.append(session, ids[:5], num_logits=5)
        finally:
            self.free(session)

    def close(self) -> None:
        """Free every session and what the backend holds; the runner is unusable after."""
        self.free_all()

    def _forward_item(self, item: ForwardItem) -> torch.Tensor:
        result = self.forward_each([item])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def _stage(self, item: ForwardItem) -> Staged:
        """Check an item and add its rows to the session's (the cache follows in ``_compute``)."""
        rows = self._rows.setdefault(item.session_id, Rows())
        start, count = item.prefix_len, len(item.tokens)
        if not 0 <= start <= len(rows):
            raise ValueError(f"prefix_len {start} outside [0, {len(rows)}]")
        if count == 0:
            raise ValueError("a forward appends at least one row")
        if start + count > self.info.max_context:
            raise ContextOverflow(
                f"session would hold {start + count} tokens, the context is {self.info.max_context}",
                param="draft",
            )
        parents = _checked_parents(item.parents, start, count)
        logits_at = [count - 1] if item.logits_at is None else [int(i) for i in item.logits_at]
        if not logits_at or not all(0 <= i < count for i in logits_at):
            raise ValueError(f"logits_at must name new rows in [0, {count})")
        if item.hidden is not None and item.hidden.shape[0] != count:
            # checked before the rows change: a refused item leaves them
            raise ValueError(f"hidden states for {item.hidden.shape[0]} rows, {count} new rows")
        if start < len(rows):
            self.keep(item.session_id, range(start))
            rows = self._rows[item.session_id]
        as_chain = item.parents is None and rows.chain == start
        rows.extend(item.tokens, parents)
        if as_chain:
            rows.chain = len(rows)
        return Staged(item.session_id, rows, start, [start + i for i in logits_at], item.hidden, item.alone)

    def _unstage(self, work: Staged) -> None:
        """After a failed compute: the rows as they were, the cache rebuilt on the next call."""
        self._drop_cache(work.session_id)
        work.rows.truncate(work.start)

    # ----------------------------------------------------------------- per backend: _compute or _compute_each

    def _compute_each(self, work: list[Staged]) -> list[torch.Tensor | Exception]:
        """``_compute`` of staged items of distinct sessions; per item its logits or its error."""
        out: list[torch.Tensor | Exception] = []
        for w in work:
            try:
                out.append(self._compute(w.session_id, w.rows, w.start, w.logits_rows))
            except Exception as exc:  # noqa: BLE001 - handed to the item's caller
                out.append(exc)
        return out

    def _compute(self, session_id: str, rows: Rows, start: int, logits_rows: list[int]) -> torch.Tensor:
        """Bring the session's cache up to ``rows`` (new from ``start``); logits of ``logits_rows``."""
        raise NotImplementedError("a runner overrides _compute or _compute_each")

    def _keep_cache(self, session_id: str, rows: Rows, kept: Sequence[int]) -> None:  # noqa: B027 - a hook, nothing by default
        """Compact the cache to the ``kept`` rows (checked; a ``range`` for a prefix of the chain) before
        ``rows`` changes."""

    def _free_cache(self, session_id: str) -> None:  # noqa: B027 - a hook, nothing by default
        """Release the session's KV place."""

    def _retire(self, session_id: str, rows: Rows) -> None:  # noqa: B027 - a hook, nothing by default
        """Before ``_free_cache`` of a session that ends: a prompt cache detaches its place here, keeping its
        chain's cells."""

    def _drop_cache(self, session_id: str) -> None:
        """Forget the KV entries (not the rows): after a failed forward."""
        self._free_cache(session_id)

    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes

    @abstractmethod
    def forward_full(self, tokens: list[int], num_logits: int) -> torch.Tensor:
        """A fresh, sessionless forward pass over ``tokens``: the reference for tests/bench."""


@dataclass
class Place:
    """A KV place in a fixed pool (a llama.cpp stream or context, a transformers slot)."""

    session_id: str | None = None
    rows: int = 0  # rows [0, rows) of its session are in its cells
    last_used: int = 0


P = TypeVar("P", bound=Place)


def lend(
    pool: Sequence[P], session_id: str, busy: Collection[str], release: Callable[[P], None]
) -> tuple[P, bool]:
    """The session's place in ``pool``, else a free one, else the LRU one not ``busy`` (released); True when
    newly lent."""
    held = held_by(pool, session_id)
    if held is not None:
        return held, False
    free = [p for p in pool if p.session_id is None]
    place = free[0] if free else min((p for p in pool if p.session_id not in busy), key=lambda p: p.last_used)
    release(place)
    place.session_id = session_id
    return place, True


def held_by(pool: Iterable[P], session_id: str) -> P | None:
    """The place of ``pool`` that holds ``session_id``."""
    return next((p for p in pool if p.session_id == session_id), None)


def in_turns(
    work: list[Staged],
    out: list[torch.Tensor | Exception | None],
    ready: list[int],
    size: int,
    run: Callable[[list[Staged]], Sequence[torch.Tensor | Exception]],
) -> list[torch.Tensor | Exception]:
    """``out`` with its ``ready`` items run in groups of at most ``size``; a group that fails fails each of
    its items."""
    for begin in range(0, len(ready), size):
        group = ready[begin : begin + size]
        try:
            results = list(run([work[i] for i in group]))
        except Exception as exc:  # noqa: BLE001 - a failed forward fails the items it carried
            results = [exc] * len(group)
        for i, result in zip(group, results):
            out[i] = result
    return [o for o in out if o is not None]


def _pruned(held: Rows, kept: list[int], place: dict[int, int]) -> Rows:
    """The kept rows renumbered (parents by their new places, depths as they were)."""
    rows = Rows(
        tokens=[held.tokens[r] for r in kept],
        parents=[place[held.parents[r]] if held.parents[r] >= 0 else -1 for r in kept],
        depths=[held.depths[r] for r in kept],
    )
    rows.chain = next((i for i, parent in enumerate(rows.parents) if parent != i - 1), len(rows))
    return rows


def _checked_parents(parents: list[int] | None, start: int, count: int) -> list[int]:
    if parents is None:
        return list(range(start - 1, start + count - 1))
    if len(parents) != count:
        raise ValueError(f"parents has {len(parents)} entries for {count} new rows")
    out = [int(p) for p in parents]
    for i, parent in enumerate(out):
        if not (0 <= parent < start + i or (parent == -1 and start + i == 0)):
            raise ValueError(f"parents[{i}] = {parent}: a new row follows an earlier row")
    return out


def common_prefix(*sequences: Sequence[int]) -> int:
    """How many leading tokens every sequence shares."""
    shortest = min(len(s) for s in sequences)
    return next((i for i in range(shortest) if any(s[i] != sequences[0][i] for s in sequences)), shortest)
