"""``split``: DSSD (DESIGN §3.4)."""

from __future__ import annotations

import torch

from app.engine.round import Round, array, mixture, worker_logprobs
from app.engine.spec import RoundResult
from app.engine.strategies.base import Strategy
from core.math.random import Purpose, sample_index, uniform
from core.math.speculative import residual
from core.names import Mode


class SplitStrategy(Strategy):
    """DSSD (DESIGN §3.4), one worker: it runs the accept test with q̂_j(x_j) and its own
    stream; the gateway draws the recovered token from norm(max(0, p − q̂)) with its own q̂."""

    async def verify(self, rnd: Round) -> RoundResult:
        req, spec, draft = rnd.req, rnd.req.spec, rnd.draft
        gamma = len(draft)
        q_draft = draft.q_values().double().numpy()  # f64: the worker tests with the very q̂ the residual uses
        resp = (await rnd.call(mode=Mode.SPLIT.value, k=spec.k, draft_probs=q_draft, logprobs=req.top_logprobs))[0]
        accepted, result_bound = resp.num_accepted, []
        if accepted == gamma or req.params.is_greedy:
            token = resp.bonus
            final = float(array(resp.sample_logprobs)[0]) if req.top_logprobs is not None else 0.0
        else:
            p_row = mixture([resp], rnd.vocab_size, rnd.configured)[0]  # one worker, one row
            u = uniform(req.seed, req.choice, rnd.positions[accepted], Purpose.RESIDUAL)
            token = sample_index(residual(p_row, draft.q_row(accepted - 1, rnd.vocab_size)), u)
            final = float(torch.log(p_row[token].clamp(min=1e-45)))  # from the row sent: p, or p̂ of its top-k
            result_bound = [0.0] * accepted + [float(array(resp.tail_mass)[0])] if spec.k is not None else []  # p̂ decided the last token only
        tokens = [*draft.ids()[:accepted], token]
        result = RoundResult(tokens, drafted=gamma, accepted=accepted, traffic=rnd.traffic)
        if req.top_logprobs is not None:
            values = [*array(resp.draft_logprobs)[:accepted].tolist(), final]
            result.logprobs = worker_logprobs(rnd, tokens, values)
        if not spec.is_lossless:
            result.bound = result_bound + [0.0] * (len(tokens) - len(result_bound))
            result.error = list(result.bound)  # renormalize: e = σ at the one position sent
        return result
