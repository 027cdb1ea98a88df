"""The engine's one loop for every round-by-round mode (docs/design.md §3): forced tokens, or draft → verify
(the strategy) → commit ``accepted + 1``; what a round verifies (``forced``, ``propose``: docs/design.md
§3.6)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import replace

import torch

from app.adaptive import GammaController
from app.drafting.batcher import DraftSeconds
from app.drafting.drafters import DRAFTERS, DraftModel
from app.engine.echo import score_prompt
from app.engine.late import LateDraft
from app.engine.overlap import Overlap
from app.engine.round import Round
from app.engine.session import Session
from app.engine.spec import GenerationRequest, RoundCost, RoundResult, TokenLogprob
from app.engine.strategies import STRATEGIES, RoundStrategy
from app.targets.channel import Traffic
from app.targets.pool import TargetSet
from core.grammar import Grammars
from core.math.shapes import TreeShape
from core.math.tree import TokenTree
from core.modes import MODES
from core.names import Mode
from core.transform import LogitsTransform, TransformSpec

__all__ = ["STRATEGIES", "Engine"]

# tokens a grammar forces that a draft may carry beyond its shape (free: no draft step of their own)
FORCED_EXTRA = 8
# the longest chain sent (γ ≤ 32; a worker decodes tokens + draft, ≤ 32 keeps llama.cpp's numerics)
MAX_DRAFT = 32
# a round without a draft (frozen: one for them all, not one built per round)
NO_DRAFT = TokenTree.chain([], [])


class Engine:
    def __init__(self, draft: DraftModel, pool: TargetSet, eos_ids: list[int], max_context: int) -> None:
        self.draft = draft
        self.pool = pool
        self.eos_ids = set(eos_ids)
        self.max_context = max_context
        self.vocab_size = draft.vocab_size
        self.weights = torch.tensor(pool.weights, dtype=torch.float64)
        # the grammars over the draft's tokenizer (set by the Gateway on first use)
        self.grammars: Grammars | None = None
        # a late draft's prefill starts after the first round (app.engine.late): the targets share its cores
        self.prefill_waits = False

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[RoundResult, None]:
        """Results of one choice until EOS or a length limit; the caller may stop early."""
        session = self._open(self._with_min_tokens(req))
        try:
            # a round strategy runs in this loop; a loop strategy (pipeline) in its own
            strategy = STRATEGIES[req.spec.verifier]
            results = (
                self.rounds(session, strategy)
                if isinstance(strategy, RoundStrategy)
                else strategy.run(self, session)
            )
            async with aclosing(results):
                async for result in results:
                    yield result
                    if result.finish_reason:
                        return
        finally:
            await asyncio.shield(self._free(session.id, session.output))

    async def rounds(self, session: Session, strategy: RoundStrategy) -> AsyncGenerator[RoundResult, None]:
        """forced? → propose (none while a late draft prefills) → verify → commit, until EOS or a length
        limit."""
        if session.req.prompt_logprobs is not None:
            yield await score_prompt(self._round(session, session.req, NO_DRAFT))
        overlap = Overlap(self.draft, self.eos_ids) if session.req.spec.overlap else None
        late = LateDraft.start(self.draft, session, self.prefill_waits)
        try:
            while not session.finished:
                room = session.room()
                if room <= 0:
                    yield RoundResult([], drafted=0, accepted=0, traffic=Traffic(), finish_reason="length")
                    return
                if (tokens := forced(session, room)) is not None:
                    # the grammar allows one token: decided here, no draft, no call
                    if overlap is not None:
                        overlap.take()  # prepared after the draft, not after these tokens
                    yield session.commit(tokens)
                    continue
                wanted, keyed, timing, started = (
                    session.gamma(),
                    session.keyed(),
                    DraftSeconds(),
                    time.perf_counter(),
                )
                if late is not None and late.skips():
                    # the targets sample the round's token, as autoregressive's
                    rnd = self._round(session, keyed, NO_DRAFT)
                    result = _timed(await strategy.verify(rnd), rnd, started, started, timing, False)
                    result.drafting.without_draft = 1
                    yield session.commit(result, rnd.draft)
                    continue
                prepared = overlap.take() if overlap is not None else None
                draft = self._scorable(
                    session, await propose(self.draft, session, room, wanted, keyed, timing, prepared)
                )
                drafted = time.perf_counter()
                rnd = self._round(session, keyed, draft)
                if overlap is not None:
                    overlap.start(session, draft, room, wanted, session.keyed(1))
                result = _timed(
                    await self._verify(strategy, rnd, overlap),
                    rnd,
                    started,
                    drafted,
                    timing,
                    prepared is not None,
                )
                if overlap is not None:
                    await overlap.settle(draft, result)
                self._observe(session, result, draft, wanted)
                yield session.commit(result, draft)
        finally:
            if late is not None:
                await asyncio.shield(late.close())

    def transformer(self, req: GenerationRequest) -> LogitsTransform | None:
        """The gateway's side of the request's transform: the draft's, and the forced tokens'."""
        if req.transform is None:
            return None
        return LogitsTransform.build(req.transform, self.vocab_size, self.grammars)

    def _round(self, session: Session, req: GenerationRequest, draft: TokenTree) -> Round:
        return Round(
            self.pool,
            self.weights,
            self.vocab_size,
            req,
            session.id,
            session.sequence,
            session.agreed,
            draft,
            Traffic(),
            path=session.path,
            transformer=session.verifier,
        )

    def _open(self, req: GenerationRequest) -> Session:
        transformer = self.transformer(req)
        # its own matcher: the draft's runs ahead with overlap
        verifier = self.transformer(req) if transformer is not None and transformer.masks_any else None
        auto = (
            GammaController(req.spec.overlap, start=req.spec.num_draft_tokens)
            if req.spec.auto_gamma and not req.seeded and MODES[req.spec.mode].drafts
            else None
        )
        agreed = [0] * len(self.pool.workers)
        return Session(
            f"{req.request_id}-{req.choice}",
            req,
            list(req.prompt),
            agreed,
            self.max_context,
            self.eos_ids,
            transformer,
            verifier,
            auto,
        )

    def _with_min_tokens(self, req: GenerationRequest) -> GenerationRequest:
        """min_tokens as the first step of the request's transform (vLLM's order, docs/design.md §3.9; none
        with ignore_eos)."""
        if req.min_tokens <= 0 or req.ignore_eos or not self.eos_ids:
            return req
        base = req.transform if req.transform is not None else TransformSpec(prompt_len=len(req.prompt))
        return replace(
            req, transform=replace(base, min_tokens=req.min_tokens, eos_ids=tuple(sorted(self.eos_ids)))
        )

    def _scorable(self, session: Session, draft: TokenTree) -> TokenTree:
        """The draft cut to what every target can score (an engine may not score every token)."""
        scorable = self.pool.scorable(session.sequence, draft.ids())
        return draft.head(scorable) if scorable < len(draft) else draft

    @staticmethod
    async def _verify(strategy: RoundStrategy, rnd: Round, overlap: Overlap | None) -> RoundResult:
        try:
            return await strategy.verify(rnd)
        except BaseException:
            if overlap is not None:
                overlap.stop()
            raise

    def _observe(self, session: Session, result: RoundResult, draft: TokenTree, wanted: int) -> None:
        """What the round tells the γ controller and the lookup's measured acceptance."""
        if session.auto is not None:
            session.auto.observe(
                result.drafted,
                result.accepted,
                result.cost.draft_s,
                result.cost.verify_s,
                result.cost.model_s,
                result.drafting.prepared,
                result.drafting.prepared_used,
            )
            result.drafting.gamma = wanted
        if DRAFTERS[session.req.spec.drafter].learns:
            # e.g. model+lookup: what its lookup tokens, model tokens and places got
            path = result.path if not draft.is_chain else None
            self.draft.observe(session.id, path if path is not None else list(range(result.accepted)))

    async def _free(self, session_id: str, output: list[int] | None = None) -> None:
        await asyncio.gather(
            self.pool.delete_sessions(session_id), self.draft.free(session_id, output), return_exceptions=True
        )


