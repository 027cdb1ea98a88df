"""Test oracles: a reference chain verifier and the closed-form laws of one emitted token,
composed from the samplers' own functions (``core.math``). Used only by tests — the exact
checks the statistical tests and the matrix are measured against."""

from __future__ import annotations

import torch

from core.math.aggregation import normalise_weights
from core.math.exact import extended_residual
from core.math.random import sample_index
from core.math.relaxed import relaxed_acceptance_probs
from core.math.shapes import ChildRule
from core.math.speculative import Verdict, acceptance_probs, count_accepted, residual
from core.math.walk import SparseNode, accept_probability, after_rejection, extended_node


def verify_sampled(
    p: torch.Tensor,  # [γ+1, V]: target at each draft position and the bonus position
    q: torch.Tensor,  # [γ, V]: q̂ the draft sampled from
    draft: list[int],  # [γ]: x_j
    accept_u: torch.Tensor,  # [γ]: r_j ~ U[0, 1), one per draft position
    final_u: torch.Tensor,  # [γ+1]: the residual / bonus draw at each position
) -> Verdict:
    """Accept x_j while r_j < min(1, p_j(x_j)/q̂_j(x_j)); resample at the first rejection."""
    gamma = len(draft)
    index = torch.tensor(draft, dtype=torch.long)[:, None]
    accepted = count_accepted(p[:gamma].gather(-1, index)[:, 0], q.gather(-1, index)[:, 0], accept_u)
    if accepted < gamma:
        return Verdict(
            accepted,
            sample_index(residual(p[accepted], q[accepted]), float(final_u[accepted])),
            is_bonus=False,
        )
    return Verdict(gamma, sample_index(p[gamma], float(final_u[gamma])), is_bonus=True)


def output_law(
    p: torch.Tensor,  # [V]: target at one position
    q: torch.Tensor,  # [V]: q̂ the draft samples from
    p_residual: torch.Tensor | None = None,  # [V]: what the residual is taken of (split with top-k: p̂)
) -> torch.Tensor:  # [V] float64
    """Closed-form law of the first emitted token of a round, composed from the sampler's own
    functions: Σ_x q(x)·a(x)·δ_x + (1 − Σ_x q(x)·a(x))·residual(p, q), a = acceptance_probs.
    ``p_residual`` stands in for p in the residual only (split's worker tests with the full p)."""
    q64 = q.double()
    support = (q64 > 0).nonzero()[:, 0]
    accept = torch.zeros_like(q64)
    accept[support] = acceptance_probs(p[support], q64[support])
    kept = q64 * accept
    return kept + (1 - kept.sum()) * residual(p if p_residual is None else p_residual, q)


def exact_output_law(
    p_n: torch.Tensor,  # [N, V]: each worker's T(p_n) at one position
    weights: torch.Tensor,  # [N]
    q_hat: torch.Tensor,  # [V]: the truncated draft distribution
    tau: float = 0.0,  # DSD's relaxation at this position
) -> torch.Tensor:  # [V] float64
    """Closed-form law of the first token of an `exact` round, from the sampler's functions:
    accepted draft mass, plus the rejection mass spread by the extended residual, whose
    worker entries emit y_n ~ p_n(· | x ∉ S)."""
    w = normalise_weights(weights)
    support = (q_hat > 0).nonzero()[:, 0]
    outside = torch.ones(q_hat.shape[0], dtype=torch.bool)
    outside[support] = False
    p_mix = w @ p_n.double()[:, support]
    complement = (p_n.double() * outside).sum(dim=-1)
    q = q_hat.double()[support]
    kept = torch.zeros(q_hat.shape[0], dtype=torch.float64)
    kept[support] = q * (tau + (1 - tau) * acceptance_probs(p_mix, q))
    extended = extended_residual(p_mix, q, complement, w)
    extended = extended / extended.sum()
    law = kept.clone()
    law[support] += (1 - kept.sum()) * extended[: support.shape[0]]
    for n in range(p_n.shape[0]):
        if complement[n] > 0:
            conditional = p_n[n].double() * outside / complement[n]
            law += (1 - kept.sum()) * extended[support.shape[0] + n] * conditional
    return law


