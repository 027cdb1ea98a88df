"""The decoding engine: one loop for every mode (DESIGN §3).

A round: the draft proposes γ tokens (none in ``autoregressive``), the mode decides what goes on
the wire and which pure function of ``core.math`` verifies, and the round emits
``accepted + 1`` tokens (accepted draft tokens, then the recovered or bonus token). The gateway
owns the token sequence; a worker's KV cache is a cache it resends to when the worker lost it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import numpy as np
import torch

from app.adaptive import GammaController
from app.draft import Draft, DraftModel
from app.targets.base import Traffic, WorkerError
from app.targets.pool import TargetSet
from core.math.aggregation import aggregate, bias_bound, kept_weights, merge_top_logprobs, mixed_logprob, mixed_probability, normalise_weights, reconstruct
from core.math.greedy import certify_argmax
from core.math.random import Purpose, sample_index, uniform, uniforms
from core.math.relaxed import Relaxation, relaxation_factor_on_support, relaxation_factors, relaxed_distance, verify_relaxed
from core.math.sampling import SamplingParams, Suppression
from core.math.exact import ExactPosition, verify_exact
from core.math.speculative import Verdict, argmax_lowest, residual, verify_greedy, verify_sampled
from core.modes import MODES
from core.names import Mode, Reconstruction
from core.protocol import VerifyRequest, VerifyResponse

log = logging.getLogger(__name__)

_CERTIFY_K = 8  # first top-k asked for a greedy autoregressive step over several workers


@dataclass(frozen=True)
class SpecOptions:
    """The speculative settings of one request (config defaults, overridden per request)."""

    mode: Mode
    num_draft_tokens: int
    k: int | None  # None = full distributions
    reconstruction: Reconstruction
    draft_top_k: int = 0  # TSLT draft truncation: keep the k most likely draft tokens (0 = off)
    draft_top_p: float = 1.0  # ... or the smallest nucleus of mass ≥ draft_top_p (1 = off)
    engine_targets: bool = False  # some targets are openai-logprobs engines: their top-k makes it lossy (DESIGN §8)
    overlap: bool = False  # DSD: draft the next round while this one is verified (output unchanged)
    auto_gamma: bool = False  # num_draft_tokens: auto (app.adaptive); num_draft_tokens is then the seeded γ
    relaxation: Relaxation | None = None  # DSD's relaxed accept test (lossy; aggregate and exact at T > 0; DESIGN §3.8)

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError("num_draft_tokens must be ≥ 1")
        if self.k is not None and self.k < 1:
            raise ValueError("k must be ≥ 1 or None (full)")
        if self.draft_top_k < 0 or not 0 < self.draft_top_p <= 1:
            raise ValueError("draft_top_k must be ≥ 0 and draft_top_p in (0, 1]")
        if self.mode is Mode.EXACT and self.draft_top_k == 0 and self.draft_top_p == 1:
            raise ValueError("exact needs draft truncation (draft_top_k or draft_top_p)")

    @property
    def is_lossless(self) -> bool:
        relaxed = self.relaxation is not None and self.relaxation.tau_max > 0
        return not self.engine_targets and not relaxed and (self.mode in (Mode.AUTOREGRESSIVE, Mode.EXACT) or self.k is None)

    @property
    def truncation(self) -> tuple[int, float]:
        return self.draft_top_k, self.draft_top_p


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    seed: int
    choice: int
    spec: SpecOptions
    top_logprobs: int | None = None  # None: no logprobs; n ≥ 0: the token's and n alternatives
    seeded: bool = False  # the client gave the seed: the output must not depend on timing
    prompt_logprobs: int | None = None  # echo with logprobs: the prompt's tokens too (n alternatives)
    ignore_eos: bool = False  # vLLM's: EOS is sampled as the target says but does not end the answer
    min_tokens: int = 0  # vLLM's: EOS cannot be emitted before this many tokens (the target without it, renormalised)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None  # None: the prompt's first token (nothing predicts it)
    top: list[tuple[int, float]] | None


@dataclass
class RoundResult:
    """What one round emitted, and what it cost."""

    tokens: list[int]
    drafted: int
    accepted: int
    traffic: Traffic
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"; None while generating
    bound: list[float] = field(default_factory=list)  # Σ w_n σ_n per consumed position (lossy only)
    error: list[float] = field(default_factory=list)  # Σ w_n e_n per consumed position (lossy only)
    draft_s: float = 0.0  # seconds the draft took this round (waiting for it, with overlap)
    prepared: int = 0  # 1 when the next round's draft was prepared during this round's flight
    prepared_used: int = 0  # 1 when this round's draft is one prepared during the previous round
    gamma: int | None = None  # the γ num_draft_tokens: auto chose for this round
    relaxed_tv: list[float] = field(default_factory=list)  # τ_j (1 − β_j) per emitted position (relaxation only)
    taus: list[float] = field(default_factory=list)  # τ_j per emitted draft position (relaxation only)
    verify_s: float = 0.0  # seconds from sending to the workers to the verdict (network included)
    model_s: float = 0.0  # seconds the slowest worker spent in its model, per call, summed
    prompt_logprobs: list[TokenLogprob] | None = None  # echo with logprobs: the prompt's, before any round


@dataclass
class _Round:
    """What a mode sees of the round in progress."""

    engine: Engine
    req: GenerationRequest
    session_id: str
    sequence: list[int]  # agreed tokens so far (prompt + generated)
    agreed: list[int]  # per worker: tokens of ``sequence`` it holds
    draft: Draft
    traffic: Traffic
    suppression: Suppression | None = None  # min_tokens: EOS is removed from the target before it
    model_s: float = 0.0
    responses: list[VerifyResponse] = field(default_factory=list)  # of the last call

    @property
    def positions(self) -> list[int]:
        """Absolute index of the token decided at each of the γ+1 positions."""
        start = len(self.sequence)
        return list(range(start, start + len(self.draft.tokens) + 1))

    async def call(self, **wire: object) -> list[VerifyResponse]:
        """Every worker at once; after it, each holds ``sequence`` + draft."""
        pool, req = self.engine.pool, self.req
        requests = [
            VerifyRequest.after(
                self.session_id, self.sequence[: self.agreed[n]], self.sequence[self.agreed[n]:], self.draft.tokens,
                temperature=req.params.temperature, top_k=req.params.top_k, top_p=req.params.top_p,
                seed=req.seed, choice=req.choice, worker=n, **self._suppressing(self.positions[0], len(self.positions)), **wire,  # type: ignore[arg-type]
            )
            for n in range(len(pool.workers))
        ]
        results = await _all_workers(pool, requests, self.sequence)
        self.responses = [resp for resp, _ in results]
        self.model_s += max(resp.model_ms for resp, _ in results) / 1e3
        for n, (_, traffic) in enumerate(results):
            self.agreed[n] = len(self.sequence)
            self.traffic.add(traffic)
        return [resp for resp, _ in results]

    @property
    def weights(self) -> torch.Tensor:
        """The mixture's weights at the last call's positions: as configured ``[N]``; ``[γ+1, N]``
        where min_tokens removed EOS (w_n κ_n, renormalised: the mixture of p_n(· | not EOS))."""
        return _weights(self.responses, self.engine.weights)

    def _suppressing(self, first: int, rows: int) -> dict[str, object]:
        """The wire fields of min_tokens, when any of ``rows`` positions from ``first`` is suppressed."""
        if self.suppression is None or not self.suppression.rows(first, rows):
            return {}
        return {"suppress_ids": np.array(self.suppression.ids, dtype=np.int64), "suppress_until": self.suppression.until}

    async def score(self, position: int, token: int) -> float:
        """log p(token) at ``position`` (absolute, within sequence + draft) under the mixture:
        one short call per worker that re-reads the token before it and scores only ``token``.
        Each worker then holds sequence + draft up to ``position``, the round's agreed tokens."""
        pool, req = self.engine.pool, self.req
        held = [*self.sequence, *self.draft.tokens][:position]
        requests = [
            VerifyRequest.after(
                self.session_id, held[:-1], held[-1:], [], temperature=req.params.temperature, top_k=req.params.top_k,
                top_p=req.params.top_p, seed=req.seed, choice=req.choice, worker=n, mode=Mode.AUTOREGRESSIVE.value,
                score_ids=np.array([token], dtype=np.int64), **self._suppressing(position, 1),  # type: ignore[arg-type]
            )
            for n in range(len(pool.workers))
        ]
        results = await _all_workers(pool, requests, held)
        self.model_s += max(resp.model_ms for resp, _ in results) / 1e3
        for _, traffic in results:
            self.traffic.add(traffic)
        weights = _at(_weights([resp for resp, _ in results], self.engine.weights), 0)
        return mixed_logprob([float(_array(resp.score_logprobs)[0]) for resp, _ in results], weights)


