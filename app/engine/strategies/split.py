"""``split``: DSSD (docs/design.md §3.4)."""

from __future__ import annotations

import numpy as np
import torch

from app.engine.round import Round, array, mixture, worker_logprobs
from app.engine.spec import RoundResult
from app.engine.strategies.base import RoundStrategy
from core.math.random import Purpose, sample_index, uniform
from core.math.speculative import residual
from core.math.tree import TokenTree
from core.names import Mode
from core.protocol import AskFields


class SplitStrategy(RoundStrategy):
    """DSSD (docs/design.md §3.4), one worker: it runs the accept test with q̂_j(x_j); the recovered token is
    drawn by the gateway from the row sent, or (a truncated draft, whole rows) by the worker, given q̂ on the
    draft's supports."""

    async def verify(self, rnd: Round) -> RoundResult:
        req, spec, draft = rnd.req, rnd.req.spec, rnd.draft
        gamma = len(draft)
        # f64: the worker tests with the very q̂ the residual uses
        q_draft = draft.q_values().double().numpy()
        drawn = _drawn_at_worker(rnd)
        ask = AskFields(mode=Mode.SPLIT.value, k=spec.k, draft_probs=q_draft, logprobs=req.top_logprobs)
        resp = (await rnd.call(**(ask | _supports(draft) if drawn else ask)))[0]
        accepted, result_bound = resp.num_accepted, []
        if accepted == gamma or req.params.is_greedy or drawn:
            # the bonus, or the token the worker drew at the rejection
            token = resp.bonus
            final = float(array(resp.sample_logprobs)[0]) if req.top_logprobs is not None else 0.0
        else:
            p_row = mixture([resp], rnd.vocab_size, rnd.weights)[0]  # one worker, one row
            u = uniform(req.seed, req.choice, rnd.positions[accepted], Purpose.RESIDUAL)
            q_row = draft.q_row(accepted - 1, rnd.vocab_size)
            token = sample_index(residual(p_row, q_row), u)
            # from the row sent: p, or p̂ of its top-k
            final = float(torch.log(p_row[token].clamp(min=1e-45)))
            if spec.k is not None:
                # p̂ decided the last token only: its residual's distance, over the rejections
                result_bound = [0.0] * accepted + [
                    _residual_bound(float(array(resp.tail_mass)[0]), p_row, q_row)
                ]
        tokens = [*draft.ids()[:accepted], token]
        result = RoundResult(tokens, drafted=gamma, accepted=accepted, traffic=rnd.traffic)
        if req.top_logprobs is not None:
            values = [*array(resp.draft_logprobs)[:accepted].tolist(), final]
            result.logprobs = worker_logprobs(rnd, tokens, values)
        if not spec.is_lossless:
            result.lossy.bound = result_bound + [0.0] * (len(tokens) - len(result_bound))
            # the one position p̂ decided: its residual's bound (_residual_bound)
            result.lossy.error = list(result.lossy.bound)
        return result


def _drawn_at_worker(rnd: Round) -> bool:
    """A lossless round (whole rows, ``k`` None) of a truncated draft (q̂ on supports of ``draft_top_k`` /
    ``draft_top_p``) at T > 0: the worker gets q̂ on each support and draws the token at a rejection itself —
    a few hundred bytes up, no row of the vocabulary down (issue 61: 137–192 KB a rejected round before); the
    same token, from the same numbers."""
    spec = rnd.req.spec
    return (
        not rnd.req.params.is_greedy and spec.k is None and spec.truncation != (0, 1.0) and len(rnd.draft) > 0
    )


def _supports(draft: TokenTree) -> AskFields:
    """S_j and q̂_j on it for each draft position (a chain: row j is node j − 1's)."""
    rows = [draft.support(j - 1) for j in range(len(draft))]
    return AskFields(
        support_ids=torch.cat([ids for ids, _ in rows]).numpy(),
        support_sizes=np.array([len(ids) for ids, _ in rows], dtype=np.int32),
        support_q=torch.cat([q.double() for _, q in rows]).numpy(),
    )


def _residual_bound(sigma: float, p_hat: torch.Tensor, q: torch.Tensor) -> float:
    """The worker accepted with p, the gateway drew from p̂'s residual: the first token's law is
    off by Z·TV(res(p̂), res(p)) (Z = P(reject)), and TV(res(p̂), res(p)) ≤ ‖p̂ − p‖₁ / Ẑ ≤ 2σ / Ẑ
    with Ẑ = Σ max(0, p̂ − q̂) (σ = TV(p̂, p), the tail the top-k left out). Reported at the
    rejections, its mean bounds the distance; σ alone did not when Z is small (a draft near δ,
    lookup's: 0.069 over 0.063 in the matrix)."""
    z_hat = float((p_hat.double() - q.double()).clamp(min=0).sum())  # [V] rows
    return 1.0 if z_hat <= 0 else min(1.0, 2 * sigma / z_hat)
