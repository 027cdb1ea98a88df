"""Relaxed verification (DSD, docs/design.md §3.8): opt-in and lossy, with its distance known exactly.

Accept x_j iff r_j < τ_j + (1 − τ_j)·min(1, p_j(x_j) / q_j(x_j)), else the §3.1 residual: the token
follows τ_j q_j + (1 − τ_j) p_j, at TV distance τ_j (1 − β_j) from p_j. DSD names the signals of
τ_j; the weights are ours:

    τ_j = τ_max · [argmax q_j = argmax p_j] · exp(−KL(q_j ‖ p_j) / kl_scale) · β_j

so τ is large only where the models agree on the token and on the distribution (β_j = 1 − TV).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from core.math.random import sample_index
from core.math.speculative import Verdict, argmax_lowest, beta, first_rejection, residual


@dataclass(frozen=True)
class Relaxation:
    """The τ settings of a request (``"speculative": {"relaxation": {...}}``)."""

    tau_max: float = 0.5  # τ's ceiling, in [0, 1); 0 = strict
    kl_scale: float = 1.0  # nats: τ falls by a factor e per kl_scale of KL(q ‖ p)

    def __post_init__(self) -> None:
        if not 0 <= self.tau_max < 1:
            raise ValueError("tau_max must lie in [0, 1)")
        if not self.kl_scale > 0:
            raise ValueError("kl_scale must be > 0")


def relaxation_factor(
    p: torch.Tensor,  # [V]: the target at one position
    q: torch.Tensor,  # [V]: the distribution the draft sampled from there
    settings: Relaxation,
) -> float:
    """τ_j of one position (see the module's docstring); 0 when the models disagree on top-1."""
    return relaxation_factor_on_support(p, q, -math.inf, settings)


def relaxation_factor_on_support(
    p: torch.Tensor,  # [s]: the target on S, the draft's support (ids ascending)
    q: torch.Tensor,  # [s]: the draft there
    off_mass: float,  # the target's mass outside S
    settings: Relaxation,
) -> float:
    """τ with the target known on S only (``exact``): top-1 agreement counts only when p's largest entry on S
    beats the mass off S."""
    if settings.tau_max == 0:
        return 0.0
    top = argmax_lowest(p[None])[0]
    if top != argmax_lowest(q[None])[0] or not float(p[top]) > off_mass:
        return 0.0
    p64, q64 = p.double(), q.double()
    support = q64 > 0
    if bool((p64[support] <= 0).any()):
        return 0.0  # KL(q ‖ p) = ∞
    kl = float((q64[support] * (q64[support].log() - p64[support].log())).sum())
    return settings.tau_max * math.exp(-max(kl, 0.0) / settings.kl_scale) * float(beta(p64, q64))


def relaxation_factors(
    p: torch.Tensor,  # [γ(+1), V]: the target at each draft position (a bonus row is ignored)
    q: torch.Tensor,  # [γ, V]
    settings: Relaxation,
) -> torch.Tensor:  # [γ] float64
    return torch.tensor(
        [relaxation_factor(p[j], q[j], settings) for j in range(q.shape[0])], dtype=torch.float64
    )


def relaxed_acceptance_probs(
    p_draft: torch.Tensor,  # [γ]: p_j(x_j)
    q_draft: torch.Tensor,  # [γ]: q_j(x_j) > 0
    taus: torch.Tensor,  # [γ]: τ_j
) -> torch.Tensor:  # [γ]: τ_j + (1 − τ_j)·min(1, p_j(x_j)/q_j(x_j))
    if taus.shape != p_draft.shape:
        # a τ per draft token, no more: a longer list would test tokens that were never drafted
        raise ValueError(
            f"{tuple(taus.shape)} relaxation factors for draft tokens of shape {tuple(p_draft.shape)}"
        )
    strict = torch.clamp(p_draft.double() / q_draft.double(), max=1.0)
    return taus.double() + (1 - taus.double()) * strict


def verify_relaxed(
    p: torch.Tensor,  # [γ+1, V]
    q: torch.Tensor,  # [γ, V]
    draft: list[int],  # [γ]
    accept_u: torch.Tensor,  # [γ]: r_j ~ U[0, 1)
    final_u: torch.Tensor,  # [γ+1]: the residual / bonus draw at each position
    taus: torch.Tensor,  # [γ]
) -> Verdict:
    """The chain verifier (``tests.oracles.verify_sampled``) with the relaxed accept test; the residual and
    the bonus are the strict ones."""
    gamma = len(draft)
    index = torch.tensor(draft, dtype=torch.long)[:, None]
    j = first_rejection(
        relaxed_acceptance_probs(p[:gamma].gather(-1, index)[:, 0], q.gather(-1, index)[:, 0], taus), accept_u
    )
    if j < gamma:
        return Verdict(j, sample_index(residual(p[j], q[j]), float(final_u[j])), is_bonus=False)
    return Verdict(gamma, sample_index(p[gamma], float(final_u[gamma])), is_bonus=True)


def relaxed_distance(
    p: torch.Tensor,  # [..., V]
    q: torch.Tensor,  # [..., V]
    taus: torch.Tensor,  # [...]
) -> torch.Tensor:  # [...]: TV(τ q + (1 − τ) p, p) = τ (1 − β)
    return taus.double() * (1 - beta(p, q))