class Engine:
    def __init__(self, draft: DraftModel, pool: TargetSet, eos_ids: list[int], max_context: int) -> None:
        self.draft = draft
        self.pool = pool
        self.eos_ids = set(eos_ids)
        self.max_context = max_context
        self.vocab_size = draft.vocab_size
        self.weights = torch.tensor(pool.weights, dtype=torch.float64)

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[RoundResult, None]:
        """Rounds of one choice until EOS or a length limit; the caller may stop early."""
        session_id = f"{req.request_id}-{req.choice}"
        mode = _MODES[req.spec.mode]
        sequence = list(req.prompt)
        agreed = [0] * len(self.pool.workers)
        ahead: Draft | None = None  # the next round's draft, prepared during this round's flight
        suppression = self._suppression(req)
        drafts = MODES[req.spec.mode].drafts
        auto = GammaController(req.spec.overlap) if req.spec.auto_gamma and not req.seeded and drafts else None
        try:
            if req.prompt_logprobs is not None:
                yield await self._score_prompt(session_id, req)
                agreed[:] = [len(sequence)] * len(agreed)
            while True:
                room = self._room(req, sequence)
                if room <= 0:
                    yield RoundResult([], drafted=0, accepted=0, traffic=Traffic(), finish_reason="length")
                    return
                wanted = auto.choose() if auto is not None else req.spec.num_draft_tokens
                gamma = min(wanted, room - 1) if drafts else 0
                started = time.perf_counter()
                used = ahead is not None
                draft = Draft(ahead.tokens[:gamma], ahead.probs[:gamma]) if ahead is not None else await self._draft(session_id, sequence, gamma, req, suppression)
                ahead = None
                scorable = self.pool.scorable(sequence, draft.tokens)  # an engine may not score every token
                if scorable < len(draft.tokens):
                    draft = Draft(draft.tokens[:scorable], draft.probs[:scorable])
                drafted = time.perf_counter()
                rnd = _Round(self, req, session_id, sequence, agreed, draft, Traffic(), suppression)
                preparing = self._prepare(session_id, sequence, draft, room, wanted, req, suppression) if req.spec.overlap and drafts else None
                try:
                    result = await mode.run(rnd)
                except BaseException:
                    if preparing is not None:
                        preparing[1].set()  # it ends after the token in progress; nobody waits for it
                    raise
                result.draft_s, result.verify_s, result.model_s = drafted - started, time.perf_counter() - drafted, rnd.model_s
                result.prepared_used = int(used)
                if preparing is not None:
                    result.prepared = 1
                    if result.accepted < len(draft.tokens):
                        preparing[1].set()  # its assumption failed: stop it now
                    ahead = await self._take_ahead(preparing[0], draft, result)
                if auto is not None:
                    auto.observe(result.drafted, result.accepted, result.draft_s, result.verify_s, result.model_s, result.prepared, result.prepared_used)
                    result.gamma = wanted
                agreed[:] = [len(sequence) + result.accepted] * len(agreed)  # they hold sequence + draft
                sequence.extend(result.tokens)
                result.finish_reason = self._finish(result, len(sequence) - len(req.prompt), req, len(sequence))
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
                session_id, [], prompt, [], temperature=req.params.temperature, top_k=req.params.top_k, top_p=req.params.top_p,
                seed=req.seed, choice=req.choice, worker=w, mode=Mode.AUTOREGRESSIVE.value, k=1, return_probs=False,
                score_tokens=True, logprobs=n,
            )
            for w in range(len(self.pool.workers))
        ]
        started = time.perf_counter()
        results = await _all_workers(self.pool, requests, prompt)
        responses, traffic = [resp for resp, _ in results], Traffic()
        for _, t in results:
            traffic.add(t)
        values = np.stack([_array(r.prompt_logprobs) for r in responses])  # [N, P − 1]
        tops = [(_array(r.prompt_top_ids), _array(r.prompt_top_logprobs)) for r in responses] if n else []
        logprobs = [TokenLogprob(prompt[0], None, None)] + [
            TokenLogprob(token, mixed_logprob(values[:, i].tolist(), self.weights), merge_top_logprobs(tops, i, n or 0, self.weights))
            for i, token in enumerate(prompt[1:])
        ]
        result = RoundResult([], drafted=0, accepted=0, traffic=traffic, prompt_logprobs=logprobs)
        result.verify_s, result.model_s = time.perf_counter() - started, max(r.model_ms for r in responses) / 1e3
        return result

    def _room(self, req: GenerationRequest, sequence: list[int]) -> int:
        return min(req.max_tokens - (len(sequence) - len(req.prompt)), self.max_context - len(sequence))

    def _suppression(self, req: GenerationRequest) -> Suppression | None:
        """min_tokens as the positions where no EOS is decided (none with ignore_eos, as in vLLM)."""
        if req.min_tokens <= 0 or req.ignore_eos or not self.eos_ids:
            return None
        return Suppression(tuple(sorted(self.eos_ids)), len(req.prompt) + req.min_tokens)

    def _prepare(
        self, session_id: str, sequence: list[int], draft: Draft, room: int, gamma: int, req: GenerationRequest, suppression: Suppression | None,
    ) -> tuple[asyncio.Task[Draft], threading.Event] | None:
        """DSD's overlap: while the round is verified, draft on as if every draft token were
        accepted — one token for the bonus position, then the next round's γ. None when there is
        nothing to prepare (the draft ended in EOS, or no room is left after this round)."""
        after = room - (len(draft.tokens) + 1)
        if not draft.tokens or draft.tokens[-1] in self.eos_ids or after <= 1:
            return None
        cancel = threading.Event()
        assumed = [*sequence, *draft.tokens]
        task = asyncio.create_task(self.draft.propose(
            session_id, assumed, 1 + min(gamma, after - 1), req.params, req.seed, req.choice, req.spec.truncation, cancel, suppression,
        ))
        task.add_done_callback(_retrieve)  # a round that fails leaves it unawaited
        return task, cancel

    async def _take_ahead(self, task: asyncio.Task[Draft], draft: Draft, result: RoundResult) -> Draft | None:
        """The prepared draft, if its assumption held: every draft token accepted and its first
        token equal to the bonus token drawn by the round. It is then exactly what drafting after
        the round would give (the draft's draws are keyed by position), so the output is the
        same with overlap on or off."""
        try:
            prepared = await task
        except Exception:  # logged by _retrieve; the next round drafts afresh
            return None
        if result.accepted != len(draft.tokens) or not prepared.tokens or prepared.tokens[0] != result.tokens[-1]:
            return None
        if prepared.tokens[0] in self.eos_ids or len(prepared.tokens) < 2:
            return None
        return Draft(prepared.tokens[1:], prepared.probs[1:])

    async def _draft(self, session_id: str, sequence: list[int], gamma: int, req: GenerationRequest, suppression: Suppression | None) -> Draft:
        if gamma <= 0:
            return Draft([], torch.empty(0, self.vocab_size))
        return await self.draft.propose(session_id, sequence, gamma, req.params, req.seed, req.choice, req.spec.truncation, suppression=suppression)

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

    async def _free(self, session_id: str) -> None:
        await asyncio.gather(self.pool.delete_sessions(session_id), self.draft.free(session_id), return_exceptions=True)


