"""The draft model at the gateway: proposes γ tokens per round from q̂ (DESIGN §3.1–3.2).

One runner serves every request; its calls run on its model thread, one at a time, so the
event loop keeps streaming other requests while a draft is computed.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from core.math.random import Purpose, sample_index, uniform, uniforms
from core.math.sampling import SamplingParams, Suppression, apply_sampling, mask_ids, truncate, truncated_support
from core.math.tree import ChildRule, SparseRow, TokenTree, TreeShape, sparse_rows
from core.runners import ModelRunner
from core.runners.base import ForwardItem, common_prefix
from core.runners.model_thread import ModelThread


class DraftClock:
    """Where one draft's seconds went: in the runner (``draft_model``), and the rest of the
    drafting — sampling, truncation, the tree's bookkeeping — (``draft_sampling``)."""

    def __init__(self) -> None:
        self.model_s = 0.0
        self.total_s = 0.0

    def model(self) -> AbstractContextManager[None]:
        return self._adding("model_s")

    def whole(self) -> AbstractContextManager[None]:
        return self._adding("total_s")

    @contextmanager
    def _adding(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, name, getattr(self, name) + time.perf_counter() - started)

    def parts(self) -> dict[str, float]:
        return {"draft_model": self.model_s, "draft_sampling": max(self.total_s - self.model_s, 0.0)}


