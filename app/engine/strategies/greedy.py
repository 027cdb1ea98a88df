"""T = 0 over top-k payloads: certify the mixture's argmax (docs/design.md §3.2), asking again with a larger
k."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from app.engine.round import Round, array, mixture, row_ids, token_logprobs
from app.engine.spec import RoundResult
from core.math.greedy import certify_argmax
from core.math.sampling import normalised
from core.math.tree import TokenTree
from core.math.walk import verify_tree_greedy
from core.names import Mode
from core.protocol import VerifyResponse

CERTIFY_K = 8  # the first top-k asked
T = TypeVar("T")


async def certified_greedy(rnd: Round) -> RoundResult:
    """Accept while x_j is the certified argmax of the mixture (whole rows when logprobs are asked)."""
    draft = rnd.draft
    if rnd.req.top_logprobs is not None:
        target = mixture(
            await rnd.call(mode=Mode.EXACT.value, k=None), rnd.vocab_size, rnd.weights, normalise=False
        )
        verdict = verify_tree_greedy(target, draft)
        tokens = verdict.output(draft)
        logprobs = token_logprobs(
            normalised(target[[0, *(node + 1 for node in verdict.path)]]), tokens, rnd.req.top_logprobs
        )
        return RoundResult(
            tokens,
            drafted=len(draft),
            accepted=verdict.num_accepted,
            traffic=rnd.traffic,
            logprobs=logprobs,
            path=_kept(draft, verdict.path),
        )

    def walk(responses: list[VerifyResponse], k: int | None) -> RoundResult | None:
        node, path, target = -1, list[int](), None
        while True:  # down the tree (a chain's row j is node j − 1's) while the argmax is a child
            target = certified_argmax(rnd, responses, node + 1)
            match = (
                next((c for c in draft.children(node) if int(draft.tokens[c]) == target), None)
                if target is not None
                else None
            )
            if match is None:
                break
            node = match
            path.append(node)
        if target is None:
            return None
        tokens = [*(int(draft.tokens[n]) for n in path), int(target)]
        return RoundResult(
            tokens, drafted=len(draft), accepted=len(path), traffic=rnd.traffic, path=_kept(draft, path)
        )

    return await growing_k(rnd, Mode.EXACT, min(CERTIFY_K, rnd.vocab_size), walk)


async def growing_k(
    rnd: Round,
    mode: Mode,
    k: int | None,
    decide: Callable[[list[VerifyResponse], int | None], T | None],
    ahead: bool = False,
) -> T:
    """Ask every target for its top-``k`` rows, then 8× as many, …, then whole rows, until ``decide`` can
    tell."""
    while True:
        decided = decide(await rnd.call(mode=mode.value, k=k, ahead=ahead), k)
        if decided is not None:
            return decided
        k = None if k is None or k * 8 >= rnd.vocab_size else k * 8


def certified_argmax(rnd: Round, responses: list[VerifyResponse], row: int) -> int | None:
    """The mixture's argmax at ``row`` of the answers when their top-k rows certify it, else None."""
    ids = [row_ids(r, row, rnd.vocab_size) for r in responses]
    probs = [torch.tensor(array(r.probs)[row]) for r in responses]
    return certify_argmax(ids, probs, rnd.weights, rnd.vocab_size)


def _kept(draft: TokenTree, path: list[int]) -> list[int] | None:
    """The accepted path the workers keep next call (a tree's; a chain's tokens are agreed anyway)."""
    return None if draft.is_chain else list(path)