# ----------------------------------------------------------------------------- modes


class _Mode:
    async def run(self, rnd: _Round) -> RoundResult:
        raise NotImplementedError


class AutoregressiveMode(_Mode):
    """The baseline: one target position per round. At T > 0 each worker sends its own sample
    z_n ~ T(p_n) and the gateway emits z_n with n ~ w (lossless, 4 bytes); at T = 0 workers
    send top-k and the gateway certifies the mixture's argmax, asking again with a larger k."""

    async def run(self, rnd: _Round) -> RoundResult:
        req = rnd.req
        want_logprobs = req.top_logprobs is not None
        if req.params.is_greedy:
            token, target = await self._greedy(rnd, want_logprobs)
        else:
            responses = await rnd.call(mode=Mode.AUTOREGRESSIVE.value, return_probs=want_logprobs)
            u = uniform(req.seed, req.choice, rnd.positions[0], Purpose.WORKER_CHOICE)
            chosen = sample_index(normalise_weights(_at(rnd.weights, 0)), u)
            token = int(_array(responses[chosen].samples)[0])
            target = _mixture(responses, rnd.engine, weights=rnd.weights) if want_logprobs else None
        logprobs = token_logprobs(target, [token], req.top_logprobs) if target is not None else None
        result = RoundResult([token], drafted=0, accepted=0, traffic=rnd.traffic, logprobs=logprobs)
        if not req.spec.is_lossless:  # engine targets: z_n came from a top-k of p_n
            sigma = torch.tensor([[float(_array(r.tail_mass)[0]) if r.tail_mass is not None else 0.0] for r in rnd.responses])
            result.bound = result.error = bias_bound(sigma, rnd.weights).tolist()
        return result

    async def _greedy(self, rnd: _Round, want_logprobs: bool) -> tuple[int, torch.Tensor | None]:
        vocab, single = rnd.engine.vocab_size, len(rnd.engine.pool.workers) == 1
        k: int | None = None if want_logprobs else 1 if single else min(_CERTIFY_K, vocab)
        while True:
            responses = await rnd.call(mode=Mode.AUTOREGRESSIVE.value, k=k)
            if k is None:
                target = _mixture(responses, rnd.engine, weights=rnd.weights)
                return argmax_lowest(target[:1])[0], target
            if single:  # its top-1, ties to the lowest id, is the argmax
                return int(_array(responses[0].ids)[0, 0]), None
            ids = [_row_ids(r, 0, vocab) for r in responses]
            probs = [torch.tensor(_array(r.probs)[0]) for r in responses]
            token = certify_argmax(ids, probs, _at(rnd.weights, 0), vocab)
            if token is not None:
                return token, None
            k = None if k * 8 >= vocab else k * 8