class DraftModel:
    def __init__(self, runner: ModelRunner, thread: ModelThread | None = None) -> None:
        self.runner = runner
        self.thread = thread or ModelThread()  # every runner call (core.runners.model_thread)
        self._lock = asyncio.Lock()
        self.clock = DraftClock()  # the draft in progress (one at a time: the lock); read it under the lock

    @property
    def vocab_size(self) -> int:
        return self.runner.info.vocab_size

    async def propose(
        self, session_id: str, sequence: list[int], gamma: int, params: SamplingParams, seed: int, choice: int,
        truncation: tuple[int, float] = (0, 1.0), cancel: threading.Event | None = None, suppression: Suppression | None = None,
        timing: dict[str, float] | None = None,
    ) -> TokenTree:
        """Draft ``gamma`` tokens after ``sequence`` (the agreed tokens of the session);
        ``truncation`` = (draft_top_k, draft_top_p) sparsifies q̂ (TSLT), losslessly. Once
        ``cancel`` is set, drafting stops after the token in progress (a prepared draft whose
        assumption failed). The tokens depend on ``sequence`` and the positions only: the draws
        are keyed by position, so a draft prepared ahead equals the one drafted later.
        ``suppression`` (min_tokens) masks its ids where the target cannot emit them; ``timing``
        gets the seconds of the draft model and of the sampling (``DraftClock``)."""
        async with self._lock:
            if cancel is not None and cancel.is_set():
                return TokenTree.chain([], [])
            self.clock = DraftClock()
            draft = await self.thread.run(self._propose, session_id, sequence, gamma, params, seed, choice, truncation, cancel, suppression)
            self._record(timing)
            return draft

    async def propose_tree(
        self, session_id: str, sequence: list[int], shape: TreeShape, params: SamplingParams, seed: int, choice: int,
        truncation: tuple[int, float] = (0, 1.0), timing: dict[str, float] | None = None,
    ) -> TokenTree:
        """Draft a tree of ``shape`` after ``sequence`` (DESIGN §3.6): one batched draft decode
        per depth over the nodes that get children. The draws are keyed by position and lane
        (a draw's rank at its depth), so lane 0 of a one-wide tree draws the chain's numbers."""
        async with self._lock:
            self.clock = DraftClock()
            draft = await self.thread.run(self._propose_tree, session_id, sequence, shape, params, seed, choice, truncation)
            self._record(timing)
            return draft

    def _record(self, timing: dict[str, float] | None) -> None:
        """The finished draft's parts into ``timing``."""
        if timing is not None:
            for name, seconds in self.clock.parts().items():
                timing[name] = timing.get(name, 0.0) + seconds

    async def free(self, session_id: str) -> None:
        async with self._lock:
            await self.thread.run(self.runner.free, session_id)

    def _propose(
        self, session_id: str, sequence: list[int], gamma: int, params: SamplingParams, seed: int, choice: int,
        truncation: tuple[int, float] = (0, 1.0), cancel: threading.Event | None = None, suppression: Suppression | None = None,
    ) -> TokenTree:
        with self.clock.whole():
            return self._chain(session_id, sequence, gamma, params, seed, choice, truncation, cancel, suppression)

    def _chain(
        self, session_id: str, sequence: list[int], gamma: int, params: SamplingParams, seed: int, choice: int,
        truncation: tuple[int, float], cancel: threading.Event | None, suppression: Suppression | None,
    ) -> TokenTree:
        clock = self.clock
        with clock.model():
            held = self.runner.tokens(session_id)
            common = common_prefix(held, sequence)
            self.runner.crop(session_id, common)
            logits = self.runner.append(session_id, sequence[common:], 1)[0]
        draws = uniforms(seed, choice, list(range(len(sequence), len(sequence) + gamma)), Purpose.DRAFT_SAMPLE)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []  # dense q̂ rows, or
        supports: list[SparseRow] = []  # truncated ones, sampled on their support (DESIGN §9)
        masked = suppression.rows(len(sequence), gamma) if suppression is not None else 0
        truncating = not params.is_greedy and truncation != (0, 1.0)
        for j in range(gamma):
            if j < masked:
                assert suppression is not None
                logits = mask_ids(logits, torch.tensor(suppression.ids, dtype=torch.long))
            q = apply_sampling(logits[None], params)[0]
            if truncating:
                ids, probs = truncated_support(q, *truncation)
                token = int(ids[sample_index(probs, float(draws[j]))])
                supports.append((ids, probs))
            else:
                token = int(torch.argmax(q)) if params.is_greedy else sample_index(q, float(draws[j]))
                rows.append(q)
            tokens.append(token)
            if token in self.runner.info.eos_ids or j == gamma - 1 or (cancel is not None and cancel.is_set()):
                break
            with clock.model():
                logits = self.runner.append(session_id, [token], 1)[0]
        return TokenTree.chain(tokens, supports if truncating else rows)


    def _propose_tree(
        self, session_id: str, sequence: list[int], shape: TreeShape, params: SamplingParams, seed: int, choice: int,
        truncation: tuple[int, float],
    ) -> TokenTree:
        with self.clock.whole():
            return self._tree_of(session_id, sequence, shape, params, seed, choice, truncation)

    def _tree_of(
        self, session_id: str, sequence: list[int], shape: TreeShape, params: SamplingParams, seed: int, choice: int,
        truncation: tuple[int, float],
    ) -> TokenTree:
        runner, eos, clock = self.runner, set(self.runner.info.eos_ids), self.clock
        with clock.model():
            common = common_prefix(runner.tokens(session_id), sequence)
            runner.crop(session_id, common)
            logits = runner.append(session_id, sequence[common:], 1)[0]
        start = len(sequence)
        q_at = {-1: self._q(logits, params, truncation)}
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []  # cumulative draft log-probability (the fixed rule's ranking)
        row_of = {-1: start - 1}  # node -> its row in the draft session
        frontier = [-1]
        try:
            for depth in range(1, shape.max_depth + 1):
                fresh = []
                for parent, token, score in _children(frontier, q_at, scores, shape, depth, start + depth - 1, params, seed, choice):
                    tokens.append(token)
                    parents.append(parent)
                    scores.append(score)
                    fresh.append(len(tokens) - 1)
                frontier = [n for n in fresh if tokens[n] not in eos]
                if shape.rule is ChildRule.FIXED:  # EAGLE-2: expand the best top_k of this depth
                    frontier = sorted(frontier, key=lambda n: (-scores[n], n))[: shape.top_k]
                if depth == shape.max_depth or not frontier:
                    break
                held = runner.length(session_id)
                item = ForwardItem(session_id, held, [tokens[n] for n in frontier], [row_of[parents[n]] for n in frontier], list(range(len(frontier))))
                with clock.model():
                    rows = runner.forward([item])[0]
                for i, (node, logits) in enumerate(zip(frontier, rows)):
                    row_of[node] = held + i
                    q_at[node] = self._q(logits, params, truncation)
        finally:
            with clock.model():
                runner.crop(session_id, start)  # the session is the agreed sequence again
        if shape.rule is ChildRule.FIXED:
            return _best_nodes(tokens, parents, scores, q_at, shape.nodes, self.vocab_size)
        return _tree(tokens, parents, q_at, shape.rule, self.vocab_size)

    @staticmethod
    def _q(logits: torch.Tensor, params: SamplingParams, truncation: tuple[int, float]) -> torch.Tensor:
        q = apply_sampling(logits[None], params)[0]
        return truncate(q, *truncation) if not params.is_greedy and truncation != (0, 1.0) else q


