"""T = 0 over top-k payloads: certify the mixture's argmax (DESIGN §3.2), asking again with a
larger k where a position cannot be certified."""

from __future__ import annotations

import torch

from app.engine.round import Round, array, mixture, row_ids, token_logprobs, weights_at
from app.engine.spec import RoundResult
from core.math.greedy import certify_argmax
from core.math.tree import verify_tree_greedy
from core.names import Mode

CERTIFY_K = 8  # the first top-k asked


async def certified_greedy(rnd: Round) -> RoundResult:
    """T = 0 over top-k payloads: accept while x_j is the certified argmax of the mixture;
    a position that cannot be certified is asked again with a larger k. With logprobs asked the
    workers send whole distributions (the payload grows only then)."""
    draft = rnd.draft
    if rnd.req.top_logprobs is not None:
        target = mixture(await rnd.call(mode=Mode.EXACT.value, k=None), rnd.vocab_size, rnd.weights)
        verdict = verify_tree_greedy(target, draft)
        tokens = verdict.output(draft)
        logprobs = token_logprobs(target[: len(tokens)], tokens, rnd.req.top_logprobs)
        return RoundResult(tokens, drafted=len(draft), accepted=verdict.num_accepted, traffic=rnd.traffic, logprobs=logprobs)
    k: int | None = min(CERTIFY_K, rnd.vocab_size)
    while True:
        responses = await rnd.call(mode=Mode.EXACT.value, k=k)
        targets: list[int | None] = []
        chain = draft.ids()
        for j in range(len(chain) + 1):
            ids = [row_ids(r, j, rnd.vocab_size) for r in responses]
            probs = [torch.tensor(array(r.probs)[j]) for r in responses]
            targets.append(certify_argmax(ids, probs, weights_at(rnd.weights, j), rnd.vocab_size))
            if targets[-1] is None or j == len(chain) or targets[-1] != chain[j]:
                break
        if targets[-1] is not None:
            accepted = len(targets) - 1
            tokens = [*chain[:accepted], int(targets[-1])]
            return RoundResult(tokens, drafted=len(chain), accepted=accepted, traffic=rnd.traffic)
        k = None if k is None or k * 8 >= rnd.vocab_size else k * 8