class AggregateMode(_Mode):
    """SpecFed (DESIGN §3.3): every worker sends T(p_n) at the γ+1 positions, full or top-k;
    the gateway reconstructs p̂_n, aggregates p̂ = Σ w_n p̂_n and verifies the draft with it."""

    async def run(self, rnd: _Round) -> RoundResult:
        req, spec, engine = rnd.req, rnd.req.spec, rnd.engine
        responses = await rnd.call(mode=Mode.AGGREGATE.value, k=spec.k, reconstruction=spec.reconstruction.value)
        target = _mixture(responses, engine, spec.reconstruction, rnd.weights)
        draft = rnd.draft
        relaxed = spec.relaxation is not None and spec.relaxation.tau_max > 0 and not req.params.is_greedy and draft.tokens
        if req.params.is_greedy:
            verdict = verify_greedy(target, draft.tokens)
        elif relaxed:
            assert spec.relaxation is not None
            taus = relaxation_factors(target, draft.probs, spec.relaxation)
            verdict = verify_relaxed(target, draft.probs, draft.tokens, *_round_uniforms(rnd), taus)
        else:
            verdict = verify_sampled(target, draft.probs, draft.tokens, *_round_uniforms(rnd))
        tokens = verdict.output(draft.tokens)
        used = len(tokens)
        logprobs = token_logprobs(target[:used], tokens, req.top_logprobs) if req.top_logprobs is not None else None
        result = RoundResult(tokens, drafted=len(draft.tokens), accepted=verdict.num_accepted, traffic=rnd.traffic, logprobs=logprobs)
        if relaxed:  # the emitted draft positions follow τ q + (1 − τ) p; the bonus position p itself
            at = min(used, len(draft.tokens))
            result.taus = taus[:at].tolist()
            result.relaxed_tv = relaxed_distance(target[:at], draft.probs[:at], taus[:at]).tolist() + [0.0] * (used - at)
        if not spec.is_lossless:
            sigma = torch.stack([torch.tensor(_array(r.tail_mass)) for r in responses])[:, :used]
            error = torch.stack([torch.tensor(_array(r.recon_error)) for r in responses])[:, :used]
            result.bound = bias_bound(sigma, _first(rnd.weights, used)).tolist()
            result.error = bias_bound(error, _first(rnd.weights, used)).tolist()
        return result


