"""``pipeline``: FlowSpec (docs/design.md §3.7, docs/modes.md), its own loop driven by arrivals in the
segments' send order: the seed alone picks the deciding tree."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from app.drafting.lookup import LOOKUP_PRIOR
from app.drafting.request import delta
from app.engine.late import LateDraft
from app.engine.round import token_logprobs
from app.engine.session import Session, finish_reason
from app.engine.spec import PipelineTally, RoundCost, RoundResult, TokenLogprob
from app.engine.strategies.base import EngineView, LoopStrategy
from app.targets.channel import Traffic
from app.targets.failures import WorkerError
from app.targets.pipeline import PipelineTarget, Segment, StageDown, StageShort
from core.math.random import Purpose, sample_index, uniform
from core.math.sampling import normalised
from core.math.shapes import ChildRule, SegmentSchedule, TreeShape
from core.math.speculative import argmax_lowest
from core.math.tree import TokenTree, path_of
from core.math.walk import try_children
from core.protocol import StageResponse

# a row: ("s", position) an agreed token; ("n", round, node) a node of that round's tree
Key = tuple[Any, ...]
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
class _Flight:  # a segment sent and not yet answered
    task: asyncio.Task[tuple[StageResponse, Traffic]]
    scored: list[Key]  # the keys of its scored rows
    round: int


class PipelineStrategy(LoopStrategy):
    """Mode ``pipeline`` (docs/design.md §3.7): its own loop (``PipelineRun``) over the one pipeline
    target."""

    def run(self, engine: EngineView, session: Session) -> AsyncGenerator[RoundResult, None]:
        target = engine.pool.workers[0]
        if not isinstance(target, PipelineTarget) or len(engine.pool.workers) != 1:
            raise WorkerError(
                getattr(target, "name", "w0"),
                "mode pipeline needs exactly one target, a pipeline of stage workers",
                400,
            )
        return PipelineRun(engine, target, session).run()


class PipelineRun:
    """One choice through a pipeline target: walk what arrives (§3.6's fixed-children rule), prune, send,
    expand (docs/modes.md)."""

    def __init__(self, engine: EngineView, target: PipelineTarget, session: Session) -> None:
        req = self.req = session.req
        self.draft, self.target, self.session_id, self.vocab_size = (
            engine.draft,
            target,
            session.id,
            engine.vocab_size,
        )
        self.waits = engine.prefill_waits
        # the draft's transform; the walk's (its own matcher)
        self.drafting, self.forcing = session.transformer, engine.transformer(req)
        self.schedule, self.eos_ids = req.spec.pipeline or SegmentSchedule(), session.eos_ids
        self.in_flight = self.schedule.in_flight or target.stages
        # its own copy: the session's output stays out of draft.free's lookup index
        self.own = replace(session, sequence=list(req.prompt))
        self.sequence = self.own.sequence
        self.rows: list[Key] = []  # what the stages hold once every segment sent is applied
        self.dist: dict[Key, torch.Tensor] = {}  # [V] float64: T(p) at a row
        self.flight: deque[_Flight] = deque()
        self.round = -1
        self.nodes: list[_Node] = []
        self.root = _Node(-1, -1, 0, 0.0)  # the round's root: its children are the tree's first level
        self.root_pos = 0  # the position of the round's root token
        self.at = -1  # the walk's node
        self.path: list[int] = []  # the round's accepted nodes
        self.sent: set[int] = set()  # the round's nodes sent
        self.round_nodes = 0  # nodes sent in the round
        # greedy decides by the argmax (ties to the lowest id, as compress_top_k keeps them) and
        # reports at most top_logprobs alternatives: the top-k rows carry all of it, exactly
        greedy_k = max(1, req.top_logprobs or 0) if req.params.is_greedy else None
        self.sampling = {**req.sampling_wire(), "k": greedy_k}
        # the draft's prefill while the first trees carry no draft (app.engine.late)
        self.late: LateDraft | None = None
        self.bare = False  # the round's tree carries no draft

    async def run(self) -> AsyncGenerator[RoundResult, None]:
        self.late = LateDraft.start(self.draft, self.own, self.waits)
        try:
            timing: dict[str, float] = {}
            started = time.perf_counter()
            await self._new_round(timing)
            self._fill()
            await self._expand(timing)
            draft_s, restarts = time.perf_counter() - started, 0
            while self.flight:
                flight = self.flight.popleft()
                waited = time.perf_counter()
                try:
                    resp, traffic = await flight.task
                except (StageShort, StageDown) as exc:
                    if isinstance(exc, StageDown) and not self.target.fail_over(exc.stage):
                        raise
                    restarts += isinstance(exc, StageShort)
                    if restarts > _MAX_RESTARTS:
                        raise WorkerError(
                            self.target.name,
                            f"the stages kept losing the session ({exc}) after {_MAX_RESTARTS} "
                            "starts from zero",
                        ) from None
                    # from zero (after a failover: on the new chain, bounded by the replicas listed)
                    await self._restart()
                    continue
                restarts = 0
                model_s = float(np.asarray(resp.stage_ms).sum()) / 1e3 if resp.stage_ms is not None else 0.0
                result = RoundResult(
                    [],
                    0,
                    0,
                    traffic,
                    [] if self.req.top_logprobs is not None else None,
                    cost=RoundCost(verify_s=time.perf_counter() - waited, model_s=model_s, busy_s=model_s),
                    pipeline=PipelineTally(
                        turns=1,
                        hop_bytes=[
                            int(b) for b in np.asarray(resp.hop_bytes if resp.hop_bytes is not None else [])
                        ],
                    ),
                )
                if flight.round == self.round:
                    self._store(flight.scored, resp)
                ended = self._walk(result)
                result.finish_reason = finish_reason(
                    result,
                    self.own.generated,
                    len(self.sequence),
                    self.req,
                    self.eos_ids,
                    self.own.max_context,
                )
                started = time.perf_counter()
                if ended or result.finish_reason:
                    # a walk that ended, or the last tree cut short by EOS or the length
                    result.drafted, result.accepted = self.round_nodes, len(self.path)
                    result.pipeline.rounds_ended, result.drafting.without_draft = 1, int(self.bare)
                if not result.finish_reason:
                    if ended:
                        await self._new_round(timing)
                    self._fill()
                result.cost.draft_s = draft_s + time.perf_counter() - started
                result.cost.seconds = {
                    "draft_model": timing.pop("draft_model", 0.0),
                    "draft_sampling": timing.pop("draft_sampling", 0.0),
                }
                yield result  # the tokens go out before the expansion below is drafted
                if result.finish_reason:
                    return
                started = time.perf_counter()
                await self._expand(timing)  # while the segments travel: what the next arrival will send
                draft_s = time.perf_counter() - started
            raise RuntimeError("pipeline: nothing in flight and nothing left to send before the answer ended")
        finally:
            try:
                await self._drop_flights()
            finally:
                if self.late is not None:
                    await asyncio.shield(self.late.close())

    async def _drop_flights(self) -> None:
        for flight in self.flight:
            flight.task.cancel()
        await asyncio.gather(*(f.task for f in self.flight), return_exceptions=True)
        self.flight.clear()

    async def _restart(self) -> None:
        """A stage lost the session: drop what is in flight, start again under a new id, resend."""
        await self._drop_flights()
        self.target.restart(self.session_id)
        self.rows, self.sent = [], set()
        self._fill()

    async def _new_round(self, timing: dict[str, float]) -> None:
        """A new tree after the last agreed token (the path of the last round becomes agreed rows)."""
        self.rows = [
            ("s", self.root_pos + self.nodes[k[2]].depth)
            if k[0] == "n" and k[1] == self.round and k[2] in self.path
            else k
            for k in self.rows
        ]
        self.round += 1
        self.root_pos, self.at, self.path, self.sent, self.round_nodes = (
            len(self.sequence) - 1,
            -1,
            [],
            set(),
            0,
        )
        self.nodes, self.root = [], _Node(-1, -1, 0, 0.0)
        self.dist = {k: v for k, v in self.dist.items() if k[0] == "s" and k[1] == self.root_pos}
        depth = min(self.schedule.tree.depth, self.own.room() - 1)
        # the root alone: the stages sample the round's token
        self.bare = depth >= 1 and self.late is not None and self.late.skips()
        if depth >= 1 and not self.bare:
            shape = TreeShape(
                ChildRule.FIXED, nodes=self.schedule.tree.nodes, depth=depth, top_k=self.schedule.tree.top_k
            )
            self._attach(await self._propose(self.sequence, shape, timing), -1)

    async def _expand(self, timing: dict[str, float]) -> None:
        """The best live leaf, expanded, when the live tree has less than a segment left to send."""
        live = self._live_nodes()
        if (
            not self.schedule.expand
            or self.own.room() <= 0
            or sum(1 for n in live if n not in self.sent) >= self.schedule.segment
        ):
            return
        base = self._node(self.at).depth
        leaf = min(
            (
                n
                for n in live
                if not self.nodes[n].children
                and not self.nodes[n].expanded
                and self.nodes[n].depth - base < self.schedule.tree.depth
            ),
            key=lambda n: (-self.nodes[n].score, n),
            default=None,
        )
        if leaf is None:
            return
        below = self.nodes[leaf].depth - base  # tokens the walk emits before the leaf's children
        depth = min(_EXPAND_DEPTH, self.schedule.tree.depth - below, self.own.room() - 1 - below)
        self.nodes[leaf].expanded = True
        if depth < 1:
            return
        context = [
            *self.sequence,
            *(self.nodes[n].token for n in path_of(leaf, [n.parent for n in self.nodes], self.at)),
        ]
        shape = TreeShape(
            ChildRule.FIXED, nodes=self.schedule.segment, depth=depth, top_k=self.schedule.tree.top_k
        )
        self._attach(await self._propose(context, shape, timing), leaf)
        self._fill()

    async def _propose(self, context: list[int], shape: TreeShape, timing: dict[str, float]) -> TokenTree:
        return await self.draft.propose_tree(
            self.req.draft(self.session_id, context, self.drafting), shape, timing=timing
        )

    def _attach(self, tree: TokenTree, under: int) -> None:
        """The draft's tree as the children of ``under`` (−1: the root), scores accumulated."""
        first, qs = len(self.nodes), tree.q_values().tolist()
        lookup = tree.deterministic.tolist() if tree.deterministic is not None else [False] * len(qs)
        for i, (token, parent, q, looked_up) in enumerate(
            zip(tree.tokens.tolist(), tree.parents.tolist(), qs, lookup)
        ):
            above = under if parent < 0 else first + parent
            # a lookup node the draft did not score: its prior
            q = LOOKUP_PRIOR if looked_up and not q > LOOKUP_PRIOR else q
            up = self._node(above)
            self.nodes.append(
                _Node(int(token), above, up.depth + 1, up.score + (math.log(q) if q > 0 else -1e9))
            )
            up.children.append(first + i)

    def _node(self, node: int) -> _Node:
        return self.nodes[node] if node >= 0 else self.root

    def _live_nodes(self) -> list[int]:
        """The walk's node and every node below it (all of the round's nodes at the root); parents come before
        children."""
        live = {self.at}
        for n in range(self.at + 1, len(self.nodes)):
            if self.nodes[n].parent in live:
                live.add(n)
        return sorted(live - {-1})

    def _fill(self) -> None:
        """Segments out until ``in_flight`` of this round are in the stages or nothing is left to send."""
        while (
            sum(1 for f in self.flight if f.round == self.round) < self.in_flight
            and (built := self._segment()) is not None
        ):
            segment, scored = built
            task = asyncio.get_running_loop().create_task(
                self.target.forward(self.session_id, segment, self.sampling)
            )
            self.flight.append(_Flight(task, scored, self.round))

    def _segment(self) -> tuple[Segment, list[Key]] | None:
        """The next segment: the prune, the agreed tokens the stages lack, the best unsent live nodes; or
        None."""
        held, live = set(self.rows), self._live_nodes()
        # an agreed position on this round's path is held as a node row, not an ``s`` row yet
        agreed = [
            p
            for p in range(len(self.sequence))
            if ("s", p) not in held and not 1 <= p - self.root_pos <= len(self.path)
        ]
        wanted = [*self.path[:-1], *live]  # after a restart the path is resent too
        unsent = sorted((n for n in wanted if n not in self.sent), key=lambda n: (-self.nodes[n].score, n))[
            : self.schedule.segment
        ]
        if not agreed and not unsent:
            return None
        alive = {*self.path, *live}  # the rows of this round the walk has not killed
        kept = [
            i
            for i, key in enumerate(self.rows)
            if key[0] == "s" or (key[1] == self.round and key[2] in alive)
        ]
        keep = None if len(kept) == len(self.rows) else kept
        self.rows = [self.rows[i] for i in kept]
        prefix = len(self.rows)
        new: list[Key] = [("s", p) for p in agreed] + [("n", self.round, n) for n in unsent]
        # ("s", −1): above the first token
        place = {("s", -1): -1} | {key: i for i, key in enumerate([*self.rows, *new])}
        parents = [place[("s", k[1] - 1) if k[0] == "s" else self._key(self.nodes[k[2]].parent)] for k in new]
        tokens = [self.sequence[k[1]] if k[0] == "s" else self.nodes[k[2]].token for k in new]
        root = self._key(-1)
        score_from = new.index(root) if root in new else (len(agreed) if agreed else 0)
        self.rows.extend(new)
        self.sent.update(unsent)
        self.round_nodes += len(unsent)
        return Segment(prefix, tokens, parents, keep, score_from), new[score_from:]

    def _key(self, node: int) -> Key:
        return ("s", self.root_pos) if node < 0 else ("n", self.round, node)

    def _store(self, scored: list[Key], resp: StageResponse) -> None:
        probs = (
            torch.from_numpy(np.asarray(resp.probs, dtype=np.float64))
            if resp.probs is not None
            else torch.zeros(0, self.vocab_size)
        )
        if resp.ids is not None:  # top-k rows (greedy): the rest of each row is 0
            ids = torch.from_numpy(np.asarray(resp.ids, dtype=np.int64))
            probs = torch.zeros(len(ids), self.vocab_size, dtype=torch.float64).scatter_(1, ids, probs)
        elif not self.req.params.is_greedy:
            probs = normalised(probs)  # an fp32 row sums to 1 ± 1e-6 (core.math.sampling)
        for key, row in zip(scored, probs):
            self.dist.setdefault(key, row)

    def _walk(self, result: RoundResult) -> bool:
        """Decide every position the distributions received allow; True when the round ended."""
        req = self.req
        while self.own.room() > 0:
            forced = (
                self.forcing.forced(self.sequence)
                if self.forcing is not None and self.forcing.matcher is not None
                else None
            )
            # the grammar allows one token: T(p) is a point mass there, no need to wait for its row
            p = delta(forced, self.vocab_size) if forced is not None else self.dist.get(self._key(self.at))
            if p is None:
                return False
            children = self._node(self.at).children
            tokens = [self.nodes[c].token for c in children]
            if req.params.is_greedy:
                token = argmax_lowest(p[None])[0]
                rank = tokens.index(token) if token in tokens else None
            else:
                position = len(self.sequence)
                draws = torch.tensor(
                    [
                        uniform(req.seed, req.choice, position, Purpose.ACCEPT, lane=r)
                        for r in range(len(tokens))
                    ],
                    dtype=torch.float64,
                )
                rank, left = try_children(p, p, tokens, ChildRule.FIXED, draws)
                purpose = Purpose.RESIDUAL if children else Purpose.BONUS
                token = (
                    tokens[rank]
                    if rank is not None
                    else sample_index(left, uniform(req.seed, req.choice, position, purpose))
                )
            self.sequence.append(token)
            result.tokens.append(token)
            if result.logprobs is not None and forced is not None:
                result.logprobs.append(TokenLogprob(forced, 0.0, [(forced, 0.0)] if req.top_logprobs else []))
            elif result.logprobs is not None:
                result.logprobs.extend(token_logprobs(p[None], [token], req.top_logprobs))
            if rank is None:
                return True
            self.at = children[rank]
            self.path.append(self.at)
            if not req.ignore_eos and token in self.eos_ids:
                return False
        return False
