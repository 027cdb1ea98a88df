"""Greedy (T = 0) over several workers (DESIGN §3.2, §3.5): the target token is the argmax of
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
    """The mixture's argmax if the top-k payloads prove it, else None.

    A token's lower bound is Σ_{n∋y} w_n p_n(y); its upper bound adds w_n p_n^{(k)} (the k-th
    largest of worker n) for each worker that did not send it. Certified when the best lower
    bound beats every other upper bound, including that of the tokens nobody sent.
    """
    w = normalise_weights(weights)
    seen = torch.zeros(len(ids), vocab_size, dtype=torch.bool)
    dense = torch.zeros(len(ids), vocab_size, dtype=torch.float64)
    for n, (i, p) in enumerate(zip(ids, probs)):
        seen[n, i.long()] = True
        dense[n, i.long()] = p.double()
    kth = torch.tensor([float(p.min()) if p.numel() < vocab_size else 0.0 for p in probs], dtype=torch.float64)
    lower = (w[:, None] * dense).sum(0)  # [V]
    upper = lower + (w[:, None] * kth[:, None] * ~seen).sum(0)  # [V]
    best = int(torch.argmax(lower))  # torch.argmax returns the first maximal index
    if bool(seen.all()):
        return best  # every worker sent everything: the mixture is exact
    others = upper.clone()
    others[best] = float("-inf")
    return best if bool(lower[best] > others.max()) else None