class SplitMode(_Mode):
    """DSSD (DESIGN §3.4), one worker: it runs the accept test with q̂_j(x_j) and its own
    stream; the gateway draws the recovered token from norm(max(0, p − q̂)) with its own q̂."""

    async def run(self, rnd: _Round) -> RoundResult:
        req, spec, engine, draft = rnd.req, rnd.req.spec, rnd.engine, rnd.draft
        gamma = len(draft.tokens)
        q_draft = np.array([float(draft.probs[j, x]) for j, x in enumerate(draft.tokens)], dtype=np.float32)
        resp = (await rnd.call(mode=Mode.SPLIT.value, k=spec.k, draft_probs=q_draft, logprobs=req.top_logprobs))[0]
        accepted, result_bound = resp.num_accepted, []
        if accepted == gamma or req.params.is_greedy:
            token = resp.bonus
            final = float(_array(resp.sample_logprobs)[0]) if req.top_logprobs is not None else 0.0
        else:
            p_row = _mixture([resp], engine, weights=engine.weights)[0]  # one worker, one row
            u = uniform(req.seed, req.choice, rnd.positions[accepted], Purpose.RESIDUAL)
            token = sample_index(residual(p_row, draft.probs[accepted]), u)
            final = float(torch.log(p_row[token].clamp(min=1e-45)))  # from the row sent: p, or p̂ of its top-k
            result_bound = [float(_array(resp.tail_mass)[0])] if spec.k is not None else []
        tokens = [*draft.tokens[:accepted], token]
        result = RoundResult(tokens, drafted=gamma, accepted=accepted, traffic=rnd.traffic)
        if req.top_logprobs is not None:
            values = [*_array(resp.draft_logprobs)[:accepted].tolist(), final]
            result.logprobs = _worker_logprobs(rnd, tokens, values)
        if not spec.is_lossless:
            result.bound = result_bound + [0.0] * (len(tokens) - len(result_bound))
            result.error = list(result.bound)  # renormalize: e = σ at the one position sent
        return result


