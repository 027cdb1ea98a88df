"""SpecFed (docs/design.md §3.3): reconstructing p̂_n from a top-k payload, aggregating workers, and the
quantities the evaluation reports (eqs. 5–10, 21–23)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from core.names import Reconstruction


def reconstruct(
    ids: torch.Tensor,  # [m, k] long
    probs: torch.Tensor,  # [m, k]
    vocab_size: int,
    method: Reconstruction = Reconstruction.RENORMALIZE,
    tail_mass: torch.Tensor | None = None,  # [m]: σ_n as the worker summed it; else 1 − ρ_n
    # [m, V] bool: the grammar's allowed ids per row (docs/design.md §3.9)
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:  # [m, V] float64, rows sum to 1
    """p̂_n from the top-k ids and probabilities of worker n. With a grammar, ``residual``
    spreads σ_n over the allowed ids outside the top-k only (T(p_n) has no mass on the others,
    so the bound TV(p̂_n, p_n) ≤ σ_n holds as before, and no masked id can be emitted)."""
    probs = probs.double()
    dense = torch.zeros(probs.shape[0], vocab_size, dtype=torch.float64, device=probs.device).scatter(
        -1, ids.long(), probs
    )
    rho = probs.sum(dim=-1, keepdim=True)
    k = ids.shape[-1]
    if method is Reconstruction.RENORMALIZE or k == vocab_size:
        return dense / rho
    sigma = ((1 - rho) if tail_mass is None else tail_mass.double()[:, None]).clamp(min=0)
    seen = torch.zeros_like(dense, dtype=torch.bool).scatter(-1, ids.long(), True)
    if allowed is not None:
        region = allowed & ~seen
        count = region.sum(dim=-1, keepdim=True)
        out = torch.where(count > 0, torch.where(region, sigma / count.clamp(min=1), dense), dense)
    else:
        out = torch.where(seen, dense, (sigma / (vocab_size - k)).expand(-1, vocab_size))
    return out / out.sum(dim=-1, keepdim=True)


def aggregate(
    dists: torch.Tensor,  # [N, m, V]: p̂_n (or p_n) per worker
    weights: torch.Tensor,  # [N], ≥ 0
) -> torch.Tensor:  # [m, V] float64: Σ_n w_n p̂_n with w normalised (eq. 7)
    return torch.einsum("n,nmv->mv", normalise_weights(weights), dists.double())


def normalise_weights(weights: torch.Tensor) -> torch.Tensor:  # [N] float64, summing to 1
    w = weights.double()
    if (w < 0).any() or not w.sum() > 0:
        raise ValueError(f"weights must be ≥ 0 and not all 0, got {weights.tolist()}")
    return w / w.sum()


def tv_distance(
    p: torch.Tensor,  # [..., V]
    q: torch.Tensor,  # [..., V]
) -> torch.Tensor:  # [...]
    return 0.5 * (p.double() - q.double()).abs().sum(dim=-1)


def bias_bound(
    tail_mass: torch.Tensor,  # [N, m]: σ_n per worker and position
    weights: torch.Tensor,  # [N]
) -> torch.Tensor:  # [m]: Σ_n w_n σ_n, the bound on TV(p̂, p) and on Δβ (Theorems 2–3)
    return torch.einsum("n,nm->m", normalise_weights(weights), tail_mass.double())


_LOG_FLOOR = 1e-45  # log 0 is reported as log 1e-45 (finite in JSON)


def mixed_probability(
    probs: torch.Tensor,  # [N]: p_n(x) per worker
    weights: torch.Tensor,  # [N]
) -> float:
    """log p(x) = log Σ_n w_n p_n(x)."""
    return float(torch.log((normalise_weights(weights) @ probs.double()).clamp(min=_LOG_FLOOR)))


def mixed_logprob(
    logprobs: list[float],  # [N]: log p_n(x) per worker
    weights: torch.Tensor,  # [N]
) -> float:
    """log p(x) from the workers' log p_n(x)."""
    return mixed_probability(torch.tensor(logprobs, dtype=torch.float64).exp(), weights)


def merge_top_logprobs(
    tops: Sequence[tuple[Any, Any]],  # per worker: (ids [rows, n], logprobs [rows, n]), arrays or tensors
    row: int,
    n: int,
    weights: torch.Tensor,  # [N]
) -> list[tuple[int, float]]:
    """The mixture's n most likely ids at ``row`` among the workers' top-n; with several workers an unlisted
    id counts 0 (a lower bound)."""
    if not n or not tops:
        return []
    w = normalise_weights(weights)
    mass: dict[int, float] = {}
    for (ids, logprobs), weight in zip(tops, w.tolist()):
        for token, value in zip(
            torch.tensor(ids[row]).tolist(), torch.tensor(logprobs[row]).double().exp().tolist()
        ):
            # copies: a decoded frame is read-only
            mass[token] = mass.get(token, 0.0) + weight * value
    best = sorted(mass.items(), key=lambda item: (-item[1], item[0]))[:n]
    return [
        (token, float(torch.log(torch.tensor(max(p, _LOG_FLOOR), dtype=torch.float64)))) for token, p in best
    ]
