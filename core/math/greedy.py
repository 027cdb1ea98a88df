"""Greedy (T = 0) over several workers (docs/design.md §3.2, §3.5): the target token is the argmax of
the mixture Σ_n w_n softmax(l_n), ties to the lowest id — not a vote of the workers' argmaxes.
From top-k payloads it is certified by bounds, or not (then ask again with a larger k)."""

from __future__ import annotations

import torch

from core.math.aggregation import normalise_weights


def certify_argmax(
    ids: list[torch.Tensor],  # N × [k_n] long: worker n's top-k ids
    probs: list[torch.Tensor],  # N × [k_n]: softmax(l_n) at those ids, falling
    weights: torch.Tensor,  # [N]
    vocab_size: int,
) -> int | None:
    """The mixture's argmax if the top-k payloads prove it (its lower bound beats every other upper bound,
    docs/design.md §3.5), else None."""
    w = normalise_weights(weights)
    union = torch.unique(torch.cat([i.long() for i in ids]))  # ascending: ties go to the lowest id
    column = {int(token): c for c, token in enumerate(union.tolist())}
    seen = torch.zeros(len(ids), union.shape[0], dtype=torch.bool)
    dense = torch.zeros(len(ids), union.shape[0], dtype=torch.float64)
    for n, (i, p) in enumerate(zip(ids, probs)):
        at = torch.tensor([column[int(t)] for t in i.tolist()], dtype=torch.long)
        seen[n, at] = True
        dense[n, at] = p.double()
    kth = torch.tensor(
        [float(p.min()) if p.numel() < vocab_size else 0.0 for p in probs], dtype=torch.float64
    )
    lower = (w[:, None] * dense).sum(0)  # [U]: over the ids some worker sent
    upper = lower + (w[:, None] * kth[:, None] * ~seen).sum(0)  # [U]
    best = int(torch.argmax(lower))  # the first maximal column: the lowest id among ties
    if union.shape[0] == vocab_size and bool(seen.all()):
        return int(union[best])  # every worker sent everything: the mixture is exact
    others = upper.clone()
    others[best] = float("-inf")
    if union.shape[0] < vocab_size:  # a token nobody sent: Σ_n w_n p_n^{(k)} at most
        others = torch.cat([others, (w * kth).sum()[None]])
    return int(union[best]) if bool(lower[best] > others.max()) else None