class ExactMode(_Mode):
    """Lossless federated verification with sparse payloads (DESIGN §3.5): each worker sends
    p_n on the draft supports, the mass off them, one sample from off them, one bonus sample."""

    async def run(self, rnd: _Round) -> RoundResult:
        if rnd.req.params.is_greedy:
            return await _certified_greedy(rnd)
        req, draft = rnd.req, rnd.draft
        supports = [row.nonzero()[:, 0] for row in draft.probs]
        ids = torch.cat(supports).numpy() if supports else np.zeros(0, np.int64)
        sizes = np.array([len(s) for s in supports], dtype=np.int32)
        responses = await rnd.call(mode=Mode.EXACT.value, support_ids=ids, support_sizes=sizes, logprobs=req.top_logprobs)
        positions = _exact_positions(responses, supports, draft)
        draft_index = [int((s == x).nonzero()[0, 0]) for s, x in zip(supports, draft.tokens)]
        accept_u, final_u = _round_uniforms(rnd)
        choice_u = uniform(req.seed, req.choice, rnd.positions[-1], Purpose.WORKER_CHOICE)
        relaxation = req.spec.relaxation if req.spec.relaxation is not None and req.spec.relaxation.tau_max > 0 and positions else None
        taus, weights = None, rnd.weights
        w = [normalise_weights(_at(weights, j)) for j in range(len(positions))]
        if relaxation is not None:
            taus = torch.tensor([
                relaxation_factor_on_support(w[j] @ pos.p.double(), pos.q, float(w[j] @ pos.complement.double()), relaxation) for j, pos in enumerate(positions)
            ], dtype=torch.float64)
        verdict = verify_exact(positions, draft_index, [r.bonus for r in responses], weights, accept_u, final_u[:-1], choice_u, taus)
        tokens = verdict.output(draft.tokens)
        result = RoundResult(tokens, drafted=len(draft.tokens), accepted=verdict.num_accepted, traffic=rnd.traffic)
        if req.top_logprobs is not None:
            values = [mixed_probability(pos.p[:, i], _at(weights, j)) for j, (pos, i) in enumerate(zip(positions, draft_index[: verdict.num_accepted]))]
            result.logprobs = _worker_logprobs(rnd, tokens, [*values, await _exact_final_logprob(rnd, positions, verdict)])
        if taus is not None:  # the emitted draft positions follow τ q̂ + (1 − τ) p; the bonus position p itself
            at = min(len(tokens), len(positions))
            result.taus = taus[:at].tolist()
            result.relaxed_tv = [float(relaxed_distance(w[j] @ pos.p.double(), pos.q, taus[j])) for j, pos in enumerate(positions[:at])] + [0.0] * (len(tokens) - at)
        return result


