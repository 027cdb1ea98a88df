"""The decoding engine: one loop for every mode (DESIGN §3).

A round: the draft proposes γ tokens (none in ``autoregressive``), the mode's strategy decides
what goes on the wire and which pure function of ``core.math`` verifies, and the round emits
``accepted + 1`` tokens (accepted draft tokens, then the recovered or bonus token). The gateway
owns the token sequence; a worker's KV cache is a cache it resends to when the worker lost it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import replace

import numpy as np
import torch

from app.adaptive import GammaController
from app.drafting import DraftModel
from app.engine.round import Round, all_workers, array, transform_wire
from app.engine.spec import GenerationRequest, RoundResult, TokenLogprob
from app.engine.strategies import STRATEGIES
from app.engine.strategies.pipeline import PipelineRun
from app.targets.base import Traffic, WorkerError
from app.targets.pipeline import PipelineTarget
from app.targets.pool import TargetSet
from core.math.aggregation import merge_top_logprobs, mixed_logprob
from core.math.random import round_seed
from core.math.tree import SegmentSchedule, TokenTree, TreeShape
from core.modes import MODES
from core.grammar import Grammars
from core.names import Drafter, Mode
from core.protocol import VerifyRequest
from core.transform import Transformer, TransformSpec

log = logging.getLogger(__name__)
FORCED_EXTRA = 8  # tokens a grammar forces that a chain may carry beyond γ (free: no draft step of their own)
MAX_DRAFT = 32  # the longest chain sent (γ ≤ 32; a worker decodes tokens + draft, ≤ 32 keeps llama.cpp's numerics)


class Engine:
    def __init__(self, draft: DraftModel, pool: TargetSet, eos_ids: list[int], max_context: int) -> None:
        self.draft = draft
        self.pool = pool
        self.eos_ids = set(eos_ids)
        self.max_context = max_context
        self.vocab_size = draft.vocab_size
        self.weights = torch.tensor(pool.weights, dtype=torch.float64)
        self.grammars: Grammars | None = None  # the gateway's grammar engine (set by the service on first use)

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[RoundResult, None]:
        """Rounds of one choice until EOS or a length limit; the caller may stop early."""
        session_id = f"{req.request_id}-{req.choice}"
        req = self._with_min_tokens(req)
        if req.spec.mode is Mode.PIPELINE:
            async for result in self._pipeline(session_id, req):
                yield result
                if result.finish_reason:
                    return
            return
        strategy = STRATEGIES[req.spec.mode]
        sequence = list(req.prompt)
        agreed = [0] * len(self.pool.workers)
        ahead: TokenTree | None = None  # the next round's draft, prepared during this round's flight
        path: list[int] | None = None  # the last tree round's accepted nodes: every worker holds them as tree rows
        transformer = self._transformer(req)
        verifier = self._transformer(req) if transformer is not None and transformer.masks_any else None  # its own matcher: the draft's runs ahead with overlap
        drafts = MODES[req.spec.mode].drafts
        auto = GammaController(req.spec.overlap, start=req.spec.num_draft_tokens) if req.spec.auto_gamma and not req.seeded and drafts else None
        rounds = 0  # verified so far
        try:
            if req.prompt_logprobs is not None:
                yield await self._score_prompt(session_id, req)
                agreed[:] = [len(sequence)] * len(agreed)
            while True:
                room = self._room(req, sequence)
                if room <= 0:
                    yield RoundResult([], drafted=0, accepted=0, traffic=Traffic(), finish_reason="length")
                    return
                forced = self._forced(transformer, sequence, room, req)
                if forced is not None:  # the grammar allows one token: decided here, no draft, no call
                    ahead = None
                    sequence.extend(forced.tokens)
                    forced.finish_reason = self._finish(forced, len(sequence) - len(req.prompt), req, len(sequence))
                    yield forced
                    if forced.finish_reason:
                        return
                    continue
                wanted = auto.choose() if auto is not None else req.spec.num_draft_tokens
                gamma = min(wanted, room - 1) if drafts else 0
                keyed = _keyed(req, auto is not None, rounds)  # auto: each round its own draws
                started = time.perf_counter()
                used = ahead is not None
                timing: dict[str, float] = {}
                if req.spec.mode is Mode.TREE:
                    draft = await self._draft_tree(session_id, sequence, room, keyed, timing, transformer)
                else:
                    draft = ahead.head(gamma) if ahead is not None else await self._draft(session_id, sequence, gamma, keyed, timing, transformer, room - 1)
                ahead = None
                scorable = self.pool.scorable(sequence, draft.ids())  # an engine may not score every token
                if scorable < len(draft):
                    draft = draft.head(scorable)
                drafted = time.perf_counter()
                rnd = Round(self.pool, self.weights, self.vocab_size, keyed, session_id, sequence, agreed, draft, Traffic(), path=path, transformer=verifier)
                ahead_req = _keyed(req, auto is not None, rounds + 1)  # the next round's draws
                preparing = self._prepare(session_id, sequence, draft, room, wanted, ahead_req, transformer) if req.spec.overlap and drafts else None  # drafter model only
                try:
                    result = await strategy.verify(rnd)
                except BaseException:
                    if preparing is not None:
                        preparing[1].set()  # it ends after the token in progress; nobody waits for it
                    raise
                rounds += 1
                result.draft_s, result.verify_s, result.model_s, result.busy_s = drafted - started, time.perf_counter() - drafted, rnd.model_s, rnd.busy_s
                result.seconds = {**timing, **rnd.seconds, "gateway_math": max(result.verify_s - rnd.calls_s, 0.0)}
                result.prepared_used = int(used)
                if preparing is not None:
                    result.prepared = 1
                    if result.accepted < len(draft):
                        preparing[1].set()  # its assumption failed: stop it now
                    ahead = await self._take_ahead(preparing[0], draft, result)
                if auto is not None:
                    auto.observe(result.drafted, result.accepted, result.draft_s, result.verify_s, result.model_s, result.prepared, result.prepared_used)
                    result.gamma = wanted
                # they hold sequence + draft: a chain's accepted tokens are theirs, a tree's path they
                # keep when the next call names it (v1.1 ``path``); without a path it is resent
                path = result.path if not draft.is_chain else None
                if req.spec.drafter is Drafter.MODEL_LOOKUP:  # what its lookup tokens, model tokens and places got
                    self.draft.observe(session_id, path if path is not None else list(range(result.accepted)))
                agreed[:] = [len(sequence) + (result.accepted if draft.is_chain else len(path or ()))] * len(agreed)
                sequence.extend(result.tokens)
                result.finish_reason = self._finish(result, len(sequence) - len(req.prompt), req, len(sequence))
                yield result
                if result.finish_reason:
                    return
        finally:
            await asyncio.shield(self._free(session_id, sequence[len(req.prompt):]))

    async def _pipeline(self, session_id: str, req: GenerationRequest) -> AsyncGenerator[RoundResult, None]:
        """Mode pipeline (DESIGN §3.7): its strategy's own loop over the one pipeline target."""
        target = self.pool.workers[0]
        if not isinstance(target, PipelineTarget) or len(self.pool.workers) != 1:
            raise WorkerError(getattr(target, "name", "w0"), "mode pipeline needs exactly one target, a pipeline of stage workers", 400)
        transformers = (self._transformer(req), self._transformer(req))
        run = PipelineRun(self.draft, target, req, session_id, req.spec.pipeline or SegmentSchedule(), self.vocab_size, self.max_context, self.eos_ids, transformers)
        try:
            async with aclosing(run.run()) as results:
                async for result in results:
                    generated = len(run.sequence) - len(req.prompt)
                    result.finish_reason = self._finish(result, generated, req, len(run.sequence))
                    if result.finish_reason and not result.rounds_ended:
                        result.rounds_ended = 1  # the last tree, cut short by EOS or the length
                        result.drafted, result.accepted = run.round_nodes, len(run.path)
                    yield result
                    if result.finish_reason:
                        return
        finally:
            await asyncio.shield(self._free(session_id))

    async def _score_prompt(self, session_id: str, req: GenerationRequest) -> RoundResult:
        """Echo with logprobs: every worker prefills the prompt and scores its own tokens (the
        rows predicting tokens 1..); the mixture's log-probabilities, the first token's None."""
        prompt, n = req.prompt, req.prompt_logprobs
        requests = [
            VerifyRequest.after(
                session_id, [], prompt, [], temperature=req.params.temperature, top_k=req.params.top_k, top_p=req.params.top_p, **transform_wire(req),
                seed=req.seed, choice=req.choice, worker=w, mode=Mode.AUTOREGRESSIVE.value, k=1, return_probs=False,
                score_tokens=True, logprobs=n,
            )
            for w in range(len(self.pool.workers))
        ]
        started = time.perf_counter()
        results = await all_workers(self.pool, requests, prompt)
        responses, traffic = [resp for resp, _ in results], Traffic()
        for _, t in results:
            traffic.add(t)
        values = np.stack([array(r.prompt_logprobs) for r in responses])  # [N, P − 1]
        tops = [(array(r.prompt_top_ids), array(r.prompt_top_logprobs)) for r in responses] if n else []
        logprobs = [TokenLogprob(prompt[0], None, None)] + [
            TokenLogprob(token, mixed_logprob(values[:, i].tolist(), self.weights), merge_top_logprobs(tops, i, n or 0, self.weights))
            for i, token in enumerate(prompt[1:])
        ]
        result = RoundResult([], drafted=0, accepted=0, traffic=traffic, prompt_logprobs=logprobs)
        result.verify_s, result.model_s = time.perf_counter() - started, max(r.model_ms for r in responses) / 1e3
        result.busy_s = sum(r.model_ms for r in responses) / 1e3
        return result

    def _room(self, req: GenerationRequest, sequence: list[int]) -> int:
        return min(req.max_tokens - (len(sequence) - len(req.prompt)), self.max_context - len(sequence))

    def _with_min_tokens(self, req: GenerationRequest) -> GenerationRequest:
        """min_tokens as the first step of the request's transform (vLLM's order, DESIGN §3.9):
        the gateway's EOS ids at −∞ in every row before it, on every worker and in the draft
        (none with ignore_eos, as in vLLM)."""
        if req.min_tokens <= 0 or req.ignore_eos or not self.eos_ids:
            return req
        base = req.transform if req.transform is not None else TransformSpec(prompt_len=len(req.prompt))
        return replace(req, transform=replace(base, min_tokens=req.min_tokens, eos_ids=tuple(sorted(self.eos_ids))))

    def _prepare(
        self, session_id: str, sequence: list[int], draft: TokenTree, room: int, gamma: int, req: GenerationRequest, transformer: Transformer | None = None,
    ) -> tuple[asyncio.Task[TokenTree], threading.Event] | None:
        """DSD's overlap: while the round is verified, draft on as if every draft token were
        accepted — one token for the bonus position, then the next round's γ. None when there is
        nothing to prepare (the draft ended in EOS, or no room is left after this round)."""
        tokens = draft.ids()
        after = room - (len(tokens) + 1)
        if not tokens or tokens[-1] in self.eos_ids or after <= 1:
            return None
        cancel = threading.Event()
        assumed = [*sequence, *tokens]
        task = asyncio.create_task(self.draft.propose(req.draft(session_id, assumed, transformer, Drafter.MODEL), 1 + min(gamma, after - 1), cancel=cancel))
        task.add_done_callback(_retrieve)  # a round that fails leaves it unawaited
        return task, cancel

    async def _take_ahead(self, task: asyncio.Task[TokenTree], draft: TokenTree, result: RoundResult) -> TokenTree | None:
        """The prepared draft, if its assumption held: every draft token accepted and its first
        token equal to the bonus token drawn by the round. It is then exactly what drafting after
        the round would give (the draft's draws are keyed by position), so the output is the
        same with overlap on or off."""
        try:
            prepared = await task
        except Exception:  # logged by _retrieve; the next round drafts afresh
            return None
        first = prepared.ids()[:1]
        if result.accepted != len(draft) or first != result.tokens[-1:]:
            return None
        if first[0] in self.eos_ids or len(prepared) < 2:
            return None
        return prepared.tail(1)

    async def _draft(
        self, session_id: str, sequence: list[int], gamma: int, req: GenerationRequest, timing: dict[str, float], transformer: Transformer | None = None,
        room: int | None = None,
    ) -> TokenTree:
        """A chain of ``gamma`` tokens; with a grammar, the tokens it forces come on top, free
        (up to FORCED_EXTRA more and ``room``), and so do a lookup's (``drafter``)."""
        if gamma <= 0:
            return TokenTree.chain([], [])
        limit = min(room if room is not None else gamma, max(gamma, min(gamma + FORCED_EXTRA, MAX_DRAFT)))
        return await self.draft.propose(req.draft(session_id, sequence, transformer), gamma, limit, timing=timing)

    async def _draft_tree(
        self, session_id: str, sequence: list[int], room: int, req: GenerationRequest, timing: dict[str, float], transformer: Transformer | None = None,
    ) -> TokenTree:
        """Mode tree's draft: the request's shape (else the default by temperature), no deeper
        than the room left after the round's last token."""
        if room <= 1:
            return TokenTree.chain([], [])
        shape = req.spec.tree or TreeShape.default(req.params.is_greedy)
        cut = shape.cut(room - 1)
        extra = max(0, min(FORCED_EXTRA, MAX_DRAFT - cut.size))  # the grammar's forced runs below the leaves, free
        return await self.draft.propose_tree(req.draft(session_id, sequence, transformer), cut, room - 1, extra, timing)

    def _transformer(self, req: GenerationRequest) -> Transformer | None:
        """The gateway's side of the request's transform: the draft's, and the forced tokens'."""
        if req.transform is None:
            return None
        return Transformer.build(req.transform, self.vocab_size, self.grammars)

    def _forced(self, transformer: Transformer | None, sequence: list[int], room: int, req: GenerationRequest) -> RoundResult | None:
        """The tokens the grammar forces after ``sequence`` (DESIGN §3.9), within ``room``,
        emitted without a round; None when the next token is not forced."""
        if transformer is None or transformer.matcher is None:
            return None
        started = time.perf_counter()
        tokens = transformer.forced_run(sequence, room, self.eos_ids)
        if not tokens:
            return None
        result = RoundResult(tokens, drafted=0, accepted=0, traffic=Traffic(), forced=len(tokens))
        if req.top_logprobs is not None:
            result.logprobs = [TokenLogprob(t, 0.0, [(t, 0.0)] if req.top_logprobs else []) for t in tokens]
        result.seconds = {"gateway_math": time.perf_counter() - started}
        return result

    def _finish(self, result: RoundResult, generated: int, req: GenerationRequest, length: int) -> str | None:
        for i, token in enumerate(result.tokens):
            if token in self.eos_ids and not req.ignore_eos:
                del result.tokens[i + 1 :]
                if result.logprobs is not None:
                    del result.logprobs[i + 1 :]
                return "stop"
        if generated >= req.max_tokens or length >= self.max_context:
            return "length"
        return None

    async def _free(self, session_id: str, output: list[int] | None = None) -> None:
        await asyncio.gather(self.pool.delete_sessions(session_id), self.draft.free(session_id, output), return_exceptions=True)


def _keyed(req: GenerationRequest, own_draws: bool, round_index: int) -> GenerationRequest:
    """The request as one round draws with it: its own seed, when earlier rounds chose its shape
    (``core.math.random.round_seed``)."""
    return replace(req, seed=round_seed(req.seed, round_index)) if own_draws else req


def _retrieve(task: asyncio.Task[TokenTree]) -> None:
    """Mark a background draft's failure as seen (it is logged, not raised: nobody uses it)."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("a draft prepared ahead failed: %s", task.exception())
