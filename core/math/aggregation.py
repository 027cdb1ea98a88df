"""SpecFed (DESIGN §3.3): reconstructing p̂_n from a top-k payload, aggregating workers, and
the quantities the evaluation reports (eqs. 5–10, 21–23)."""

from __future__ import annotations

import torch

from core.names import Reconstruction


def reconstruct(
    ids: torch.Tensor,  # [m, k] long
    probs: torch.Tensor,  # [m, k]
    vocab_size: int,
    method: Reconstruction = Reconstruction.RENORMALIZE,
    tail_mass: torch.Tensor | None = None,  # [m]: σ_n as the worker summed it; else 1 − ρ_n
) -> torch.Tensor:  # [m, V] float64, rows sum to 1
    """p̂_n from the top-k ids and probabilities of worker n."""
    probs = probs.double()
    dense = torch.zeros(probs.shape[0], vocab_size, dtype=torch.float64).scatter(-1, ids.long(), probs)
    rho = probs.sum(dim=-1, keepdim=True)
    if method is Reconstruction.RENORMALIZE:
        return dense / rho
    sigma = (1 - rho) if tail_mass is None else tail_mass.double()[:, None]
    k = ids.shape[-1]
    if k == vocab_size:
        return dense / rho
    fill = (sigma.clamp(min=0) / (vocab_size - k)).expand(-1, vocab_size)
    seen = torch.zeros_like(dense, dtype=torch.bool).scatter(-1, ids.long(), True)
    out = torch.where(seen, dense, fill)
    return out / out.sum(dim=-1, keepdim=True)


def aggregate(
    dists: torch.Tensor,  # [N, m, V]: p̂_n (or p_n) per worker
    weights: torch.Tensor,  # [N], ≥ 0
) -> torch.Tensor:  # [m, V] float64: Σ_n w_n p̂_n with w normalised (eq. 7)
    w = normalise_weights(weights)
    return torch.einsum("n,nmv->mv", w, dists.double())


def normalise_weights(weights: torch.Tensor) -> torch.Tensor:  # [N] float64, sums to 1
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