async def _exact_final_logprob(rnd: _Round, positions: list[ExactPosition], verdict: Verdict) -> float:
    """log p of the round's last token: from the supports when it lies on S_a; else it is a
    worker's own sample (complement or bonus), whose log p_n that worker sent — with several
    workers the mixture needs every p_n of it, which one short call asks for."""
    a, token = verdict.num_accepted, verdict.token
    if a < len(positions):
        on_support = (positions[a].support == token).nonzero()
        if len(on_support):
            return mixed_probability(positions[a].p[:, int(on_support[0, 0])], _at(rnd.weights, a))
    if len(rnd.responses) == 1:
        return float(_array(rnd.responses[0].sample_logprobs)[a])
    return await rnd.score(len(rnd.sequence) + a, token)


def _worker_logprobs(rnd: _Round, tokens: list[int], values: list[float]) -> list[TokenLogprob]:
    """The emitted tokens with the mixture's log-probabilities ``values`` and, when asked, the
    top alternatives from the workers' top-n lists."""
    n, weights = rnd.req.top_logprobs, rnd.weights
    tops = [(_array(r.top_ids), _array(r.top_logprobs)) for r in rnd.responses] if n else []
    return [TokenLogprob(t, v, merge_top_logprobs(tops, j, n or 0, _at(weights, j))) for j, (t, v) in enumerate(zip(tokens, values))]


def _exact_positions(responses: list[VerifyResponse], supports: list[torch.Tensor], draft: Draft) -> list[ExactPosition]:
    bounds = np.cumsum([0] + [len(s) for s in supports])
    positions = []
    for j, support in enumerate(supports):
        p = torch.stack([torch.tensor(_array(r.support_probs)[bounds[j] : bounds[j + 1]], dtype=torch.float64) for r in responses])
        complement = torch.tensor([float(_array(r.complement)[j]) for r in responses], dtype=torch.float64)
        samples = [int(_array(r.complement_samples)[j]) for r in responses]
        positions.append(ExactPosition(support, draft.probs[j][support].double(), p, complement, samples))
    return positions


async def _certified_greedy(rnd: _Round) -> RoundResult:
    """T = 0 over top-k payloads: accept while x_j is the certified argmax of the mixture;
    a position that cannot be certified is asked again with a larger k. With logprobs asked the
    workers send whole distributions (the payload grows only then)."""
    engine, draft = rnd.engine, rnd.draft
    if rnd.req.top_logprobs is not None:
        target = _mixture(await rnd.call(mode=Mode.EXACT.value, k=None), engine, weights=rnd.weights)
        verdict = verify_greedy(target, draft.tokens)
        tokens = verdict.output(draft.tokens)
        logprobs = token_logprobs(target[: len(tokens)], tokens, rnd.req.top_logprobs)
        return RoundResult(tokens, drafted=len(draft.tokens), accepted=verdict.num_accepted, traffic=rnd.traffic, logprobs=logprobs)
    k: int | None = min(_CERTIFY_K, engine.vocab_size)
    while True:
        responses = await rnd.call(mode=Mode.EXACT.value, k=k)
        targets: list[int | None] = []
        for j in range(len(draft.tokens) + 1):
            ids = [_row_ids(r, j, engine.vocab_size) for r in responses]
            probs = [torch.tensor(_array(r.probs)[j]) for r in responses]
            targets.append(certify_argmax(ids, probs, _at(rnd.weights, j), engine.vocab_size))
            if targets[-1] is None or j == len(draft.tokens) or targets[-1] != draft.tokens[j]:
                break
        if targets[-1] is not None:
            accepted = len(targets) - 1
            tokens = [*draft.tokens[:accepted], int(targets[-1])]
            return RoundResult(tokens, drafted=len(draft.tokens), accepted=accepted, traffic=rnd.traffic)
        k = None if k is None or k * 8 >= engine.vocab_size else k * 8


