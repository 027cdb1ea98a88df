"""Speculative sampling (DESIGN §3.1). Terms, fixed once:

    output tokens of a round = accepted draft tokens + one more token, which is
    the *recovered* token (resampled at the first rejection) or the *bonus* token
    (drawn from p_{γ+1} when all γ draft tokens are accepted).

``q`` is always the distribution the draft actually sampled from (after temperature and
truncation, q̂), and the same numbers feed the accept test and the residual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.math.random import accepts, sample_index


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one round's draft."""

    num_accepted: int  # draft tokens kept, 0..γ
    token: int  # the recovered token (num_accepted < γ) or the bonus token
    is_bonus: bool

    def output(self, draft: list[int]) -> list[int]:
        """The tokens this round emits: accepted draft tokens, then the recovered / bonus one."""
        return [*draft[: self.num_accepted], self.token]


def acceptance_probs(
    p_draft: torch.Tensor,  # [γ]: p_j(x_j)
    q_draft: torch.Tensor,  # [γ]: q̂_j(x_j) > 0 (x_j was sampled from q̂_j)
) -> torch.Tensor:  # [γ]: min(1, p_j(x_j) / q̂_j(x_j))
    return torch.clamp(p_draft.double() / q_draft.double(), max=1.0)


def residual(
    p: torch.Tensor,  # [V]
    q: torch.Tensor,  # [V]
) -> torch.Tensor:  # [V] float64, sums to 1
    """norm(max(0, p − q)); ``p`` itself when that has no mass (possible only with a reconstructed p̂)."""
    diff = torch.clamp(p.double() - q.double(), min=0.0)
    total = diff.sum()
    if total > 0:
        return diff / total
    return p.double() / p.double().sum()


def beta(
    p: torch.Tensor,  # [..., V]
    q: torch.Tensor,  # [..., V]
) -> torch.Tensor:  # [...]: β = Σ_x min(p(x), q(x)) = 1 − TV(p, q)
    return torch.minimum(p.double(), q.double()).sum(dim=-1)


def count_accepted(
    p_draft: torch.Tensor,  # [γ]: p_j(x_j)
    q_draft: torch.Tensor,  # [γ]: q̂_j(x_j)
    accept_u: torch.Tensor,  # [γ]: r_j ~ U[0, 1)
) -> int:
    """Draft tokens kept: x_j is accepted while r_j < min(1, p_j(x_j) / q̂_j(x_j))."""
    probs = acceptance_probs(p_draft, q_draft)
    for j in range(len(probs)):
        if not accepts(float(accept_u[j]), float(probs[j])):
            return j
    return len(probs)


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
        return Verdict(accepted, sample_index(residual(p[accepted], q[accepted]), float(final_u[accepted])), is_bonus=False)
    return Verdict(gamma, sample_index(p[gamma], float(final_u[gamma])), is_bonus=True)


def verify_greedy(
    p: torch.Tensor,  # [γ+1, V]
    draft: list[int],  # [γ]
) -> Verdict:
    """T = 0: accept while x_j = argmax p_j (ties to the lowest id), then emit argmax p_j."""
    targets = argmax_lowest(p)
    for j, x in enumerate(draft):
        if x != targets[j]:
            return Verdict(j, targets[j], is_bonus=False)
    return Verdict(len(draft), targets[len(draft)], is_bonus=True)


def argmax_lowest(
    p: torch.Tensor,  # [m, V]
) -> list[int]:  # [m]: argmax of each row, ties to the lowest id
    top = p.max(dim=-1, keepdim=True).values
    return [int(row.nonzero()[0]) for row in (p == top)]


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
