"""The ``llama.cpp`` backend (docs/design.md §7): GGUF on CPU, the fast path for chains and small trees.

Its numerics (measured: tests/core/runners/test_llama_cpp_numerics.py): with flash attention pinned on, a
position's logits are bit-identical whatever the decode that computes it — its size, its batch-mates, the
thread count — as long as llama.cpp runs one attention kernel for them all. It has three on the CPU: rows of a
stream in a micro-batch of 64 or more take a tiled kernel (so no decode carries more than ``DECODE_TOKENS``);
a micro-batch of **one** token whose KV view reaches 512 cells (its stream holds more than ``KV_PAD``) takes a
split-KV kernel that sums the cache in one part per thread (so such a decode runs on one thread, where that
kernel is the plain one, or beside a throwaway token of a stream kept for it, where the micro-batch holds two
streams and takes the plain kernel on every thread: ``_decode``, ``LongDecode``); every other micro-batch
takes the plain kernel. Logits also depend on the order of a context's KV cells (a freed cell reused before
earlier positions moves them by up to 1), so no two sessions share a stream of cells: chain sessions are
sequence ids of one shared context with a KV stream each (one decode carries many, bit-identical to alone); a
tree session, from its first tree row on, has a unified context of its own (a pool lent least recently used
first), one sequence id per root-to-leaf path. An ended session's place goes idle holding its chain's cells (a
prompt cache): a new session that starts the same takes them and decodes only what follows, bit for bit. Only
the rows asked for produce logits."""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from core.cores import usable_cores
from core.errors import ContextOverflow, ModelLoadError
from core.names import Backend
from core.runners.base import (
    ModelRunner,
    Place,
    Rows,
    RunnerInfo,
    Staged,
    common_prefix,
    held_by,
    in_turns,
    lend,
)
from core.runners.llama_cpp_tools import quiet_llama_cpp
from core.runners.models import ModelSource
from core.runners.tokenizer import eos_ids

log = logging.getLogger(__name__)

# threads from which a long decode of one goes beside a throwaway token (its cost does not grow with threads)
PAD_STREAM_FROM = 3
# tokens per decode at most; 64 or more rows of a stream in a micro-batch would change the logits
DECODE_TOKENS = 32
# llama.cpp pads a KV view to this many cells: a stream holding more sees 512 or more (one token's split-KV
# kernel)
KV_PAD = 256
TREE_SEQUENCES = 64  # sequence ids per context: the session's and one per tree leaf
TREE_ROOM = 256  # cells of a context beyond the session's context length, for tree rows
MAX_STREAMS = 64  # chain sessions held in the shared context at most
STREAMS_SHARE = 0.75  # of the memory cap, for the chain sessions' streams (the rest: tree contexts)
REFERENCE_SESSION = "\x00reference"


@dataclass
class Slot(Place):
    """One llama.cpp context of the pool: its session's chain rows in cells ``0..`` in order (sequence 0),
    tree rows after them in decode order (``cell``)."""

    ctx: Any = None  # llama_cpp._internals.LlamaContext
    cell: dict[int, int] = field(default_factory=dict)  # tree row -> its KV cell
    below: dict[int, int] = field(default_factory=dict)  # tree row -> a leaf sequence through it
    leaves: dict[int, int] = field(default_factory=dict)  # tree leaf row -> its sequence
    # idle: the tokens of chain cells 0.. it holds (a prompt cache)
    cached: list[int] = field(default_factory=list)

    def tree_seqs(self) -> set[int]:
        return set(self.below.values()) | set(self.leaves.values())

    def drop_tree(self, api: Any) -> None:
        """Forget the tree rows: their sequences' cells (``api``: llama_cpp) and where they were."""
        for seq in self.tree_seqs():
            api.llama_memory_seq_rm(self.ctx.memory, seq, -1, -1)
        for rows in (self.cell, self.below, self.leaves):
            rows.clear()

    def reset(self, session_id: str | None) -> None:
        self.session_id, self.rows, self.cached = session_id, 0, []
        for rows in (self.cell, self.below, self.leaves):
            rows.clear()
        self.ctx.kv_cache_clear()