def relaxed_output_law(
    p: torch.Tensor,  # [V]
    q: torch.Tensor,  # [V]
    tau: float,
) -> torch.Tensor:  # [V] float64
    """The law of the token emitted at a position, composed from the sampler's own functions:
    Σ_x q(x)·a(x)·δ_x + (1 − Σ_x q(x)·a(x))·residual(p, q), a = relaxed_acceptance_probs.
    It equals τ q + (1 − τ) p."""
    q64 = q.double()
    support = (q64 > 0).nonzero()[:, 0]
    accept = torch.zeros_like(q64)
    accept[support] = relaxed_acceptance_probs(
        p[support], q64[support], torch.full((len(support),), tau, dtype=torch.float64)
    )
    kept = q64 * accept
    return kept + (1 - kept.sum()) * residual(p, q)


def tree_step_law(
    p: torch.Tensor,  # [V]: target at the node
    q: torch.Tensor,  # [V]: q̂ at the node
    candidates: list[int],  # the children's tokens, in draft order
    rule: ChildRule,
    deterministic: int = 0,  # the first ones are lookup children
) -> torch.Tensor:  # [V] float64
    """Closed-form law of the token emitted at a node with these children (the accepted child,
    or the recovered token), composed from the walk's own functions."""
    law = torch.zeros(p.shape[-1], dtype=torch.float64)
    p_now, q_now, left = p.double(), q.double(), 1.0
    for rank, token in enumerate(candidates):
        a = accept_probability(p_now, q_now, token, rule, rank < deterministic)
        law[token] += left * a
        left *= 1 - a
        p_now, q_now = after_rejection(p_now, q_now, token, rule, rank < deterministic)
    return law + left * p_now / p_now.sum()


def exact_tree_step_law(
    p_n: torch.Tensor,  # [N, V]: each worker's target at the node
    weights: torch.Tensor,  # [N]
    q: torch.Tensor,  # [V]: q̂ at the node
    candidates: list[int],  # the children's tokens, in draft order
    rule: ChildRule,
    deterministic: int = 0,  # the first ones are lookup children
) -> torch.Tensor:  # [V] float64
    """Closed-form law of the token emitted at a node under ``exact``'s payload, composed from
    the walk's functions: each candidate's acceptance, then the recovered draw over the
    extended support, whose worker entries emit y_n ~ p_n(· | x ∉ S_v)."""
    w = normalise_weights(weights)
    q_ids = (q > 0).nonzero()[:, 0]
    support = torch.unique(torch.cat([q_ids, torch.tensor(candidates, dtype=torch.long)]))
    outside = torch.ones(q.shape[0], dtype=torch.bool)
    outside[support] = False
    row = SparseNode(
        support, p_n.double()[:, support], (p_n.double() * outside).sum(dim=-1), [0] * p_n.shape[0]
    )
    p_now, q_now = extended_node(row, q_ids, q.double()[q_ids], w)
    local = torch.searchsorted(support, torch.tensor(candidates, dtype=torch.long)).tolist()
    law, left = torch.zeros(q.shape[0], dtype=torch.float64), 1.0
    for rank, (token, index) in enumerate(zip(candidates, local)):
        a = accept_probability(p_now, q_now, index, rule, rank < deterministic)
        law[token] += left * a
        left *= 1 - a
        p_now, q_now = after_rejection(p_now, q_now, index, rule, rank < deterministic)
    recovered = p_now / p_now.sum()
    law[support] += left * recovered[: support.shape[0]]
    for n in range(p_n.shape[0]):
        if row.complement[n] > 0:
            law += left * recovered[support.shape[0] + n] * p_n[n].double() * outside / row.complement[n]
    return law
