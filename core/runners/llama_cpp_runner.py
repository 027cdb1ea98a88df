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
from typing import Any

import numpy as np
import torch

from core.cores import usable_cores
from core.errors import ContextOverflow, ModelLoadError
from core.names import Backend
from core.runners.base import ModelRunner, Rows, RunnerInfo, Staged
from core.runners.llama_cpp_places import DECODE_TOKENS, MAX_STREAMS, TREE_SEQUENCES, REFERENCE_SESSION, STREAMS_SHARE, TREE_ROOM, CellPlaces, Slot, Stream
from core.runners.llama_cpp_tools import quiet_llama_cpp
from core.runners.models import ModelSource
from core.runners.tokenizer import eos_ids

log = logging.getLogger(__name__)


class LlamaCppRunner(CellPlaces, ModelRunner):
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
        self.n_ctx = -(-(self.info.max_context + TREE_ROOM) // 256) * 256
        self.n_ctx_stream = -(-self.info.max_context // 256) * 256
        # measured here: a context costs its KV cache plus its output and compute buffers
        cap = memory_cap_mb * 2**20
        context_bytes = self.n_ctx * self._kv_bytes + 2 * TREE_SEQUENCES * vocab_size * 4
        self.num_contexts = max(1, int(cap * (1 - STREAMS_SHARE)) // context_bytes)
        self.num_streams = max(1, min(MAX_STREAMS, int(cap * STREAMS_SHARE) // (self.n_ctx_stream * self._kv_bytes)))
        self._n_threads = n_threads or usable_cores()
        self._batch = _internals.LlamaBatch(n_tokens=DECODE_TOKENS, embd=0, n_seq_max=TREE_SEQUENCES, verbose=False)
        self._slots: list[Slot] = []
        self._shared: Any = None  # the chain sessions' context (made on first use)
        self._streams = [Stream(seq) for seq in range(self.num_streams)]
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

    def _decode_chain(self, slot: Slot, rows: Rows, wanted: set[int], out: dict[int, np.ndarray]) -> None:
        """Rows ``[slot.rows, rows.chain)`` in sequence 0, position = row = cell."""
        for begin in range(slot.rows, rows.chain, DECODE_TOKENS):
            chunk = list(range(begin, min(begin + DECODE_TOKENS, rows.chain)))
            self._decode(slot.ctx, [(rows.tokens[r], r, (0,), r in wanted) for r in chunk], chunk, out)
            slot.rows = chunk[-1] + 1

    def _decode_tree(self, slot: Slot, rows: Rows, wanted: set[int], out: dict[int, np.ndarray]) -> None:
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

    def _new_seq(self, slot: Slot) -> int:
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
