"""Echo with logprobs: the prompt's own log-probabilities under the mixture, before any round."""

from __future__ import annotations

import time

import numpy as np

from app.engine.round import Round, array
from app.engine.spec import RoundCost, RoundResult, TokenLogprob
from core.math.aggregation import merge_top_logprobs, mixed_logprob
from core.names import Mode


async def score_prompt(rnd: Round) -> RoundResult:
    """Every worker prefills the prompt (a round, no draft) and scores its tokens: the mixture's logprobs
    (None first); each then holds the prompt."""
    prompt, n = rnd.req.prompt, rnd.req.prompt_logprobs
    started = time.perf_counter()
    responses = await rnd.call(
        mode=Mode.AUTOREGRESSIVE.value, k=1, return_probs=False, score_tokens=True, logprobs=n
    )
    values = np.stack([array(r.prompt_logprobs) for r in responses])  # [N, P − 1]
    tops = [(array(r.prompt_top_ids), array(r.prompt_top_logprobs)) for r in responses] if n else []
    logprobs = [TokenLogprob(prompt[0], None, None)] + [
        TokenLogprob(
            token,
            mixed_logprob(values[:, i].tolist(), rnd.weights),
            merge_top_logprobs(tops, i, n or 0, rnd.weights),
        )
        for i, token in enumerate(prompt[1:])
    ]
    cost = RoundCost(verify_s=time.perf_counter() - started, model_s=rnd.model_s, busy_s=rnd.busy_s)
    return RoundResult([], drafted=0, accepted=0, traffic=rnd.traffic, prompt_logprobs=logprobs, cost=cost)