def _round_uniforms(rnd: _Round) -> tuple[torch.Tensor, torch.Tensor]:
    """r_j for the accept tests; the residual draw at each draft position, the bonus draw last."""
    req, positions = rnd.req, rnd.positions
    accept = uniforms(req.seed, req.choice, positions[:-1], Purpose.ACCEPT)
    final = torch.cat([
        uniforms(req.seed, req.choice, positions[:-1], Purpose.RESIDUAL),
        uniforms(req.seed, req.choice, positions[-1:], Purpose.BONUS),
    ])
    return accept, final


def _mixture(
    responses: list[VerifyResponse], engine: Engine, method: Reconstruction = Reconstruction.RENORMALIZE, weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """p̂ = Σ w_n p̂_n over the positions of the responses: ``[γ+1, V]`` float64 (``weights``:
    ``[N]`` or per position, ``_Round.weights``; default the configured ones)."""
    dists = []
    for resp in responses:
        probs = torch.tensor(_array(resp.probs), dtype=torch.float64)
        if resp.ids is None:
            dists.append(probs)  # as sent: greedy compares the same numbers in every mode
        else:
            ids = torch.from_numpy(np.array(resp.ids, dtype=np.int64))
            dists.append(reconstruct(ids, probs, engine.vocab_size, method, torch.tensor(_array(resp.tail_mass))))
    return aggregate(torch.stack(dists), engine.weights if weights is None else weights)


def token_logprobs(
    target: torch.Tensor,  # [m, V]: the distribution each token was decided by
    tokens: list[int],  # [m]
    top_n: int | None,
) -> list[TokenLogprob]:
    out = []
    for row, token in zip(target, tokens):
        logs = torch.log(row.double().clamp(min=1e-45))
        top = torch.topk(row, top_n).indices.tolist() if top_n else []
        out.append(TokenLogprob(token, float(logs[token]), [(int(t), float(logs[t])) for t in top]))
    return out


async def _all_workers(pool: TargetSet, requests: list[VerifyRequest], agreed: list[int]) -> list[tuple[VerifyResponse, Traffic]]:
    """One call per worker, at once; one failure cancels the others."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(w.verify(r, agreed)) for w, r in zip(pool.workers, requests)]
    except BaseExceptionGroup as failures:
        raise _first_worker_error(failures) from None
    return [t.result() for t in tasks]


def _retrieve(task: asyncio.Task[Draft]) -> None:
    """Mark a background draft's failure as seen (it is logged, not raised: nobody uses it)."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("a draft prepared ahead failed: %s", task.exception())


def _first_worker_error(failures: BaseExceptionGroup) -> BaseException:
    """The first WorkerError of a group (what the client is told), else the first failure."""
    errors = failures.subgroup(WorkerError)
    return (errors or failures).exceptions[0]


def _weights(responses: list[VerifyResponse], weights: torch.Tensor) -> torch.Tensor:
    """``weights`` ``[N]``, or ``[rows, N]`` scaled by each worker's kept mass κ_n where the
    responses carry it (min_tokens: the mixture of p_n(· | not EOS), core.math.aggregation)."""
    if not responses or responses[0].kept_mass is None:
        return weights
    return kept_weights(weights, torch.stack([torch.tensor(_array(r.kept_mass), dtype=torch.float64) for r in responses]))


def _at(weights: torch.Tensor, row: int) -> torch.Tensor:
    """The weights ``[N]`` at one position of ``_weights``."""
    return weights if weights.dim() == 1 else weights[row]


def _first(weights: torch.Tensor, rows: int) -> torch.Tensor:
    """The weights of ``_weights`` for its first ``rows`` positions."""
    return weights if weights.dim() == 1 else weights[:rows]


def _row_ids(resp: VerifyResponse, row: int, vocab_size: int) -> torch.Tensor:
    """The ids of one position's probabilities (all of V when sent in full)."""
    if resp.ids is None:
        return torch.arange(vocab_size)
    return torch.from_numpy(np.array(resp.ids[row], dtype=np.int64))


def _array(value: np.ndarray | None) -> np.ndarray:
    assert value is not None  # the pool checked the response carries it
    return value


_MODES: dict[Mode, _Mode] = {
    Mode.AUTOREGRESSIVE: AutoregressiveMode(),
    Mode.AGGREGATE: AggregateMode(),
    Mode.SPLIT: SplitMode(),
    Mode.EXACT: ExactMode(),
}
