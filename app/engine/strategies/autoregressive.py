"""``autoregressive``: the baseline, one target position per round (docs/design.md §3)."""

from __future__ import annotations

import torch

from app.engine.round import Round, array, mixture, token_logprobs
from app.engine.spec import RoundResult
from app.engine.strategies.base import RoundStrategy
from app.engine.strategies.greedy import CERTIFY_K, certified_argmax, growing_k
from core.math.aggregation import bias_bound, normalise_weights
from core.math.random import Purpose, sample_index, uniform
from core.math.sampling import normalised
from core.math.speculative import argmax_lowest
from core.names import Mode
from core.protocol import VerifyResponse


class AutoregressiveStrategy(RoundStrategy):
    """At T > 0 each worker sends its own sample z_n ~ T(p_n) and the gateway emits z_n with n ~ w
    (lossless, 4 bytes); at T = 0 the gateway certifies the mixture's argmax from top-k rows."""

    async def verify(self, rnd: Round) -> RoundResult:
        req = rnd.req
        want_logprobs = req.top_logprobs is not None
        if req.params.is_greedy:
            token, target = await self._greedy(rnd, want_logprobs)
        else:
            ahead = len(rnd.weights) == 1 and _more_follow(rnd)  # its sample is the token: decoded ahead
            responses = await rnd.call(
                mode=Mode.AUTOREGRESSIVE.value, return_probs=want_logprobs, ahead=ahead
            )
            chosen = 0  # one worker: its sample (the draw over one weight picks it whatever u is)
            if len(rnd.weights) > 1:
                chosen = sample_index(
                    normalise_weights(rnd.weights),
                    uniform(req.seed, req.choice, rnd.positions[0], Purpose.WORKER_CHOICE),
                )
            token = int(array(responses[chosen].samples)[0])
            target = mixture(responses, rnd.vocab_size, rnd.weights) if want_logprobs else None
        logprobs = (
            token_logprobs(normalised(target[:1]), [token], req.top_logprobs) if target is not None else None
        )
        result = RoundResult([token], drafted=0, accepted=0, traffic=rnd.traffic, logprobs=logprobs)
        if not req.spec.is_lossless:  # engine targets: z_n came from a top-k of p_n
            sigma = torch.tensor(
                [[float(array(r.tail_mass)[0]) if r.tail_mass is not None else 0.0] for r in rnd.responses]
            )
            result.lossy.bound = result.lossy.error = bias_bound(sigma, rnd.weights).tolist()
        return result

    async def _greedy(self, rnd: Round, want_logprobs: bool) -> tuple[int, torch.Tensor | None]:
        vocab, single = rnd.vocab_size, len(rnd.targets.workers) == 1

        def decide(responses: list[VerifyResponse], k: int | None) -> tuple[int, torch.Tensor | None] | None:
            if k is None:
                target = mixture(responses, rnd.vocab_size, rnd.weights, normalise=False)
                return argmax_lowest(target[:1])[0], target
            if single:  # its top-1, ties to the lowest id, is the argmax
                return int(array(responses[0].ids)[0, 0]), None
            token = certified_argmax(rnd, responses, 0)
            return (token, None) if token is not None else None

        # its top-1 is the token: the worker may decode it ahead
        ahead = single and _more_follow(rnd)
        return await growing_k(
            rnd,
            Mode.AUTOREGRESSIVE,
            None if want_logprobs else 1 if single else min(CERTIFY_K, vocab),
            decide,
            ahead,
        )


def _more_follow(rnd: Round) -> bool:
    """Whether a token may follow this round's (its max_tokens not reached by it): else a decode ahead is
    wasted."""
    return rnd.req.max_tokens - (len(rnd.sequence) - len(rnd.req.prompt)) > 1
