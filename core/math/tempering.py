"""T(p) from a top-k summary of p (docs/design.md §3.2, §8): an engine that only reports its top-k
logprobs at temperature 1 still defines the target ``T(p)`` for any temperature, top-k and
top-p — up to the mass its unseen tail gets after tempering, which is bounded here.

For the k reported tokens with probabilities p_i (tail mass σ = 1 − Σ p_i, every unseen token at most p_min =
min p_i, or a given ceiling), tempering by T gives weights p_i^{1/T}; the unseen tail's weight is
    T < 1:  Σ_tail p^{1/T} ≤ σ · p_min^{1/T − 1}        (each tail p ≤ p_min)
    T > 1:  Σ_tail p^{1/T} ≤ (V − k)^{1 − 1/T} σ^{1/T}  (Hölder over at most V − k tokens)
so the tempered tail mass σ_T is at most tail / (head + tail). A top-k of the request at most k
cuts the tail off entirely (σ_T = 0, exact); top-p is applied within the known tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.math.sampling import SamplingParams, mask_top_k, mask_top_p


@dataclass(frozen=True)
class TemperedTopK:
    probs: torch.Tensor  # [k] float64: T(p) on the reported ids, renormalised over them
    tail_bound: float  # an upper bound on the mass T(p) puts outside them (0 when exact)


def temper_top_k(
    probs: torch.Tensor,  # [k] float64: p (temperature 1) of the reported tokens, any order
    vocab_size: int,
    params: SamplingParams,
    ceiling: float | None = None,  # the most any unreported token may have; default min(probs)
) -> TemperedTopK:
    """T(p) restricted to the reported tokens, and how much mass that leaves unaccounted for."""
    probs = probs.double()
    k, sigma = probs.numel(), max(0.0, 1.0 - float(probs.sum()))
    if params.is_greedy or params.temperature == 1.0:
        head, tail = probs, sigma
    else:
        inv_t = 1.0 / params.temperature
        head = probs**inv_t
        if params.temperature < 1:
            tail = sigma * (float(probs.min()) if ceiling is None else ceiling) ** (inv_t - 1.0)
        else:
            tail = max(vocab_size - k, 0) ** (1.0 - inv_t) * sigma**inv_t
    logits = torch.log(head.clamp(min=1e-300)).unsqueeze(0)
    if not params.is_greedy and 0 < params.top_k <= k:
        logits, tail = mask_top_k(logits, params.top_k), 0.0  # the request's own top-k is inside ours
    if not params.is_greedy and params.top_p < 1:
        logits = mask_top_p(logits, params.top_p)
    kept = torch.softmax(logits[0], dim=-1)
    total = float(head[torch.isfinite(logits[0])].sum())
    return TemperedTopK(kept, tail / (total + tail) if tail > 0 else 0.0)
