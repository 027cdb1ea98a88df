"""``pipeline``: FlowSpec (DESIGN §3.7). The target's layers run on stage workers, and one
request keeps them busy: each round drafts an EAGLE-2 tree, sends its nodes best first in
segments (several in the stages at once), and verifies what each arriving segment allows.

The strategy owns its loop, and the loop is driven by arrivals, taken in the order the segments
were sent (so which tree a token is decided with depends on the seed alone, never on timing):

1. the segment's rows get their target distributions;
2. the walk goes as far as they allow, by the fixed-children rule (DESIGN §3.6: the children
   of a node are fixed before its test; child ``c`` is accepted with probability p'(c), else
   p'(c) ← 0 and renormalised; greedy at T = 0), emitting each token as it is decided. A node
   whose children are all rejected (or a leaf) draws the recovered (or bonus) token from p',
   which ends the round: the next round drafts a new tree after it;
3. segments go out, best unsent live nodes first, until ``in_flight`` of this round are in the
   stages (dead segments of an ended round hold none back). Each carries ``keep``: the stages
   drop the rows the walk killed (FlowSpec's prune) before they append the new ones; the
   tokens are streamed;
4. then, while those segments travel: if the live part of the tree (the walk's node and what
   lies below it) has fewer than a segment's nodes left to send, its best live leaf is expanded
   by a small EAGLE-2 tree drafted from the context it stands for, sent at once if a segment
   can go, else at the next arrival.

Random draws are keyed by the position decided and the candidate's rank among its siblings
(lane), as ``tree`` mode's, so each position uses its own numbers once. A stage that answers 409
(it lost rows or a message) makes the session start again under a new id with every live row
resent; so does a stage that fails when it lists a replica to fail over to. The distributions
already received stay valid (they are the target's).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from app.drafting import DraftModel
from app.drafting.lookup import LOOKUP_PRIOR
from app.engine.round import token_logprobs
from app.engine.session import Session, finish_reason
from app.engine.spec import GenerationRequest, RoundResult, TokenLogprob
from app.engine.strategies.base import Engine, Strategy
from app.targets.base import Traffic, WorkerError
from app.targets.pipeline import PipelineTarget, Segment, StageDown, StageShort
from core.math.random import Purpose, sample_index, uniform
from core.math.sampling import normalised
from core.math.speculative import argmax_lowest
from core.math.shapes import ChildRule, SegmentSchedule, TreeShape
from core.math.tree import TokenTree, path_of
from core.math.walk import try_children
from core.protocol import StageResponse
from core.transform import Transformer

Key = tuple[Any, ...]  # a row: ("s", position) an agreed token; ("n", round, node) a node of that round's tree
_EXPAND_DEPTH = 4  # levels one expansion adds below a leaf
_MAX_RESTARTS = 2  # 409s in a row before the request fails


@dataclass
class _Node:
    token: int
    parent: int  # the node above; −1 = the round's root (the last agreed token before the round)
    depth: int  # 1 for the root's children
    score: float  # cumulative draft log-probability: the order nodes are sent in
    children: list[int] = field(default_factory=list)
    expanded: bool = False


@dataclass
class _Flight:
    """A segment sent and not yet answered: its task, the keys of its scored rows, its round."""

    task: asyncio.Task[tuple[StageResponse, Traffic]]
    scored: list[Key]
    round: int
    nodes: int


class PipelineStrategy(Strategy):
    """Mode ``pipeline`` (DESIGN §3.7): its own loop (``PipelineRun``) over the one pipeline target."""

    async def run(self, engine: Engine, session: Session) -> AsyncGenerator[RoundResult, None]:
        req, target = session.req, engine.pool.workers[0]
        if not isinstance(target, PipelineTarget) or len(engine.pool.workers) != 1:
            raise WorkerError(getattr(target, "name", "w0"), "mode pipeline needs exactly one target, a pipeline of stage workers", 400)
        transformers = (session.transformer, engine.transformer(req))
        run = PipelineRun(engine.draft, target, req, session.id, req.spec.pipeline or SegmentSchedule(), engine.vocab_size, session.max_context, session.eos_ids, transformers)
        async with aclosing(run.run()) as results:
            async for result in results:
                result.finish_reason = finish_reason(result, len(run.sequence) - len(req.prompt), len(run.sequence), req, session.eos_ids, session.max_context)
                if result.finish_reason and not result.rounds_ended:
                    result.rounds_ended = 1  # the last tree, cut short by EOS or the length
                    result.drafted, result.accepted = run.round_nodes, len(run.path)
                yield result
                if result.finish_reason:
                    return


class PipelineRun:
    """One choice of one request through a pipeline target (the module's docstring)."""

    def __init__(
        self, draft: DraftModel, target: PipelineTarget, req: GenerationRequest, session_id: str, schedule: SegmentSchedule,
        vocab_size: int, max_context: int, eos_ids: set[int], transformers: tuple[Transformer | None, Transformer | None] = (None, None),
    ) -> None:
        self.draft, self.target, self.req, self.session_id = draft, target, req, session_id
        self.drafting, self.forcing = transformers  # the request's transform (DESIGN §3.9): the draft's; the walk's forced tokens (its own matcher)
        self.schedule, self.vocab_size, self.max_context, self.eos_ids = schedule, vocab_size, max_context, eos_ids
        self.in_flight = schedule.in_flight or target.stages
        self.sequence = list(req.prompt)
        self.rows: list[Key] = []  # what the stages hold once every segment sent is applied
        self.dist: dict[Key, torch.Tensor] = {}  # [V] float64: T(p) at a row
        self.flight: deque[_Flight] = deque()
        self.round = -1
        self.nodes: list[_Node] = []
        self.root_children: list[int] = []
        self.root_pos = 0  # the position of the round's root token
        self.at = -1  # the walk's node
        self.path: list[int] = []  # the round's accepted nodes
        self.sent: set[int] = set()  # the round's nodes sent
        self.round_nodes = 0  # nodes sent in the round
        # greedy decides by the argmax (ties to the lowest id, as compress_top_k keeps them) and
        # reports at most top_logprobs alternatives: the top-k rows carry all of it, exactly
        greedy_k = max(1, req.top_logprobs or 0) if req.params.is_greedy else None
        self.sampling = {**req.sampling_wire(), "k": greedy_k}

    # ----------------------------------------------------------------- the loop

    async def run(self) -> AsyncGenerator[RoundResult, None]:
        try:
            timing: dict[str, float] = {}
            started = time.perf_counter()
            await self._new_round(timing)
            self._fill()
            await self._expand(timing)
            draft_s = time.perf_counter() - started
            restarts = 0
            while self.flight:
                flight = self.flight.popleft()
                waited = time.perf_counter()
                try:
                    resp, traffic = await flight.task
                except StageShort as exc:
                    restarts += 1
                    if restarts > _MAX_RESTARTS:
                        raise WorkerError(self.target.name, f"the stages kept losing the session ({exc}) after {_MAX_RESTARTS} starts from zero") from None
                    await self._restart()
                    continue
                except StageDown as exc:
                    if not self.target.fail_over(exc.stage):
                        raise
                    await self._restart()  # on the new chain, from zero (a failover is bounded by the replicas listed)
                    continue
                restarts = 0
                result = RoundResult([], drafted=0, accepted=0, traffic=traffic, logprobs=[] if self.req.top_logprobs is not None else None)
                result.verify_s = time.perf_counter() - waited
                result.model_s = result.busy_s = float(np.asarray(resp.stage_ms).sum()) / 1e3 if resp.stage_ms is not None else 0.0
                result.hop_bytes = [int(b) for b in np.asarray(resp.hop_bytes if resp.hop_bytes is not None else [])]
                result.turns = 1
                if flight.round == self.round:
                    self._store(flight.scored, resp)
                ended = self._walk(result)
                going_on = self._room() > 0 and not self._stopped(result.tokens)
                started = time.perf_counter()
                if ended:
                    result.drafted, result.accepted, result.rounds_ended = self.round_nodes, len(self.path), 1
                    if going_on:
                        await self._new_round(timing)
                if going_on:
                    self._fill()
                result.draft_s = draft_s + time.perf_counter() - started
                result.seconds = {"draft_model": timing.pop("draft_model", 0.0), "draft_sampling": timing.pop("draft_sampling", 0.0)}
                yield result  # the tokens go out before the expansion below is drafted
                started = time.perf_counter()
                if going_on:  # while the segments travel: what the next arrival will send
                    await self._expand(timing)
                draft_s = time.perf_counter() - started
            raise RuntimeError("pipeline: nothing in flight and nothing left to send before the answer ended")
        finally:
            await self._drop_flights()

    def _stopped(self, tokens: list[int]) -> bool:
        return not self.req.ignore_eos and any(t in self.eos_ids for t in tokens)

    def _room(self) -> int:
        generated = len(self.sequence) - len(self.req.prompt)
        return min(self.req.max_tokens - generated, self.max_context - len(self.sequence))

    async def _drop_flights(self) -> None:
        for flight in self.flight:
            flight.task.cancel()
        await asyncio.gather(*(f.task for f in self.flight), return_exceptions=True)
        self.flight.clear()

    async def _restart(self) -> None:
        """A stage lost the session: drop what is in flight, start again under a new id, resend."""
        await self._drop_flights()
        self.target.restart(self.session_id)
        self.rows = []
        self.sent.clear()
        self._fill()

    # ----------------------------------------------------------------- the tree

    async def _new_round(self, timing: dict[str, float]) -> None:
        """A new tree after the last agreed token (the path of the last round becomes agreed rows)."""
        done = self.round
        self.rows = [("s", self.root_pos + self.nodes[k[2]].depth) if k[0] == "n" and k[1] == done and k[2] in self.path else k for k in self.rows]
        self.round += 1
        self.root_pos, self.at, self.path, self.sent, self.round_nodes = len(self.sequence) - 1, -1, [], set(), 0
        self.nodes, self.root_children = [], []
        self.dist = {k: v for k, v in self.dist.items() if k[0] == "s" and k[1] == self.root_pos}
        depth = min(self.schedule.tree.depth, self._room() - 1)
        if depth >= 1:
            shape = TreeShape(ChildRule.FIXED, nodes=self.schedule.tree.nodes, depth=depth, top_k=self.schedule.tree.top_k)
            tree = await self._propose(self.sequence, shape, timing)
            self._attach(tree, -1)

    async def _expand(self, timing: dict[str, float]) -> None:
        """The best live leaf, expanded, when the live tree has less than a segment left to send;
        sent at once if a segment can go, else at the next arrival."""
        if not self.schedule.expand or self._room() <= 0:
            return
        live = self._live_nodes()
        if sum(1 for n in live if n not in self.sent) >= self.schedule.segment:
            return
        base = self.nodes[self.at].depth if self.at >= 0 else 0
        leaves = [
            n for n in live
            if not self.nodes[n].children and not self.nodes[n].expanded and self.nodes[n].depth - base < self.schedule.tree.depth
        ]
        if not leaves:
            return
        leaf = min(leaves, key=lambda n: (-self.nodes[n].score, n))
        below = self.nodes[leaf].depth - base  # tokens the walk emits before the leaf's children
        depth = min(_EXPAND_DEPTH, self.schedule.tree.depth - below, self._room() - 1 - below)
        self.nodes[leaf].expanded = True
        if depth < 1:
            return
        context = [*self.sequence, *(self.nodes[n].token for n in self._path_to(leaf, stop=self.at))]
        shape = TreeShape(ChildRule.FIXED, nodes=self.schedule.segment, depth=depth, top_k=self.schedule.tree.top_k)
        self._attach(await self._propose(context, shape, timing), leaf)
        self._fill()

    async def _propose(self, context: list[int], shape: TreeShape, timing: dict[str, float]) -> TokenTree:
        return await self.draft.propose_tree(self.req.draft(self.session_id, context, self.drafting), shape, timing=timing)

    def _attach(self, tree: TokenTree, under: int) -> None:
        """The draft's tree as the children of ``under`` (−1: the root), scores accumulated."""
        first, parents = len(self.nodes), tree.parents.tolist()
        base_depth = self.nodes[under].depth if under >= 0 else 0
        base_score = self.nodes[under].score if under >= 0 else 0.0
        qs = tree.q_values().tolist()
        lookup = tree.deterministic.tolist() if tree.deterministic is not None else [False] * len(tree)
        for i, (token, parent) in enumerate(zip(tree.tokens.tolist(), parents)):
            above = under if parent < 0 else first + parent
            q = LOOKUP_PRIOR if lookup[i] and not qs[i] > LOOKUP_PRIOR else qs[i]  # a lookup node the draft did not score: its prior
            score = (self.nodes[above].score if above >= 0 else base_score) + (math.log(q) if q > 0 else -1e9)
            depth = (self.nodes[above].depth if above >= 0 else base_depth) + 1
            self.nodes.append(_Node(int(token), above, depth, score))
            (self.nodes[above].children if above >= 0 else self.root_children).append(first + i)

    def _path_to(self, node: int, stop: int = -1) -> list[int]:
        """The nodes from below ``stop`` down to ``node``, in order."""
        return path_of(node, [n.parent for n in self.nodes], stop)

    def _live_nodes(self) -> list[int]:
        """The walk's node and every node below it (all of the round's nodes at the root)."""
        if self.at < 0:
            return list(range(len(self.nodes)))
        live, stack = [], [self.at]
        while stack:
            node = stack.pop()
            live.append(node)
            stack.extend(self.nodes[node].children)
        return sorted(live)

    def _is_live(self, key: Key) -> bool:
        if key[0] == "s":
            return True
        if key[1] != self.round:
            return False
        node = key[2]
        if self.at < 0 or node in self.path:
            return True
        while node >= 0:  # below the walk's node?
            if node == self.at:
                return True
            node = self.nodes[node].parent
        return False

    # ----------------------------------------------------------------- segments

    def _fill(self) -> None:
        """Segments out until ``in_flight`` of this round are in the stages (a round that ended
        leaves dead ones there, which hold no new one back) or nothing is left to send."""
        while sum(1 for f in self.flight if f.round == self.round) < self.in_flight:
            built = self._segment()
            if built is None:
                return
            segment, scored, nodes = built
            task = asyncio.get_running_loop().create_task(self.target.forward(self.session_id, segment, self.sampling))
            self.flight.append(_Flight(task, scored, self.round, nodes))

    def _segment(self) -> tuple[Segment, list[Key], int] | None:
        """The next segment: the prune, the agreed tokens the stages lack, the best unsent live
        nodes; None when there is nothing to send."""
        held = set(self.rows)
        agreed = [p for p in range(len(self.sequence)) if ("s", p) not in held and not self._on_path(p)]
        wanted = [*self.path[:-1], *self._live_nodes()]  # after a restart the path is resent too
        unsent = sorted((n for n in wanted if n not in self.sent), key=lambda n: (-self.nodes[n].score, n))[: self.schedule.segment]
        if not agreed and not unsent:
            return None
        kept = [i for i, key in enumerate(self.rows) if self._is_live(key)]
        keep = None if len(kept) == len(self.rows) else kept
        self.rows = [self.rows[i] for i in kept]
        prefix = len(self.rows)
        new: list[Key] = [("s", p) for p in agreed] + [("n", self.round, n) for n in unsent]
        place = {key: i for i, key in enumerate(self.rows)}
        for i, key in enumerate(new):
            place[key] = prefix + i
        tokens, parents = [], []
        for key in new:
            if key[0] == "s":
                tokens.append(self.sequence[key[1]])
                parents.append(place[("s", key[1] - 1)] if key[1] > 0 else -1)
            else:
                node = self.nodes[key[2]]
                tokens.append(node.token)
                parents.append(place[self._key(node.parent)])
        root = self._key(-1)
        score_from = new.index(root) if root in new else (len(agreed) if agreed else 0)
        self.rows.extend(new)
        self.sent.update(unsent)
        self.round_nodes += len(unsent)
        return Segment(prefix, tokens, parents, keep, score_from), new[score_from:], len(unsent)

    def _on_path(self, position: int) -> bool:
        """An agreed position held as a node row of this round's path (not an ``s`` row yet)."""
        depth = position - self.root_pos
        return 1 <= depth <= len(self.path)

    def _key(self, node: int) -> Key:
        return ("s", self.root_pos) if node < 0 else ("n", self.round, node)

    def _store(self, scored: list[Key], resp: StageResponse) -> None:
        probs = torch.from_numpy(np.asarray(resp.probs, dtype=np.float64)) if resp.probs is not None else torch.zeros(0, self.vocab_size)
        if resp.ids is not None:  # top-k rows (greedy): the rest of each row is 0
            ids = torch.from_numpy(np.asarray(resp.ids, dtype=np.int64))
            probs = torch.zeros(len(ids), self.vocab_size, dtype=torch.float64).scatter_(1, ids, probs)
        elif not self.req.params.is_greedy:
            probs = normalised(probs)  # an fp32 row sums to 1 ± 1e-6 (core.math.sampling)
        for key, row in zip(scored, probs):
            self.dist.setdefault(key, row)

    # ----------------------------------------------------------------- the walk

    def _walk(self, result: RoundResult) -> bool:
        """Decide every position the distributions received allow; True when the round ended."""
        req = self.req
        while self._room() > 0:
            forced = self.forcing.forced(self.sequence) if self.forcing is not None and self.forcing.matcher is not None else None
            if forced is not None:  # the grammar allows one token: T(p) is a point mass there, no need to wait for its row
                p = torch.zeros(self.vocab_size, dtype=torch.float64)
                p[forced] = 1.0
            else:
                p = self.dist.get(self._key(self.at))
            if p is None:
                return False
            children = self.nodes[self.at].children if self.at >= 0 else self.root_children
            position = len(self.sequence)
            tokens = [self.nodes[c].token for c in children]
            if req.params.is_greedy:
                target = argmax_lowest(p[None])[0]
                rank = tokens.index(target) if target in tokens else None
                token = target
            else:
                draws = torch.tensor([uniform(req.seed, req.choice, position, Purpose.ACCEPT, lane=r) for r in range(len(tokens))], dtype=torch.float64)
                rank, left = try_children(p, p, tokens, ChildRule.FIXED, draws)
                if rank is None:
                    purpose = Purpose.RESIDUAL if children else Purpose.BONUS
                    token = sample_index(left, uniform(req.seed, req.choice, position, purpose))
            self.sequence.append(token if rank is None else tokens[rank])
            result.tokens.append(self.sequence[-1])
            if result.logprobs is not None and forced is not None:
                result.logprobs.append(TokenLogprob(forced, 0.0, [(forced, 0.0)] if req.top_logprobs else []))
            elif result.logprobs is not None:
                result.logprobs.extend(self._logprobs(p, self.sequence[-1]))
            if rank is None:
                return True
            self.at = children[rank]
            self.path.append(self.at)
            if self._stopped(result.tokens[-1:]):
                return False
        return False

    def _logprobs(self, p: torch.Tensor, token: int) -> list[TokenLogprob]:
        return token_logprobs(p[None], [token], self.req.top_logprobs)
