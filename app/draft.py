"""The draft model at the gateway: proposes γ tokens per round from q̂ (DESIGN §3.1–3.2).

One runner serves every request; its calls run in a thread, one at a time, so the event loop
keeps streaming other requests while a draft is computed.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from core.math.random import Purpose, sample_index, uniforms
from core.math.sampling import SamplingParams, Suppression, apply_sampling, mask_ids, truncate
from core.math.tree import TokenTree
from core.runners import ModelRunner
from core.runners.base import common_prefix


class DraftModel:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._lock = asyncio.Lock()

    @property
    def vocab_size(self) -> int:
        return self.runner.info.vocab_size

    async def propose(
        self, session_id: str, sequence: list[int], gamma: int, params: SamplingParams, seed: int, choice: int,
        truncation: tuple[int, float] = (0, 1.0), cancel: threading.Event | None = None, suppression: Suppression | None = None,
    ) -> TokenTree:
        """Draft ``gamma`` tokens after ``sequence`` (the agreed tokens of the session);
        ``truncation`` = (draft_top_k, draft_top_p) sparsifies q̂ (TSLT), losslessly. Once
        ``cancel`` is set, drafting stops after the token in progress (a prepared draft whose
        assumption failed). The tokens depend on ``sequence`` and the positions only: the draws
        are keyed by position, so a draft prepared ahead equals the one drafted later.
        ``suppression`` (min_tokens) masks its ids where the target cannot emit them."""
        async with self._lock:
            if cancel is not None and cancel.is_set():
                return TokenTree.chain([], [])
            return await asyncio.to_thread(self._propose, session_id, sequence, gamma, params, seed, choice, truncation, cancel, suppression)

    async def free(self, session_id: str) -> None:
        async with self._lock:
            await asyncio.to_thread(self.runner.free, session_id)

    def _propose(
        self, session_id: str, sequence: list[int], gamma: int, params: SamplingParams, seed: int, choice: int,
        truncation: tuple[int, float] = (0, 1.0), cancel: threading.Event | None = None, suppression: Suppression | None = None,
    ) -> TokenTree:
        held = self.runner.tokens(session_id)
        common = common_prefix(held, sequence)
        self.runner.crop(session_id, common)
        logits = self.runner.append(session_id, sequence[common:], 1)[0]
        draws = uniforms(seed, choice, list(range(len(sequence), len(sequence) + gamma)), Purpose.DRAFT_SAMPLE)
        tokens, rows = [], []
        masked = suppression.rows(len(sequence), gamma) if suppression is not None else 0
        for j in range(gamma):
            if j < masked:
                assert suppression is not None
                logits = mask_ids(logits, torch.tensor(suppression.ids, dtype=torch.long))
            q = apply_sampling(logits[None], params)[0]
            if not params.is_greedy and truncation != (0, 1.0):
                q = truncate(q, *truncation)
            token = int(torch.argmax(q)) if params.is_greedy else sample_index(q, float(draws[j]))
            tokens.append(token)
            rows.append(q)
            if token in self.runner.info.eos_ids or j == gamma - 1 or (cancel is not None and cancel.is_set()):
                break
            logits = self.runner.append(session_id, [token], 1)[0]
        return TokenTree.chain(tokens, rows)