def _timed(
    result: RoundResult, rnd: Round, started: float, drafted: float, timing: DraftSeconds, used: bool
) -> RoundResult:
    """The round's seconds, by part: drafting (from ``started``), verifying (from ``drafted``)."""
    verify_s = time.perf_counter() - drafted
    seconds = {**timing, **rnd.seconds, "gateway_math": max(verify_s - rnd.calls_s, 0.0)}
    result.cost = RoundCost(drafted - started, verify_s, rnd.model_s, rnd.busy_s, seconds)
    result.drafting.prepared_used = int(used)
    return result


def forced(session: Session, room: int) -> RoundResult | None:
    """The tokens the grammar forces after the sequence (docs/design.md §3.9), within ``room``; None when the
    next is not forced."""
    transformer, req = session.transformer, session.req
    if transformer is None or transformer.matcher is None:
        return None
    started = time.perf_counter()
    tokens = transformer.forced_run(session.sequence, room, session.eos_ids)
    if not tokens:
        return None
    result = RoundResult(tokens, drafted=0, accepted=0, traffic=Traffic())
    result.drafting.forced = len(tokens)
    if req.top_logprobs is not None:
        result.logprobs = [TokenLogprob(t, 0.0, [(t, 0.0)] if req.top_logprobs else []) for t in tokens]
    result.cost.seconds = {"gateway_math": time.perf_counter() - started}
    return result


async def propose(
    draft: DraftModel,
    session: Session,
    room: int,
    gamma: int,
    keyed: GenerationRequest,
    timing: DraftSeconds,
    prepared: TokenTree | None = None,
) -> TokenTree:
    """The round's draft (``keyed``: the request as this round draws): its tree, else a chain of ``gamma``
    (``prepared`` with overlap), or none."""
    if not MODES[keyed.spec.mode].drafts:
        return NO_DRAFT
    request = keyed.draft(session.id, session.sequence, session.transformer)
    if keyed.spec.mode is Mode.TREE:  # the request's tree, else the default by temperature
        shape = keyed.spec.tree or TreeShape.default(keyed.params.is_greedy)
        if room <= 1:
            return NO_DRAFT
        cut = shape.cut(room - 1)  # no deeper than the room left after the round's last token
        # the grammar's forced runs below the leaves, free
        extra = max(0, min(FORCED_EXTRA, MAX_DRAFT - cut.size))
        return await draft.propose_tree(request, cut, room - 1, extra, timing)
    gamma = min(gamma, room - 1)
    if prepared is not None:
        return prepared.head(gamma)
    if gamma <= 0:
        return NO_DRAFT
    # a grammar's forced tokens on top, free
    limit = min(room - 1, max(gamma, min(gamma + FORCED_EXTRA, MAX_DRAFT)))
    return await draft.propose(request, gamma, limit, timing=timing)
