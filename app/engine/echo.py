"""Echo with logprobs: the prompt's own log-probabilities under the mixture, before any round."""

from __future__ import annotations

import time

import numpy as np
import torch

from app.engine.round import all_workers, array
from app.engine.session import Session
from app.engine.spec import RoundResult, TokenLogprob
from app.targets.base import Traffic
from app.targets.pool import TargetSet
from core.math.aggregation import merge_top_logprobs, mixed_logprob
from core.names import Mode
from core.protocol import VerifyRequest


async def score_prompt(pool: TargetSet, weights: torch.Tensor, session: Session) -> RoundResult:
    """Every worker prefills the prompt and scores its own tokens (the rows predicting tokens
    1..); the mixture's log-probabilities (``weights``: [N]), the first token's None."""
    req = session.req
    prompt, n = req.prompt, req.prompt_logprobs
    requests = [
        VerifyRequest.after(
            session.id, [], prompt, [], **req.sampling_wire(), seed=req.seed, choice=req.choice, worker=w,  # type: ignore[arg-type]
            mode=Mode.AUTOREGRESSIVE.value, k=1, return_probs=False, score_tokens=True, logprobs=n,
        )
        for w in range(len(pool.workers))
    ]
    started = time.perf_counter()
    results = await all_workers(pool, requests, prompt)
    responses, traffic = [resp for resp, _ in results], Traffic()
    for _, t in results:
        traffic.add(t)
    values = np.stack([array(r.prompt_logprobs) for r in responses])  # [N, P − 1]
    tops = [(array(r.prompt_top_ids), array(r.prompt_top_logprobs)) for r in responses] if n else []
    logprobs = [TokenLogprob(prompt[0], None, None)] + [
        TokenLogprob(token, mixed_logprob(values[:, i].tolist(), weights), merge_top_logprobs(tops, i, n or 0, weights))
        for i, token in enumerate(prompt[1:])
    ]
    result = RoundResult([], drafted=0, accepted=0, traffic=traffic, prompt_logprobs=logprobs)
    result.verify_s, result.model_s = time.perf_counter() - started, max(r.model_ms for r in responses) / 1e3
    result.busy_s = sum(r.model_ms for r in responses) / 1e3
    return result
