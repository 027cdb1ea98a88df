"""Where a llama.cpp session's KV cells live (DESIGN §7, ``core.runners.llama_cpp_runner``): chain
sessions in streams of one shared context, tree sessions in contexts of their own (a pool lent
least recently used first), and the idle places that hold an ended session's chain as a prompt
cache; what a crop, ``keep`` and the end of a session leave in them."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, TypeVar

from core.errors import ModelLoadError
from core.runners.base import Rows, chain_rows, common_prefix, lend

DECODE_TOKENS = 32  # tokens per decode at most; 64 or more would change the logits (DESIGN §7)
TREE_SEQUENCES = 64  # sequence ids per context: the session's and one per tree leaf
TREE_ROOM = 256  # cells of a context beyond the session's context length, for tree rows
MAX_STREAMS = 64  # chain sessions held in the shared context at most
STREAMS_SHARE = 0.75  # of the memory cap, for the chain sessions' streams (the rest: tree contexts)
REFERENCE_SESSION = "\x00reference"


@dataclass
class Slot:
    """One llama.cpp context of the pool and the session whose rows it holds.

    Rows ``[0, rows)`` of the session are in KV. Its chain rows sit in cells ``0..`` in order
    (sequence 0); tree rows follow in the order they were decoded (``cell``)."""

    ctx: Any  # llama_cpp._internals.LlamaContext
    session_id: str | None = None
    rows: int = 0
    cell: dict[int, int] = field(default_factory=dict)  # tree row -> its KV cell
    below: dict[int, int] = field(default_factory=dict)  # tree row -> a leaf sequence through it
    leaves: dict[int, int] = field(default_factory=dict)  # tree leaf row -> its sequence
    last_used: int = 0
    cached: list[int] = field(default_factory=list)  # idle: the tokens of chain cells 0.. it holds (a prompt cache)

    def tree_seqs(self) -> set[int]:
        return set(self.below.values()) | set(self.leaves.values())

    def reset(self, session_id: str | None) -> None:
        self.session_id, self.rows, self.cached = session_id, 0, []
        self.cell.clear()
        self.below.clear()
        self.leaves.clear()
        self.ctx.kv_cache_clear()


@dataclass
class Stream:
    """One sequence id (= KV stream) of the shared context and the chain session it holds:
    rows ``[0, rows)`` of the session are its cells ``0..``, in order."""

    seq: int
    session_id: str | None = None
    rows: int = 0
    last_used: int = 0
    cached: list[int] = field(default_factory=list)  # idle: the tokens of cells 0.. it holds (a prompt cache)


_P = TypeVar("_P", Slot, Stream)


class CellPlaces:
    """Part of ``LlamaCppRunner``: the places of its sessions' cells."""

    _llama_cpp: Any
    _internals: Any
    _model: Any
    _n_threads: int
    _rows: dict[str, Rows]
    _slots: list[Slot]
    _shared: Any
    _streams: list[Stream]
    _tree_sessions: set[str]
    _clock: int
    reused_rows: int
    num_streams: int
    num_contexts: int
    n_ctx: int
    n_ctx_stream: int

    def is_full(self, chains: Collection[str], trees: Collection[str], tree: bool = False) -> bool:
        """A chain session needs a stream: full when live chain sessions hold every one. Tree
        sessions hold contexts of their own (``num_contexts``), lent LRU: never full."""
        return not tree and len(set(chains) - self._tree_sessions) >= self.num_streams

    def _stream_for(self, session_id: str, busy: list[str], rows: Rows, most: int) -> Stream:
        """The session's stream; else an idle one — the one whose cached cells share the most of
        the session's first ``most`` rows (kept), else an empty one, else the least recently used
        — else the least recently used one not in ``busy`` (its session is rebuilt from its rows
        on its next call)."""
        stream, common = self._idle_place(self._streams, session_id, rows.tokens, most)
        if stream is None:
            stream, _ = lend(self._streams, session_id, busy, self._release)
        elif stream.session_id is None:
            if self._shared is not None and stream.rows > common:
                self._llama_cpp.llama_memory_seq_rm(self._shared.memory, stream.seq, common, -1)
            stream.session_id, stream.rows, stream.cached = session_id, common, []
            self.reused_rows += common
        if self._shared is None:
            self._shared = self._new_context(self.num_streams * self.n_ctx_stream, self.num_streams, unified=False)
        stream.last_used = self._clock
        return stream

    def adopt(self, session_id: str, tokens: list[int]) -> int:
        if session_id in self._rows or session_id == REFERENCE_SESSION:  # held already
            return 0
        stream, common = self._idle_place(self._streams, session_id, tokens, len(tokens) - 1)
        if stream is None or stream.session_id is not None or common <= 0 or self._shared is None:
            return 0
        self._clock += 1
        self._llama_cpp.llama_memory_seq_rm(self._shared.memory, stream.seq, common, -1)
        stream.session_id, stream.rows, stream.cached, stream.last_used = session_id, common, [], self._clock
        self._rows[session_id] = chain_rows(tokens[:common])
        self.reused_rows += common
        return common

    def _idle_place(self, pool: list[_P], session_id: str, tokens: list[int], most: int) -> tuple[_P | None, int]:
        """The session's own place (and 0); else the idle place to lend it and how many of its
        cells the session keeps (≤ ``most``): the one that shares the longest start with it when
        that is at least half of what it holds, else an empty one, else the least recently used;
        (None, 0) when no place is idle."""
        held = next((p for p in pool if p.session_id == session_id), None)
        if held is not None:
            return held, 0
        idle = [p for p in pool if p.session_id is None]
        if not idle:
            return None, 0
        if session_id == REFERENCE_SESSION:  # the tests' reference decodes everything afresh
            hits = {id(p): 0 for p in idle}
        else:
            hits = {id(p): min(common_prefix(p.cached, tokens), most) for p in idle}
        best = max(idle, key=lambda p: (hits[id(p)], -p.last_used))
        if hits[id(best)] > 0 and 2 * hits[id(best)] >= len(best.cached):
            return best, hits[id(best)]  # the new session keeps most of what it holds
        # a short shared start (a chat template's first line) is not worth another prompt's cells
        spare = min(idle, key=lambda p: (bool(p.cached), p.last_used))  # an empty place, else the least recently used
        return spare, hits[id(spare)]

    def _stream_of(self, session_id: str) -> Stream | None:
        return next((s for s in self._streams if s.session_id == session_id), None)

    def _release(self, stream: Stream) -> None:
        if self._shared is not None and (stream.session_id is not None or stream.rows):
            self._llama_cpp.llama_memory_seq_rm(self._shared.memory, stream.seq, -1, -1)
        stream.session_id, stream.rows, stream.cached = None, 0, []

    def _to_tree_session(self, session_id: str) -> None:
        """From its first tree row on, a session lives in a context of its own."""
        if session_id not in self._tree_sessions:
            self._tree_sessions.add(session_id)
            stream = self._stream_of(session_id)
            if stream is not None:
                self._release(stream)

    # ----------------------------------------------------------------- keep, free

    def _keep_cache(self, session_id: str, rows: Rows, kept: list[int]) -> None:
        """Keep the kept rows whose cells are ``0, 1, …`` (no gap before them); the rest of a
        kept path leaves the cache and is decoded again, as chain rows, on the next forward."""
        stream = self._stream_of(session_id)
        if stream is not None:  # a chain session keeps a prefix
            if len(kept) < stream.rows:
                self._llama_cpp.llama_memory_seq_rm(self._shared.memory, stream.seq, len(kept), -1)
                stream.rows = len(kept)
            return
        slot = self._slot_of(session_id)
        if slot is None:
            return
        in_place = 0
        for i, row in enumerate(kept):
            cell = row if row < rows.chain else slot.cell.get(row, -1)
            if row >= slot.rows or cell != i:
                break
            in_place = i + 1
        memory, api = slot.ctx.memory, self._llama_cpp
        chain_kept = min(in_place, rows.chain)
        api.llama_memory_seq_rm(memory, 0, chain_kept, -1)
        if in_place > chain_kept:  # the path's first rows follow the prefix: they join sequence 0
            last = kept[in_place - 1]
            path_seq = slot.below[last]
            api.llama_memory_seq_rm(memory, path_seq, rows.depths[last] + 1, -1)
            api.llama_memory_seq_cp(memory, path_seq, 0, chain_kept, rows.depths[last] + 1)
        for seq in slot.tree_seqs():
            api.llama_memory_seq_rm(memory, seq, -1, -1)
        slot.cell.clear()
        slot.below.clear()
        slot.leaves.clear()
        slot.rows = in_place

    def _retire(self, session_id: str, rows: Rows) -> None:
        """The session ends: its place goes idle holding the cells of its chain (a prompt cache)."""
        if session_id == REFERENCE_SESSION:
            return
        self._clock += 1
        stream = self._stream_of(session_id)
        if stream is not None:
            stream.session_id, stream.cached, stream.last_used = None, rows.tokens[:stream.rows], self._clock
            return
        slot = self._slot_of(session_id)
        if slot is None:
            return
        kept = min(slot.rows, rows.chain)  # chain rows sit in sequence 0's cells 0.. in order
        memory, api = slot.ctx.memory, self._llama_cpp
        api.llama_memory_seq_rm(memory, 0, kept, -1)
        for seq in slot.tree_seqs():
            api.llama_memory_seq_rm(memory, seq, -1, -1)
        slot.cell.clear()
        slot.below.clear()
        slot.leaves.clear()
        slot.session_id, slot.rows, slot.cached, slot.last_used = None, kept, rows.tokens[:kept], self._clock

    def _free_cache(self, session_id: str) -> None:
        self._tree_sessions.discard(session_id)
        self._drop_cache(session_id)

    def _drop_cache(self, session_id: str) -> None:
        stream = self._stream_of(session_id)
        if stream is not None:
            self._release(stream)
        slot = self._slot_of(session_id)
        if slot is not None:
            slot.reset(None)

    # ----------------------------------------------------------------- the pool

    def _slot_of(self, session_id: str) -> Slot | None:
        return next((s for s in self._slots if s.session_id == session_id), None)

    def _slot_for(self, session_id: str, rows: Rows, most: int) -> Slot:
        """The session's context; else the idle one whose cached chain shares the most of its
        first ``most`` rows (kept); else an empty idle one, a new one while the pool has room, an
        idle one, the least recently used one (its session is rebuilt from its rows)."""
        self._clock += 1
        lead = 0 if self._slot_of(session_id) is not None else next((i for i, p in enumerate(rows.parents) if p != i - 1), len(rows))
        slot, common = self._idle_place(self._slots, session_id, rows.tokens, min(most, lead))
        if slot is not None and slot.session_id is None and common > 0:
            self._llama_cpp.llama_memory_seq_rm(slot.ctx.memory, 0, common, -1)
            slot.session_id, slot.rows, slot.cached = session_id, common, []
            rows.chain = max(rows.chain, common)  # they are a chain (a tree call's agreed rows come with parents): sequence 0's cells
            self.reused_rows += common
        elif slot is None or slot.session_id is None:
            if slot is None or slot.cached:  # grow before a cache is lost
                slot = self._new_slot() if len(self._slots) < self.num_contexts else (slot or self._lru_slot())
            slot.reset(session_id)  # the session it held keeps its rows: rebuilt on its next call
        slot.last_used = self._clock
        return slot

    def _lru_slot(self) -> Slot:
        return min(self._slots, key=lambda s: s.last_used)

    def _new_slot(self) -> Slot:
        # one stream of cells: a tree node may belong to several sequences
        slot = Slot(ctx=self._new_context(self.n_ctx, TREE_SEQUENCES, unified=True))
        self._slots.append(slot)
        return slot

    def _new_context(self, n_ctx: int, n_seq: int, unified: bool) -> Any:
        llama_cpp = self._llama_cpp
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = DECODE_TOKENS
        params.n_seq_max = n_seq
        params.n_outputs_max = max(n_seq, DECODE_TOKENS)  # llama.cpp asserts n_seq_max ≤ n_outputs_max
        params.kv_unified = unified  # False: a KV stream per sequence
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.n_threads = params.n_threads_batch = self._n_threads
        params.no_perf = True
        try:
            return self._internals.LlamaContext(model=self._model, params=params, verbose=False)
        except ValueError as exc:
            raise ModelLoadError(f"llama.cpp could not create a context of {n_ctx} cells: {exc}") from exc

