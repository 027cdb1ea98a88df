"""Speculative sampling (docs/design.md §3.1). Terms, fixed once:

    output tokens of a round = accepted draft tokens + one more token, which is
    the *recovered* token (resampled at the first rejection) or the *bonus* token
    (drawn from p_{γ+1} when all γ draft tokens are accepted).

``q`` is always the distribution the draft actually sampled from (after temperature and
truncation, q̂), and the same numbers feed the accept test and the residual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.math.random import accepts


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
    return diff / total if total > 0 else p.double() / p.double().sum()


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
    return first_rejection(acceptance_probs(p_draft, q_draft), accept_u)


def first_rejection(
    probs: torch.Tensor,  # [γ]: the probability of accepting x_j
    accept_u: torch.Tensor,  # [γ]: r_j ~ U[0, 1)
) -> int:  # the first j whose test fails (γ when none does)
    if len(probs) > len(accept_u):
        raise ValueError(f"{len(probs)} acceptance tests with {len(accept_u)} uniforms")
    return next(
        (j for j in range(len(probs)) if not accepts(float(accept_u[j]), float(probs[j]))), len(probs)
    )


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
