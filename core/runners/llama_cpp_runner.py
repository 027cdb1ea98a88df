"""The ``llama.cpp`` backend (DESIGN §7): GGUF on CPU, the fast path for chains and small trees.

Three facts of llama.cpp shape it (measured here, ``research/tree-and-pipeline.md`` §1):
1. With flash attention **enabled**, decodes of 1 to 63 tokens give bit-identical logits for the
   same positions, and decodes of 64 or more do not. So flash attention is pinned on and every
   decode — prefill chunks and trees included — holds at most ``DECODE_TOKENS`` (32) tokens.
2. A position's logits also depend on the **order of its context's KV cells**: a token placed
   in a freed cell before cells of earlier positions scores differently (max |Δlogit| ≈ 1). A
   unified cache shared by sessions reuses one session's freed cells for another, so no two
   sessions share one stream of cells:
   - **chain sessions** (every mode but ``tree``) are the sequence ids of one shared context
     with a KV stream per sequence (``kv_unified = False``): each session's cells are its
     positions in order, and one decode carries the rows of many sessions (the worker's
     scheduler steps, DESIGN §9). Measured: bit-identical to a context of its own, whatever
     the batch-mates, in decodes of uneven shares;
   - **tree sessions** (from their first tree row on) each have a unified context of their own
     (a bounded pool, least recently used lent first: the session that loses it is rebuilt
     from its rows): a crop frees the tail, and ``keep`` of a tree path keeps the path's cells
     only while they follow the prefix without a gap — the rest of the path is decoded again,
     as a chain. Their decodes do not batch.
   When more chain sessions want a stream than there are, the least recently used one is
   rebuilt from its rows on its next call, the same way.
4. **Prompt cache**: a session that ends leaves its chain's cells where they are (its stream or
   context goes idle holding them, as llama.cpp's server keeps a slot's prompt); a new session
   takes the idle place whose cells share the longest prefix with its tokens, drops the rest and
   decodes only what follows. The cells kept are the prefix's positions in order, as a crop keeps
   them, so the rows score bit for bit as decoded afresh. A long shared system prompt (tools) is
   then prefilled once, not per request.
3. Inside a tree session's context, a tree is one sequence id per root-to-leaf path
   (``kv_unified``); a node carries the ids of every leaf below it, so it attends to its
   ancestors only.

With these, a position scores the same token by token, in a prefill, rebuilt after an
eviction, a 409 resend or a failover, and as a tree node. Only the rows asked for produce
logits (llama.cpp's per-token output flags), so no ``n_ctx × V`` logits array is allocated.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from core.errors import ContextOverflow, ModelLoadError
from core.names import Backend
from core.runners.base import ModelRunner, Rows, RunnerInfo, Staged, chain_rows, common_prefix, lend
from core.runners.llama_cpp_tools import quiet_llama_cpp
from core.runners.models import ModelSource
from core.runners.tokenizer import eos_ids

log = logging.getLogger(__name__)

DECODE_TOKENS = 32  # tokens per decode at most; 64 or more would change the logits (DESIGN §7)
TREE_SEQUENCES = 64  # sequence ids per context: the session's and one per tree leaf
_TREE_ROOM = 256  # cells of a context beyond the session's context length, for tree rows
MAX_STREAMS = 64  # chain sessions held in the shared context at most
_STREAMS_SHARE = 0.75  # of the memory cap, for the chain sessions' streams (the rest: tree contexts)
_REFERENCE_SESSION = "\x00reference"


@dataclass
class _Slot:
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
class _Stream:
    """One sequence id (= KV stream) of the shared context and the chain session it holds:
    rows ``[0, rows)`` of the session are its cells ``0..``, in order."""

    seq: int
    session_id: str | None = None
    rows: int = 0
    last_used: int = 0
    cached: list[int] = field(default_factory=list)  # idle: the tokens of cells 0.. it holds (a prompt cache)


_P = TypeVar("_P", _Slot, _Stream)


class LlamaCppRunner(ModelRunner):
    def __init__(
        self,
        source: ModelSource,
        tokenizer: Any,
        max_context: int = 2048,
        memory_cap_mb: int = 1024,
        n_threads: int | None = None,
    ) -> None:
        super().__init__()
        if not source.is_gguf:
            raise ModelLoadError(f"the llama.cpp backend needs a GGUF file, got {source.name!r}")
        import llama_cpp
        from llama_cpp import _internals

        quiet_llama_cpp()
        self._llama_cpp = llama_cpp
        self._internals = _internals
        self.tokenizer = tokenizer
        self._model = _load_model(_internals, llama_cpp, str(source.path))
        vocab_size = int(self._model.n_vocab())
        self.info = RunnerInfo(
            model_id=source.name,
            backend=Backend.LLAMA_CPP.value,
            vocab_size=vocab_size,
            max_context=min(max_context, int(self._model.n_ctx_train())),
            eos_ids=eos_ids(tokenizer, [int(self._model.token_eos())]),
        )
        model = self._model.model
        self._kv_bytes = (
            2 * llama_cpp.llama_model_n_layer(model) * llama_cpp.llama_model_n_head_kv(model)
            * (llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model)) * 2
        )
        self.n_ctx = -(-(self.info.max_context + _TREE_ROOM) // 256) * 256
        self.n_ctx_stream = -(-self.info.max_context // 256) * 256
        # measured here: a context costs its KV cache plus its output and compute buffers
        cap = memory_cap_mb * 2**20
        context_bytes = self.n_ctx * self._kv_bytes + 2 * TREE_SEQUENCES * vocab_size * 4
        self.num_contexts = max(1, int(cap * (1 - _STREAMS_SHARE)) // context_bytes)
        self.num_streams = max(1, min(MAX_STREAMS, int(cap * _STREAMS_SHARE) // (self.n_ctx_stream * self._kv_bytes)))
        self._n_threads = n_threads or os.cpu_count() or 1
        self._batch = _internals.LlamaBatch(n_tokens=DECODE_TOKENS, embd=0, n_seq_max=TREE_SEQUENCES, verbose=False)
        self._slots: list[_Slot] = []
        self._shared: Any = None  # the chain sessions' context (made on first use)
        self._streams = [_Stream(seq) for seq in range(self.num_streams)]
        self._tree_sessions: set[str] = set()  # sessions that held tree rows: they live in _slots
        self._clock = 0
        self.reused_rows = 0  # rows a new session took from the prompt cache, since start
        self.max_decode_tokens = 0  # the largest decode issued so far (tests assert ≤ DECODE_TOKENS)

    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes

    def memory_bytes(self) -> int:
        # KV lives in the fixed pool; what grows with sessions is their rows
        return sum(len(r) for r in self._rows.values()) * 8

    # ----------------------------------------------------------------- forward

    def _compute(self, session_id: str, rows: Rows, start: int, logits_rows: list[int]) -> torch.Tensor:
        result = self._compute_each([Staged(session_id, rows, start, logits_rows)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def _compute_each(self, work: list[Staged]) -> list[torch.Tensor | Exception]:
        """Chain sessions' rows share decodes (``_decode_streams``); tree sessions decode alone."""
        out: list[torch.Tensor | Exception | None] = [None] * len(work)
        chains: list[int] = []
        for i, w in enumerate(work):
            if w.session_id in self._tree_sessions or w.rows.chain < len(w.rows):
                self._to_tree_session(w.session_id)
                try:
                    out[i] = self._compute_alone(w.session_id, w.rows, w.logits_rows)
                except Exception as exc:  # noqa: BLE001 - the item's own
                    out[i] = exc
            else:
                chains.append(i)
        for begin in range(0, len(chains), self.num_streams):  # more sessions than streams: in turns
            group = chains[begin:begin + self.num_streams]
            try:
                logits = self._decode_streams([work[i] for i in group])
            except Exception as exc:  # noqa: BLE001 - a failed decode fails the items it carried
                logits = [exc] * len(group)
            for i, result in zip(group, logits):
                out[i] = result
        return [r for r in out if r is not None]

    def _compute_alone(self, session_id: str, rows: Rows, logits_rows: list[int]) -> torch.Tensor:
        slot = self._slot_for(session_id, rows, min(logits_rows))
        wanted, out = set(logits_rows), dict[int, np.ndarray]()
        if slot.rows < rows.chain:
            self._decode_chain(slot, rows, wanted, out)
        if slot.rows < len(rows):
            self._decode_tree(slot, rows, wanted, out)
        return torch.from_numpy(np.stack([out[r] for r in logits_rows]))

    def _decode_streams(self, work: list[Staged]) -> list[torch.Tensor | Exception]:
        """Chain sessions (at most one per stream) in shared decodes of ≤ ``DECODE_TOKENS`` tokens:
        each session's new rows at position = row in its own stream, split across decodes
        wherever the budget falls (a position scores the same in any decode below 64 tokens)."""
        self._clock += 1
        streams = [self._stream_for(w.session_id, [x.session_id for x in work], w.rows, min(w.logits_rows)) for w in work]
        entries: list[tuple[int, int, Any, bool]] = []
        owners: list[tuple[int, int]] = []  # per entry: (work index, row)
        for i, (w, stream) in enumerate(zip(work, streams)):
            wanted = set(w.logits_rows)
            for row in range(stream.rows, len(w.rows)):
                entries.append((w.rows.tokens[row], row, (stream.seq,), row in wanted))
                owners.append((i, row))
        got: list[dict[int, np.ndarray]] = [{} for _ in work]
        try:
            for begin in range(0, len(entries), DECODE_TOKENS):
                chunk = slice(begin, begin + DECODE_TOKENS)
                logits: dict[int, np.ndarray] = {}
                self._decode(self._shared, entries[chunk], list(range(begin, begin + len(entries[chunk]))), logits)
                for k, row_logits in logits.items():
                    i, row = owners[k]
                    got[i][row] = row_logits
        except BaseException:
            for stream in streams:
                self._release(stream)
            raise
        for w, stream in zip(work, streams):
            stream.rows = len(w.rows)
        return [torch.from_numpy(np.stack([got[i][r] for r in w.logits_rows])) for i, w in enumerate(work)]

    def is_full(self, chains: Collection[str], trees: Collection[str], tree: bool = False) -> bool:
        """A chain session needs a stream: full when live chain sessions hold every one. Tree
        sessions hold contexts of their own (``num_contexts``), lent LRU: never full."""
        return not tree and len(set(chains) - self._tree_sessions) >= self.num_streams

    def _stream_for(self, session_id: str, busy: list[str], rows: Rows, most: int) -> _Stream:
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
        if self.has_session(session_id) or session_id == _REFERENCE_SESSION:
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
        if session_id == _REFERENCE_SESSION:  # the tests' reference decodes everything afresh
            hits = {id(p): 0 for p in idle}
        else:
            hits = {id(p): min(common_prefix(p.cached, tokens), most) for p in idle}
        best = max(idle, key=lambda p: (hits[id(p)], -p.last_used))
        if hits[id(best)] > 0 and 2 * hits[id(best)] >= len(best.cached):
            return best, hits[id(best)]  # the new session keeps most of what it holds
        # a short shared start (a chat template's first line) is not worth another prompt's cells
        spare = min(idle, key=lambda p: (bool(p.cached), p.last_used))  # an empty place, else the least recently used
        return spare, hits[id(spare)]

    def _stream_of(self, session_id: str) -> _Stream | None:
        return next((s for s in self._streams if s.session_id == session_id), None)

    def _release(self, stream: _Stream) -> None:
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

    def _decode_chain(self, slot: _Slot, rows: Rows, wanted: set[int], out: dict[int, np.ndarray]) -> None:
        """Rows ``[slot.rows, rows.chain)`` in sequence 0, position = row = cell."""
        for begin in range(slot.rows, rows.chain, DECODE_TOKENS):
            chunk = list(range(begin, min(begin + DECODE_TOKENS, rows.chain)))
            self._decode(slot.ctx, [(rows.tokens[r], r, (0,), r in wanted) for r in chunk], chunk, out)
            slot.rows = chunk[-1] + 1

    def _decode_tree(self, slot: _Slot, rows: Rows, wanted: set[int], out: dict[int, np.ndarray]) -> None:
        """Rows ``[slot.rows, len)``: each new leaf gets a sequence (its anchor's, when the
        anchor was a leaf, else a copy of the context up to the anchor), and each new row
        carries the sequences of the new leaves below it. Decoded depth first, children in
        row order, so the first child's path lies in the cells right after its parent: when
        the path kept is the first children's (a chain; a tree whose children come best
        first), ``keep`` keeps its cells and nothing is decoded again."""
        first = slot.rows
        new = range(first, len(rows))
        with_children = {rows.parents[r] for r in new}
        seqs: dict[int, list[int]] = {r: [] for r in new}
        for leaf in (r for r in new if r not in with_children):
            anchor = leaf
            while anchor >= first:
                anchor = rows.parents[anchor]
            seq = slot.leaves.pop(anchor, None)
            if seq is None:
                seq = self._new_seq(slot)
                if anchor >= 0:
                    source = 0 if anchor < rows.chain else slot.below[anchor]
                    self._llama_cpp.llama_memory_seq_cp(slot.ctx.memory, source, seq, 0, rows.depths[anchor] + 1)
            slot.leaves[leaf] = seq
            node = leaf
            while node >= first:
                seqs[node].append(seq)
                slot.below.setdefault(node, seq)
                node = rows.parents[node]
        order = _depth_first(rows, first)
        next_cell = rows.chain + len(slot.cell)
        for begin in range(0, len(order), DECODE_TOKENS):
            chunk = order[begin:begin + DECODE_TOKENS]
            self._decode(slot.ctx, [(rows.tokens[r], rows.depths[r], seqs[r], r in wanted) for r in chunk], chunk, out)
            for row in chunk:
                slot.cell[row] = next_cell
                next_cell += 1
        slot.rows = len(rows)

    def _new_seq(self, slot: _Slot) -> int:
        used = slot.tree_seqs()
        free = next((s for s in range(1, TREE_SEQUENCES) if s not in used), None)
        if free is None:
            raise ContextOverflow(f"a tree has more than {TREE_SEQUENCES - 1} leaves", param="draft")
        return free

    def _decode(self, ctx: Any, entries: list[tuple[int, int, Any, bool]], row_of: list[int], out: dict[int, np.ndarray]) -> None:
        """One llama.cpp decode of (token, position, sequence ids, wants logits) entries."""
        if len(entries) > DECODE_TOKENS:  # never: 64 tokens or more change the numerics
            raise RuntimeError(f"a decode of {len(entries)} tokens exceeds {DECODE_TOKENS}")
        self.max_decode_tokens = max(self.max_decode_tokens, len(entries))
        raw = self._batch.batch
        raw.n_tokens = len(entries)
        for i, (token, position, seq_ids, flag) in enumerate(entries):
            raw.token[i] = token
            raw.pos[i] = position
            raw.n_seq_id[i] = len(seq_ids)
            for j, seq in enumerate(seq_ids):
                raw.seq_id[i][j] = seq
            raw.logits[i] = flag
        ctx.decode(self._batch)
        for i, (_, _, _, flag) in enumerate(entries):
            if flag:
                out[row_of[i]] = self._read_logits(ctx, i)

    def _read_logits(self, ctx: Any, index: int) -> np.ndarray:
        ptr = ctx.get_logits_ith(index)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.info.vocab_size,)).copy()

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
        if session_id == _REFERENCE_SESSION:
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

    def _slot_of(self, session_id: str) -> _Slot | None:
        return next((s for s in self._slots if s.session_id == session_id), None)

    def _slot_for(self, session_id: str, rows: Rows, most: int) -> _Slot:
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

    def _lru_slot(self) -> _Slot:
        return min(self._slots, key=lambda s: s.last_used)

    def _new_slot(self) -> _Slot:
        # one stream of cells: a tree node may belong to several sequences
        slot = _Slot(ctx=self._new_context(self.n_ctx, TREE_SEQUENCES, unified=True))
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

    def forward_full(self, tokens: list[int], num_logits: int) -> torch.Tensor:
        try:
            return self.prefill(_REFERENCE_SESSION, tokens, num_logits)
        finally:
            self.free(_REFERENCE_SESSION)

    def close(self) -> None:
        super().close()
        for slot in self._slots:
            slot.ctx.close()
        self._slots.clear()
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        self._batch.close()
        self._model.close()


def _depth_first(rows: Rows, first: int) -> list[int]:
    """Rows ``[first, len)`` in pre-order, children in row order: every path's rows come in
    increasing position, as llama.cpp's batch checks ask, in one decode or in several."""
    children: dict[int, list[int]] = {}
    for row in range(first, len(rows)):
        children.setdefault(rows.parents[row] if rows.parents[row] >= first else -1, []).append(row)
    order, stack = [], children.get(-1, [])[::-1]
    while stack:
        row = stack.pop()
        order.append(row)
        stack.extend(children.get(row, [])[::-1])
    return order


def _load_model(internals: Any, llama_cpp: Any, path: str) -> Any:
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    try:
        return internals.LlamaModel(path_model=path, params=params, verbose=False)
    except ValueError as exc:
        raise ModelLoadError(f"llama.cpp cannot load {path}: {exc}") from exc