def _children(
    frontier: list[int], q_at: dict[int, torch.Tensor], scores: list[float], shape: TreeShape, depth: int, position: int,
    params: SamplingParams, seed: int, choice: int,
) -> list[tuple[int, int, float]]:
    """(parent, token, cumulative log q̂) of the children of every frontier node, in order:
    the ``top_k`` most likely (fixed), or ``widths[depth − 1]`` draws (sampled, each draw of the
    depth on its own lane; without replacement a drawn token leaves q̂ for its siblings)."""
    out: list[tuple[int, int, float]] = []
    lane = 0
    for parent in frontier:
        q = q_at[parent]
        base = scores[parent] if parent >= 0 else 0.0
        if shape.rule is ChildRule.FIXED:
            top = torch.topk(q, max(1, min(shape.top_k, int((q > 0).sum()))))
            out.extend((parent, int(t), base + math.log(float(p))) for t, p in zip(top.indices, top.values) if p > 0)
            continue
        left = q.clone()
        for _ in range(shape.widths[depth - 1]):
            if params.is_greedy:
                token = int(torch.argmax(left))
            else:
                token = sample_index(left, uniform(seed, choice, position, Purpose.DRAFT_SAMPLE, lane=lane))
            lane += 1
            out.append((parent, token, base + math.log(max(float(q[token]), 1e-45))))
            if shape.rule is ChildRule.SAMPLED_DISTINCT:
                left[token] = 0
                if not bool((left > 0).any()):
                    break
    return out


def _tree(tokens: list[int], parents: list[int], q_at: dict[int, torch.Tensor], rule: ChildRule, vocab_size: int) -> TokenTree:
    """The nodes as drafted (parents before children), q̂ at the root and at every expanded node."""
    empty = torch.zeros(vocab_size)
    ids, probs = sparse_rows([q_at[-1], *(q_at.get(n, empty) for n in range(len(tokens)))])
    return TokenTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), ids, probs, rule)


def _best_nodes(
    tokens: list[int], parents: list[int], scores: list[float], q_at: dict[int, torch.Tensor], budget: int, vocab_size: int,
) -> TokenTree:
    """EAGLE-2's rerank: the ``budget`` nodes of best cumulative score — a node never outscores
    its parent, so they form a tree — ordered by depth, siblings best first."""
    kept = sorted(range(len(tokens)), key=lambda n: (-scores[n], n))[:budget]
    depth: dict[int, int] = {-1: 0}
    for n in range(len(tokens)):
        depth[n] = depth[parents[n]] + 1
    order = sorted(kept, key=lambda n: (depth[n], -scores[n], n))
    index = {-1: -1, **{n: i for i, n in enumerate(order)}}
    empty = torch.zeros(vocab_size)
    ids, probs = sparse_rows([q_at[-1], *(q_at.get(n, empty) for n in order)])
    return TokenTree(
        torch.tensor([tokens[n] for n in order], dtype=torch.long), torch.tensor([index[parents[n]] for n in order], dtype=torch.long),
        ids, probs, ChildRule.FIXED,
    )
