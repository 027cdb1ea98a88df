"""What a round verifies: the tokens a grammar forces (no call), or a chain of γ or a tree (docs/design.md §3.6)."""

from __future__ import annotations

import time

from app.drafting import DraftModel
from app.engine.session import Session
from app.engine.spec import GenerationRequest, RoundResult, TokenLogprob
from app.targets.channel import Traffic
from core.math.shapes import TreeShape
from core.math.tree import TokenTree
from core.modes import MODES
from core.names import Mode

FORCED_EXTRA = 8  # tokens a grammar forces that a draft may carry beyond its shape (free: no draft step of their own)
MAX_DRAFT = 32  # the longest chain sent (γ ≤ 32; a worker decodes tokens + draft, ≤ 32 keeps llama.cpp's numerics)


def forced(session: Session, room: int) -> RoundResult | None:
    """The tokens the grammar forces after the sequence (docs/design.md §3.9), within ``room``; None when the next is not forced."""
    transformer, req = session.transformer, session.req
    if transformer is None or transformer.matcher is None:
        return None
    started = time.perf_counter()
    tokens = transformer.forced_run(session.sequence, room, session.eos_ids)
    if not tokens:
        return None
    result = RoundResult(tokens, drafted=0, accepted=0, traffic=Traffic(), forced=len(tokens))
    if req.top_logprobs is not None:
        result.logprobs = [TokenLogprob(t, 0.0, [(t, 0.0)] if req.top_logprobs else []) for t in tokens]
    result.seconds = {"gateway_math": time.perf_counter() - started}
    return result


async def propose(
    draft: DraftModel, session: Session, room: int, gamma: int, keyed: GenerationRequest, timing: dict[str, float], prepared: TokenTree | None = None,
) -> TokenTree:
    """The round's draft (``keyed``: the request as this round draws): its tree, else a chain of ``gamma`` (``prepared`` with overlap), or none."""
    if not MODES[keyed.spec.mode].drafts:
        return TokenTree.chain([], [])
    request = keyed.draft(session.id, session.sequence, session.transformer)
    if keyed.spec.mode is Mode.TREE:  # the request's tree, else the default by temperature
        shape = keyed.spec.tree or TreeShape.default(keyed.params.is_greedy)
        if room <= 1:
            return TokenTree.chain([], [])
        cut = shape.cut(room - 1)  # no deeper than the room left after the round's last token
        extra = max(0, min(FORCED_EXTRA, MAX_DRAFT - cut.size))  # the grammar's forced runs below the leaves, free
        return await draft.propose_tree(request, cut, room - 1, extra, timing)
    gamma = min(gamma, room - 1)
    if prepared is not None:
        return prepared.head(gamma)
    if gamma <= 0:
        return TokenTree.chain([], [])
    limit = min(room - 1, max(gamma, min(gamma + FORCED_EXTRA, MAX_DRAFT)))  # a grammar's forced tokens on top, free
    return await draft.propose(request, gamma, limit, timing=timing)
