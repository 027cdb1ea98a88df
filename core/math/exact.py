"""`exact` (docs/design.md §3.5), lossless with sparse payloads: §3.1 for p = Σ_n w_n p_n from each p_n on
S_j, its mass c_n off S_j, a sample y_n there."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.math.aggregation import normalise_weights
from core.math.random import sample_index
from core.math.relaxed import relaxed_acceptance_probs
from core.math.speculative import Verdict, acceptance_probs, first_rejection


@dataclass(frozen=True)
class SparseNode:
    """What the workers sent for one row (a chain's draft position j, or a tree's root or node v)."""

    # [s] long, ascending: S_j, the ids of q̂_j's support (a tree's: and the children; empty at a leaf)
    support: torch.Tensor
    p: torch.Tensor  # [N, s]: p_n on S_j, per worker
    complement: torch.Tensor  # [N]: c_n = Σ_{x∉S_j} p_n(x), per worker
    samples: list[int]  # [N]: y_n ~ p_n(· | x ∉ S_j); −1 where c_n = 0


@dataclass(frozen=True)
class ExactPosition(SparseNode):
    """What the gateway holds for one draft position j of a chain: the workers' row and q̂_j."""

    q: torch.Tensor  # [s]: q̂_j on S_j (sums to 1)


def normalised_payload(
    p: torch.Tensor,  # [N, s]: p_n on S as sent (fp32 values)
    complement: torch.Tensor,  # [N]: c_n, the rest of the row summed
) -> tuple[torch.Tensor, torch.Tensor]:  # [N, s], [N] float64: each worker's row summing to 1
    """Each worker's p_n on S plus c_n scaled to sum to 1 (its fp32 row sums to 1 ± 1e-6:
    ``core.math.sampling.normalised``)."""
    total = p.double().sum(dim=-1) + complement.double()
    return p.double() / total[:, None], complement.double() / total


def extended_residual(
    p_mix: torch.Tensor,  # [s]: p(x) = Σ_n w_n p_n(x) on S_j
    q: torch.Tensor,  # [s]: q̂_j on S_j
    complement: torch.Tensor,  # [N]: c_n
    weights: torch.Tensor,  # [N], normalised
) -> torch.Tensor:  # [s + N] float64, unnormalised
    """max(0, p − q̂) on S_j, then each worker's off-support mass w_n c_n; where all of that is 0 (p = q̂), p
    on the same support."""
    on_support = torch.clamp(p_mix.double() - q.double(), min=0.0)
    off_support = weights.double() * complement.double()
    extended = torch.cat([on_support, off_support])
    return extended if extended.sum() > 0 else torch.cat([p_mix.double(), off_support])


def draw_extended(
    support: torch.Tensor,  # [s]: S_j
    samples: list[int],  # [N]: each worker's sample from off S_j
    extended: torch.Tensor,  # [s + N]: mass on S_j, then each worker's off it
    u: float,  # the residual draw
) -> int:
    """A token from an extended distribution: an id of S_j, or worker n's complement sample."""
    index = sample_index(extended, u)
    return int(support[index]) if index < support.shape[0] else samples[index - support.shape[0]]


def verify_exact(
    positions: list[ExactPosition],  # [γ]
    draft_index: list[int],  # [γ]: where x_j sits in S_j
    bonus_samples: list[int],  # [N]: z_n ~ p_n at position γ+1
    weights: torch.Tensor,  # [N]
    accept_u: torch.Tensor,  # [γ]
    residual_u: torch.Tensor,  # [γ]
    bonus_choice_u: float,  # which worker's z_n is the bonus
    taus: torch.Tensor | None = None,  # [γ]: DSD's relaxation τ_j (core.math.relaxed); None = strict
) -> Verdict:
    w = normalise_weights(weights)
    p_mix = [w @ pos.p.double() for pos in positions]  # [γ] × [s]
    p_draft = torch.stack([pm[i] for pm, i in zip(p_mix, draft_index)]) if positions else torch.empty(0)
    q_draft = (
        torch.stack([pos.q.double()[i] for pos, i in zip(positions, draft_index)])
        if positions
        else torch.empty(0)
    )
    probs = (
        acceptance_probs(p_draft, q_draft)
        if taus is None
        else relaxed_acceptance_probs(p_draft, q_draft, taus)
    )
    accepted = first_rejection(probs, accept_u)
    if accepted < len(positions):
        pos = positions[accepted]
        extended = extended_residual(p_mix[accepted], pos.q, pos.complement, w)
        return Verdict(
            accepted,
            draw_extended(pos.support, pos.samples, extended, float(residual_u[accepted])),
            is_bonus=False,
        )
    chosen = sample_index(w, bonus_choice_u)
    return Verdict(accepted, bonus_samples[chosen], is_bonus=True)