@dataclass
class Stream(Place):
    """One sequence id (= KV stream) of the shared context: its cells ``0..`` are its session's rows, in
    order."""

    seq: int = 0
    cached: list[int] = field(default_factory=list)  # idle: the tokens of cells 0.. it holds (a prompt cache)


_P = TypeVar("_P", Slot, Stream)
# how a chain session's decode of one past KV_PAD cells keeps the plain kernel
LONG_DECODES = ("one-thread", "pad-stream")


class LlamaCppRunner(ModelRunner):
    def __init__(
        self,
        source: ModelSource,
        tokenizer: Any,
        max_context: int = 2048,
        memory_cap_mb: int = 1024,
        n_threads: int | None = None,
        long_decode: str | None = None,
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
            2
            * llama_cpp.llama_model_n_layer(model)
            * llama_cpp.llama_model_n_head_kv(model)
            * (llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model))
            * 2
        )
        self.n_ctx = -(-(self.info.max_context + TREE_ROOM) // 256) * 256
        self.n_ctx_stream = -(-self.info.max_context // 256) * 256
        # measured here: a context costs its KV cache plus its output and compute buffers
        cap = memory_cap_mb * 2**20
        context_bytes = self.n_ctx * self._kv_bytes + 2 * TREE_SEQUENCES * vocab_size * 4
        self.num_contexts = max(1, int(cap * (1 - STREAMS_SHARE)) // context_bytes)
        self.num_streams = max(
            1, min(MAX_STREAMS, int(cap * STREAMS_SHARE) // (self.n_ctx_stream * self._kv_bytes))
        )
        self._n_threads = n_threads or usable_cores()
        # a chain session's decode of one token past KV_PAD cells: on one thread, or beside a throwaway token
        # in the next stream (``pad-stream``: +60–80 % a decode beside a stream as long, on one thread as on
        # two, where one thread costs more the more threads; scripts/invariance_cost.py, docs/performance.md);
        # a tree's context has one stream: one thread there
        auto = LONG_DECODES[1] if self._n_threads >= PAD_STREAM_FROM else LONG_DECODES[0]
        self.long_decode = auto if long_decode in (None, "auto") else long_decode
        if self.long_decode not in LONG_DECODES:
            raise ValueError(f"long_decode must be one of {LONG_DECODES}, got {long_decode!r}")
        self._batch = _internals.LlamaBatch(
            n_tokens=DECODE_TOKENS, embd=0, n_seq_max=TREE_SEQUENCES, verbose=False
        )
        self._slots: list[Slot] = []
        self._shared: Any = None  # the chain sessions' context (made on first use)
        self._streams = [Stream(seq=seq) for seq in range(self.num_streams)]
        self._tree_sessions: set[str] = set()  # sessions that held tree rows: they live in _slots
        self._clock = 0
        self.reused_rows = 0  # rows a new session took from the prompt cache, since start
        self.max_decode_tokens = 0  # the largest decode issued so far (tests assert ≤ DECODE_TOKENS)
        # one-token decodes of a long sequence run on one thread, since start (tests)
        self.one_thread_decodes = 0
        self.padded_decodes = 0  # ... run beside a throwaway token of a neighbouring stream (tests)

    def memory_bytes(self) -> int:
        # KV lives in the fixed pool; what grows with sessions is their rows
        return sum(len(r) for r in self._rows.values()) * 8

    def is_full(self, chains: Collection[str], trees: Collection[str], tree: bool = False) -> bool:
        """Full when live chain sessions hold every stream (tree contexts are lent LRU: never full)."""
        return not tree and self.places_held(chains, trees) >= self.num_streams

    @property
    def session_places(self) -> int:
        return self.num_streams

    def places_held(self, chains: Collection[str], trees: Collection[str]) -> int:
        """Chain sessions hold a stream each; tree sessions none."""
        return len(set(chains) - self._tree_sessions)

    def _stream_for(self, session_id: str, busy: list[str], rows: Rows, most: int) -> Stream:
        """The session's stream, else an idle one (``_idle_place``), else the LRU one not ``busy`` (its
        session rebuilt later)."""
        stream, common = self._idle_place(self._streams, session_id, rows.tokens, most)
        if stream is None:
            stream, _ = lend(self._streams, session_id, busy, self._release)
        elif stream.session_id is None:
            self._take_idle(stream, session_id, common)
        if self._shared is None:
            self._shared = self._new_context(
                self.num_streams * self.n_ctx_stream, self.num_streams, unified=False
            )
        stream.last_used = self._clock
        return stream

    def adopt(self, session_id: str, tokens: list[int]) -> int:
        if session_id in self._rows or session_id == REFERENCE_SESSION:  # held already
            return 0
        stream, common = self._idle_place(self._streams, session_id, tokens, len(tokens) - 1)
        if stream is None or stream.session_id is not None or common <= 0 or self._shared is None:
            return 0
        self._clock += 1
        self._take_idle(stream, session_id, common)
        stream.last_used = self._clock
        self._rows[session_id] = Rows(
            [int(t) for t in tokens[:common]], list(range(-1, common - 1)), list(range(common)), common
        )
        return common

    def expect_tree(self, session_id: str) -> None:
        if session_id not in self._rows:  # a new session: its chain rows go to a slot, never through a stream
            self._tree_sessions.add(session_id)

    def _take_idle(self, place: Slot | Stream, session_id: str, common: int) -> None:
        """Lend an idle place to a session that keeps its first ``common`` cells (a prompt cache hit)."""
        if place.rows > common:
            memory, seq = (
                (place.ctx.memory, 0) if isinstance(place, Slot) else (self._shared.memory, place.seq)
            )
            self._llama_cpp.llama_memory_seq_rm(memory, seq, common, -1)
        place.session_id, place.rows, place.cached = session_id, common, []
        self.reused_rows += common

    def _idle_place(
        self, pool: list[_P], session_id: str, tokens: list[int], most: int
    ) -> tuple[_P | None, int]:
        """The session's own place (and 0), else an idle one and how many of its cells the session keeps (≤
        ``most``): the one sharing the longest start if that is half of what it holds, else an empty one, else
        the LRU one."""
        held = held_by(pool, session_id)
        if held is not None:
            return held, 0
        idle = [p for p in pool if p.session_id is None]
        if not idle:
            return None, 0
        fresh = session_id == REFERENCE_SESSION  # the tests' reference decodes everything afresh
        hits = {id(p): 0 if fresh else min(common_prefix(p.cached, tokens), most) for p in idle}
        best = max(idle, key=lambda p: (hits[id(p)], -p.last_used))
        if hits[id(best)] > 0 and 2 * hits[id(best)] >= len(best.cached):
            return best, hits[id(best)]  # the new session keeps most of what it holds
        # a short shared start (a chat template's first line) is not worth another prompt's cells
        # an empty place, else the least recently used
        spare = min(idle, key=lambda p: (bool(p.cached), p.last_used))
        return spare, hits[id(spare)]

    def _release(self, stream: Stream) -> None:
        if self._shared is not None and (stream.session_id is not None or stream.rows):
            self._llama_cpp.llama_memory_seq_rm(self._shared.memory, stream.seq, -1, -1)
        stream.session_id, stream.rows, stream.cached = None, 0, []

    def _to_tree_session(self, session_id: str, rows: Rows) -> None:
        """From its first tree row on, a session lives in a context of its own; the stream it leaves goes idle
        holding its chain cells (the next request with the same prompt finds them, as after ``_retire``)."""
        if session_id not in self._tree_sessions:
            self._tree_sessions.add(session_id)
            stream = held_by(self._streams, session_id)
            if stream is not None:
                kept = min(stream.rows, rows.chain)
                if kept < stream.rows:
                    self._llama_cpp.llama_memory_seq_rm(self._shared.memory, stream.seq, kept, -1)
                self._clock += 1
                stream.session_id, stream.rows, stream.cached, stream.last_used = (
                    None,
                    kept,
                    rows.tokens[:kept],
                    self._clock,
                )

    def _keep_cache(self, session_id: str, rows: Rows, kept: Sequence[int]) -> None:
        """Keep the kept rows whose cells are ``0, 1, …``; the rest of a kept path is decoded again on the
        next forward."""
        stream = held_by(self._streams, session_id)
        if stream is not None:  # a chain session keeps a prefix
            if len(kept) < stream.rows:
                self._llama_cpp.llama_memory_seq_rm(self._shared.memory, stream.seq, len(kept), -1)
                stream.rows = len(kept)
            return
        slot = held_by(self._slots, session_id)
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
        slot.drop_tree(api)
        slot.rows = in_place

    def _retire(self, session_id: str, rows: Rows) -> None:
        """The session ends: its place goes idle holding the cells of its chain (a prompt cache)."""
        if session_id == REFERENCE_SESSION:
            return
        self._clock += 1
        stream = held_by(self._streams, session_id)
        if stream is not None:
            stream.session_id, stream.cached, stream.last_used = None, rows.tokens[: stream.rows], self._clock
            return
        slot = held_by(self._slots, session_id)
        if slot is None:
            return
        kept = min(slot.rows, rows.chain)  # chain rows sit in sequence 0's cells 0.. in order
        self._llama_cpp.llama_memory_seq_rm(slot.ctx.memory, 0, kept, -1)
        slot.drop_tree(self._llama_cpp)
        slot.session_id, slot.rows, slot.cached, slot.last_used = None, kept, rows.tokens[:kept], self._clock

    def _free_cache(self, session_id: str) -> None:
        self._tree_sessions.discard(session_id)
        self._drop_cache(session_id)

    def _drop_cache(self, session_id: str) -> None:
        stream = held_by(self._streams, session_id)
        if stream is not None:
            self._release(stream)
        slot = held_by(self._slots, session_id)
        if slot is not None:
            slot.reset(None)

    def _slot_for(self, session_id: str, rows: Rows, most: int) -> Slot:
        """The session's context, else an idle one (``_idle_place``) on a hit, else a new one while the pool
        has room, else the LRU one."""
        self._clock += 1
        lead = (
            0
            if held_by(self._slots, session_id) is not None
            else next((i for i, p in enumerate(rows.parents) if p != i - 1), len(rows))
        )
        slot, common = self._idle_place(self._slots, session_id, rows.tokens, min(most, lead))
        if slot is not None and slot.session_id is None and common > 0:
            self._take_idle(slot, session_id, common)
            # they are a chain (a tree call's agreed rows come with parents): sequence 0's cells
            rows.chain = max(rows.chain, common)
        elif slot is None or slot.session_id is None:
            if slot is None or slot.cached:  # grow before a cache is lost
                slot = (
                    self._new_slot()
                    if len(self._slots) < self.num_contexts
                    else (slot or min(self._slots, key=lambda s: s.last_used))
                )
            slot.reset(session_id)  # the session it held keeps its rows: rebuilt on its next call
        slot.last_used = self._clock
        return slot

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

    def _compute_each(self, work: list[Staged]) -> list[torch.Tensor | Exception]:
        """Tree sessions decode alone (``_decode_alone``), then chain sessions' rows share decodes
        (``_decode_streams``)."""
        out: list[torch.Tensor | Exception | None] = [None] * len(work)
        trees = [w.session_id in self._tree_sessions or w.rows.chain < len(w.rows) for w in work]
        in_turns(work, out, [i for i, tree in enumerate(trees) if tree], 1, self._decode_alone)
        return in_turns(
            work, out, [i for i, tree in enumerate(trees) if not tree], self.num_streams, self._decode_streams
        )

    def _decode_alone(self, work: list[Staged]) -> list[torch.Tensor]:
        """One tree session (``in_turns`` groups of one) in a context of its own."""
        session_id, rows, logits_rows = work[0].session_id, work[0].rows, work[0].logits_rows
        self._to_tree_session(session_id, rows)
        slot = self._slot_for(session_id, rows, min(logits_rows))
        wanted, out = set(logits_rows), dict[int, np.ndarray]()
        if slot.rows < rows.chain:  # in sequence 0, position = row = cell
            chain = list(range(slot.rows, rows.chain))
            self._decode(
                slot.ctx,
                [(rows.tokens[r], r, (0,), r in wanted) for r in chain],
                chain,
                out,
                rows.chain + len(slot.cell) > KV_PAD,
            )
            slot.rows = rows.chain
        if slot.rows < len(rows):
            self._decode_tree(slot, rows, wanted, out)
        return [torch.from_numpy(np.stack([out[r] for r in logits_rows]))]

    def _decode_streams(self, work: list[Staged]) -> list[torch.Tensor | Exception]:
        """Chain sessions (one per stream) in shared decodes; each session's row at position = row in its own
        stream. A session whose stream will hold more than ``KV_PAD`` cells decodes in calls of its own
        (``_decode``'s ``long``) on more than one thread: beside another stream, llama.cpp could leave one of
        its tokens alone in a micro-batch."""
        self._clock += 1
        streams = [
            self._stream_for(w.session_id, [x.session_id for x in work], w.rows, min(w.logits_rows))
            for w in work
        ]
        shared: tuple[list[tuple[int, int, Any, bool]], list[tuple[int, int]], bool] = ([], [], False)
        calls = [shared]  # (entries, per entry its (work index, row), long)
        for i, (w, stream) in enumerate(zip(work, streams)):
            wanted = set(w.logits_rows)
            # on one thread the split-KV kernel is the plain one
            long = len(w.rows) > KV_PAD and self._n_threads > 1
            entries, owners, _ = ([], [], True) if long else shared
            for row in range(stream.rows, len(w.rows)):
                entries.append((w.rows.tokens[row], row, (stream.seq,), row in wanted))
                owners.append((i, row))
            if long:
                calls.append((entries, owners, True))
        got: dict[tuple[int, int], np.ndarray] = {}
        try:
            for entries, owners, long in calls:
                self._decode(self._shared, entries, owners, got, long)
        except BaseException:
            for stream in streams:
                self._release(stream)
            raise
        for w, stream in zip(work, streams):
            stream.rows = len(w.rows)
        return [torch.from_numpy(np.stack([got[i, r] for r in w.logits_rows])) for i, w in enumerate(work)]

    def _decode_tree(self, slot: Slot, rows: Rows, wanted: set[int], out: dict[int, np.ndarray]) -> None:
        """Rows ``[slot.rows, len)``: each new leaf gets a sequence (its anchor leaf's, else a copy up to the
        anchor), each row carries its leaves'. Depth first, children in row order: a kept path of first
        children is decoded nothing again."""
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
                    self._llama_cpp.llama_memory_seq_cp(
                        slot.ctx.memory, source, seq, 0, rows.depths[anchor] + 1
                    )
            slot.leaves[leaf] = seq
            node = leaf
            while node >= first:
                seqs[node].append(seq)
                slot.below.setdefault(node, seq)
                node = rows.parents[node]
        order = _depth_first(rows, first)
        next_cell = rows.chain + len(slot.cell)
        self._decode(
            slot.ctx,
            [(rows.tokens[r], rows.depths[r], seqs[r], r in wanted) for r in order],
            order,
            out,
            next_cell + len(order) > KV_PAD,
        )
        slot.cell.update((row, next_cell + i) for i, row in enumerate(order))
        slot.rows = len(rows)

    def _new_seq(self, slot: Slot) -> int:
        used = slot.tree_seqs()
        free = next((s for s in range(1, TREE_SEQUENCES) if s not in used), None)
        if free is None:
            raise ContextOverflow(f"a tree has more than {TREE_SEQUENCES - 1} leaves", param="draft")
        return free

    def _decode(
        self,
        ctx: Any,
        entries: list[tuple[int, int, Any, bool]],
        row_of: Sequence[Hashable],
        out: dict[Any, np.ndarray],
        long: bool = False,
    ) -> None:
        """Decodes of (token, position, sequence ids, wants logits) entries, at most ``DECODE_TOKENS`` at a
        time (never a last one of a single token after others); logits into ``out[row_of[i]]``. ``long``: the
        entries are one sequence whose KV view spans more than ``KV_PAD`` cells (or one unified context's that
        does), so a decode of one token is one micro-batch in llama.cpp's split-KV kernel: it runs on one
        thread, where that kernel sums the cache in one part, as the plain kernel does
        (tests/core/runners/test_llama_cpp_numerics.py measures both)."""
        raw = self._batch.batch
        for begin, end in _spans(len(entries), DECODE_TOKENS):
            chunk = entries[begin:end]
            self.max_decode_tokens = max(self.max_decode_tokens, len(chunk))
            raw.n_tokens = len(chunk)
            for i, (token, position, seq_ids, flag) in enumerate(chunk):
                raw.token[i] = token
                raw.pos[i] = position
                raw.n_seq_id[i] = len(seq_ids)
                for j, seq in enumerate(seq_ids):
                    raw.seq_id[i][j] = seq
                raw.logits[i] = flag
            alone = long and len(chunk) == 1 and self._n_threads > 1
            beside = (
                self._neighbour(chunk[0][2][0])
                if alone and ctx is self._shared and self.long_decode == "pad-stream"
                else None
            )
            if beside is not None:
                # the throwaway token: two neighbouring streams in the micro-batch, the plain kernel
                seq, position, first = beside
                raw.n_tokens = 2
                at, real = (0, 1) if first else (1, 0)
                raw.token[real], raw.pos[real], raw.n_seq_id[real], raw.logits[real] = (
                    chunk[0][0],
                    chunk[0][1],
                    1,
                    chunk[0][3],
                )
                raw.seq_id[real][0] = chunk[0][2][0]
                raw.token[at], raw.pos[at], raw.n_seq_id[at], raw.logits[at] = chunk[0][0], position, 1, False
                raw.seq_id[at][0] = seq
            one = alone and beside is None
            # one-token, larger micro-batches
            self._llama_cpp.llama_set_n_threads(ctx.ctx, 1 if one else self._n_threads, self._n_threads)
            self.one_thread_decodes += one
            self.padded_decodes += beside is not None
            try:
                ctx.decode(self._batch)
            finally:
                if beside is not None:
                    self._llama_cpp.llama_memory_seq_rm(ctx.memory, beside[0], beside[1], -1)
            self.progress_at = time.monotonic()  # a busy worker's sign of life (workers.scheduler.stalled_s)
            if beside is not None and beside[2]:  # the real token second
                if not chunk[0][3]:
                    continue
                logits = ctypes.cast(ctx.get_logits_ith(1), ctypes.POINTER(ctypes.c_float))
                out[row_of[begin]] = np.ctypeslib.as_array(logits, shape=(self.info.vocab_size,)).copy()
                continue
            for i, (_, _, _, flag) in enumerate(chunk):
                if flag:
                    logits = ctypes.cast(ctx.get_logits_ith(i), ctypes.POINTER(ctypes.c_float))
                    out[row_of[begin + i]] = np.ctypeslib.as_array(
                        logits, shape=(self.info.vocab_size,)
                    ).copy()

    def _neighbour(self, seq: int) -> tuple[int, int, bool] | None:
        """Where a throwaway token goes beside a decode of one in stream ``seq`` of the shared context: the
        next stream (llama.cpp puts streams in one micro-batch only by consecutive sequence ids, in the
        batch's order), else the one before (then first in the batch); its position, after what that stream
        holds. The cell it takes is the one that stream's next row would take, freed after the decode: that
        stream's rows keep their cells. None: no room (one thread)."""
        for other, first in ((seq + 1, False), (seq - 1, True)):
            if 0 <= other < self.num_streams:
                position = int(self._llama_cpp.llama_memory_seq_pos_max(self._shared.memory, other)) + 1
                if position < self.n_ctx_stream - 1:
                    return other, position, first
        return None

    def forward_full(self, tokens: list[int], num_logits: int) -> torch.Tensor:
        try:
            return self.prefill(REFERENCE_SESSION, tokens, num_logits)
        finally:
            self.free(REFERENCE_SESSION)

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


def _spans(count: int, most: int) -> list[tuple[int, int]]:
    """``[begin, end)`` spans of at most ``most`` covering ``count`` entries; a last one of one entry after
    others takes one more."""
    if count == 0:
        return []
    ends = list(range(most, count, most)) + [count]
    if len(ends) > 1 and ends[-1] - ends[-2] == 1:
        ends[-2] -= 1
    return list(zip([0, *ends[:-1]], ends))


def _depth_first(rows: Rows, first: int) -> list[int]:
    """Rows ``[first, len)`` in pre-order, children in row order: every path's positions increase (llama.cpp
    checks)."""
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
