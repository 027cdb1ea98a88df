"""The ``llama.cpp`` backend (DESIGN §7): GGUF on CPU, the fast path for the sequence modes.

Two facts of llama.cpp shape this runner:
1. Logits of a position differ between a batch of one token and a batch of two or more, so it
   never evaluates a batch of one: it re-evaluates the last cached token with the new one.
   (A whole sequence of one token is the only exception, and it is always scored that way.)
2. A context is costly (its KV cache and output buffer), so sessions share a bounded pool of
   contexts under a memory cap. A session keeps its token list; when its context was lent to
   another session, its KV cache is rebuilt from the tokens on its next call.

Only the positions asked for produce logits (llama.cpp's per-token output flags), so no
``n_ctx × V`` logits array is ever allocated.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from core.errors import ModelLoadError
from core.names import Backend
from core.runners.base import ModelRunner, RunnerInfo, common_prefix
from core.runners.llama_cpp_tools import quiet_llama_cpp
from core.runners.models import ModelSource
from core.runners.tokenizer import eos_ids

log = logging.getLogger(__name__)

_REFERENCE_SESSION = "\x00reference"


@dataclass
class _Slot:
    """One llama.cpp context of the pool and the session whose KV cache it holds."""

    ctx: Any  # llama_cpp._internals.LlamaContext
    batch: Any  # llama_cpp._internals.LlamaBatch
    session_id: str | None = None
    kv_tokens: list[int] = field(default_factory=list)  # tokens whose KV entries are in ctx
    last_used: int = 0


class LlamaCppRunner(ModelRunner):
    def __init__(
        self,
        source: ModelSource,
        tokenizer: Any,
        max_context: int = 2048,
        n_batch: int = 512,
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
        self.n_batch = max(4, min(n_batch, self.info.max_context))  # ≥ 3 keeps _chunks free of ones
        self._n_threads = n_threads or os.cpu_count() or 1
        model = self._model.model
        self._kv_bytes = (
            2 * llama_cpp.llama_model_n_layer(model) * llama_cpp.llama_model_n_head_kv(model)
            * (llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model)) * 2
        )
        # measured here: a context costs its KV cache plus ~10 MB (compute buffer, kept logits)
        context_bytes = self.info.max_context * self._kv_bytes + _OUTPUT_ROWS * vocab_size * 4
        self.num_contexts = max(1, memory_cap_mb * 2**20 // context_bytes)
        self._slots: list[_Slot] = []
        self._clock = 0

    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes

    def memory_bytes(self) -> int:
        # KV lives in the fixed pool; what grows with sessions is their token lists
        return sum(len(t) for t in self._tokens.values()) * 8

    # ----------------------------------------------------------------- forward

    def _forward(self, session_id: str, tokens: list[int], num_logits: int) -> torch.Tensor:
        slot = self._slot_for(session_id)
        start = min(common_prefix(slot.kv_tokens, tokens), len(tokens) - num_logits)
        if len(tokens) >= 2:
            start = min(start, len(tokens) - 2)  # never a batch of one
        slot.ctx.kv_cache_seq_rm(0, start, -1)
        slot.kv_tokens = slot.kv_tokens[:start]
        logits = self._decode(slot, tokens[start:], start, num_logits)
        slot.kv_tokens = list(tokens)
        return logits

    def _decode(self, slot: _Slot, tokens: list[int], n_past: int, num_logits: int) -> torch.Tensor:
        rows: list[np.ndarray] = []
        first_scored = len(tokens) - num_logits
        for begin, end in _chunks(len(tokens), self.n_batch):
            flags = [begin + i >= first_scored for i in range(end - begin)]
            self._fill_batch(slot.batch, tokens[begin:end], n_past + begin, flags)
            slot.ctx.decode(slot.batch)
            rows.extend(self._read_logits(slot.ctx, i) for i, flag in enumerate(flags) if flag)
        return torch.from_numpy(np.stack(rows))

    def _fill_batch(self, batch: Any, tokens: list[int], n_past: int, flags: list[bool]) -> None:
        raw = batch.batch
        raw.n_tokens = len(tokens)
        for i, (token, flag) in enumerate(zip(tokens, flags)):
            raw.token[i] = token
            raw.pos[i] = n_past + i
            raw.seq_id[i][0] = 0
            raw.n_seq_id[i] = 1
            raw.logits[i] = flag

    def _read_logits(self, ctx: Any, index: int) -> np.ndarray:
        ptr = ctx.get_logits_ith(index)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.info.vocab_size,)).copy()

    # ----------------------------------------------------------------- the pool

    def _slot_for(self, session_id: str) -> _Slot:
        self._clock += 1
        slot = next((s for s in self._slots if s.session_id == session_id), None)
        if slot is None:
            free = next((s for s in self._slots if s.session_id is None), None)  # reuse before growing
            slot = free or (self._new_slot() if len(self._slots) < self.num_contexts else self._lru_slot())
            slot.session_id, slot.kv_tokens = session_id, []
            slot.ctx.kv_cache_clear()
        slot.last_used = self._clock
        return slot

    def _lru_slot(self) -> _Slot:
        return min(self._slots, key=lambda s: s.last_used)

    def _new_slot(self) -> _Slot:
        llama_cpp = self._llama_cpp
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = self.info.max_context
        params.n_batch = params.n_ubatch = self.n_batch  # one decode call = one ubatch
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = self._n_threads
        params.no_perf = True
        try:
            ctx = self._internals.LlamaContext(model=self._model, params=params, verbose=False)
        except ValueError as exc:
            raise ModelLoadError(f"llama.cpp could not create a context: {exc}") from exc
        batch = self._internals.LlamaBatch(n_tokens=self.n_batch, embd=0, n_seq_max=1, verbose=False)
        slot = _Slot(ctx=ctx, batch=batch)
        self._slots.append(slot)
        return slot

    def _crop_cache(self, session_id: str, length: int) -> None:
        for slot in self._slots:
            if slot.session_id == session_id and len(slot.kv_tokens) > length:
                slot.ctx.kv_cache_seq_rm(0, length, -1)
                slot.kv_tokens = slot.kv_tokens[:length]

    def _free_cache(self, session_id: str) -> None:
        for slot in self._slots:
            if slot.session_id == session_id:
                slot.session_id, slot.kv_tokens = None, []

    def forward_full(self, tokens: list[int], num_logits: int) -> torch.Tensor:
        try:
            return self.prefill(_REFERENCE_SESSION, tokens, num_logits)
        finally:
            self.free(_REFERENCE_SESSION)

    def close(self) -> None:
        super().close()
        for slot in self._slots:
            slot.batch.close()
            slot.ctx.close()
        self._slots.clear()
        self._model.close()


_OUTPUT_ROWS = 65  # logits rows one decode keeps at most in practice: a draft of 64 + 1


def _load_model(internals: Any, llama_cpp: Any, path: str) -> Any:
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    try:
        return internals.LlamaModel(path_model=path, params=params, verbose=False)
    except ValueError as exc:
        raise ModelLoadError(f"llama.cpp cannot load {path}: {exc}") from exc


def _chunks(total: int, size: int) -> list[tuple[int, int]]:
    """[begin, end) pieces of at most ``size`` (≥ 3), none of length one unless ``total`` is one."""
    bounds = [(b, min(b + size, total)) for b in range(0, total, size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        (b0, e0), (_, e1) = bounds[-2], bounds[-1]
        bounds[-2:] = [(b0, e0 - 1), (e0 - 1, e1)]
    return bounds
