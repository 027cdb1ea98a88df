"""The walk that verifies a token tree (docs/design.md §3.6): each node's children tried in draft order by the
rule of how they were chosen, one lane per candidate rank (``accept_u[d, rank]``, then ``final_u[d]``); lookup
children first, by the fixed rule (§3.10); ``exact``'s sparse payload on S_v plus one entry per worker
(§3.5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.math.aggregation import normalise_weights
from core.math.exact import SparseNode, draw_extended
from core.math.random import accepts, sample_index
from core.math.shapes import ChildRule
from core.math.speculative import acceptance_probs, argmax_lowest, residual
from core.math.tree import TokenTree


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # accepted nodes, root to leaf: the KV rows the worker keeps
    token: int  # the recovered token, or the bonus token after a leaf
    is_bonus: bool

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    def output(self, tree: TokenTree) -> list[int]:
        """The tokens the round emits: the accepted path's, then the recovered / bonus one."""
        return [int(tree.tokens[i]) for i in self.path] + [self.token]


def accept_probability(
    p: torch.Tensor,  # [V]: p' at the node, as the walk has it
    q: torch.Tensor,  # [V]: q̂' at the node
    token: int,
    rule: ChildRule,
    deterministic: bool = False,  # a lookup child (drawn from δ): the fixed rule whatever ``rule``
) -> float:
    """The probability of accepting the candidate ``token`` under ``rule``."""
    if rule is ChildRule.FIXED or deterministic:
        return float(p[token])
    if not q[token] > 0:
        return 0.0  # a sampled child has q̂ > 0; one without it (a malformed tree) is never accepted
    return float(acceptance_probs(p[token : token + 1], q[token : token + 1])[0])


def after_rejection(
    p: torch.Tensor,  # [V]
    q: torch.Tensor,  # [V]
    token: int,
    rule: ChildRule,
    deterministic: bool = False,  # a lookup child: p' and (sampled rules) q̂' lose it
) -> tuple[torch.Tensor, torch.Tensor]:  # p', q' after the candidate ``token`` was rejected
    if rule is ChildRule.FIXED or deterministic:
        p_next = _without(p, token, if_empty=p.double())
        # the drawn siblings after it came from q̂ without it
        return p_next, (q if rule is ChildRule.FIXED else _without(q, token))
    return residual(p, q), (_without(q, token) if rule is ChildRule.SAMPLED_DISTINCT else q)


def _without(
    dist: torch.Tensor,  # [V]
    token: int,
    if_empty: torch.Tensor | None = None,  # what to return when nothing is left; None: the zeros
) -> torch.Tensor:  # [V] float64: ``dist`` with ``token`` at 0, renormalised
    out = dist.double().clone()
    out[token] = 0.0
    total = out.sum()
    return out / total if total > 0 else out if if_empty is None else if_empty


def try_children(
    p: torch.Tensor,  # [V]: target at the node
    q: torch.Tensor,  # [V]: q̂ at the node
    candidates: list[int],  # the children's tokens, in draft order
    rule: ChildRule,
    accept_u: torch.Tensor,  # [≥ len(candidates)]: one draw per candidate lane
    deterministic: int = 0,  # the first ``deterministic`` candidates are lookup children (drawn from δ)
) -> tuple[int | None, torch.Tensor]:
    """The rank of the accepted candidate (None if all are rejected) and p' at that point."""
    p_now, q_now = p.double(), q.double()
    for rank, token in enumerate(candidates):
        fixed = rank < deterministic
        if accepts(float(accept_u[rank]), accept_probability(p_now, q_now, token, rule, fixed)):
            return rank, p_now
        p_now, q_now = after_rejection(p_now, q_now, token, rule, fixed)
    return None, p_now


def verify_tree(
    p: torch.Tensor,  # [n+1, V]: target at the root (row 0) and at each node (row i+1)
    tree: TokenTree,
    accept_u: torch.Tensor,  # [D, W]: r per walk depth and candidate lane (D = max depth, W = max width)
    final_u: torch.Tensor,  # [D+1]: the recovered / bonus draw per walk depth
) -> TreeVerdict:
    vocab = p.shape[-1]
    node, path = -1, list[int]()
    while True:
        children = tree.children(node)
        if not children:
            return TreeVerdict(path, sample_index(p[node + 1], float(final_u[len(path)])), is_bonus=True)
        candidates = [int(tree.tokens[c]) for c in children]
        rank, p_left = try_children(
            p[node + 1],
            tree.q_row(node, vocab),
            candidates,
            tree.rule,
            accept_u[len(path)],
            tree.num_deterministic(node),
        )
        if rank is None:
            return TreeVerdict(path, sample_index(p_left, float(final_u[len(path)])), is_bonus=False)
        node = children[rank]
        path.append(node)


def verify_tree_greedy(
    p: torch.Tensor,  # [n+1, V]
    tree: TokenTree,
) -> TreeVerdict:
    """T = 0: follow argmax p (ties to the lowest id) while it is a child; emit it where it is not."""
    targets = argmax_lowest(p)
    node, path = -1, list[int]()
    while True:
        target = targets[node + 1]
        children = tree.children(node)
        match = next((c for c in children if int(tree.tokens[c]) == target), None)
        if match is None:
            return TreeVerdict(path, target, is_bonus=not children)
        node = match
        path.append(node)


def node_supports(tree: TokenTree) -> list[torch.Tensor]:
    """S_v per row (root, then each node): q̂'s support there plus the children's tokens, ascending; empty at
    a leaf."""
    return [
        torch.unique(torch.cat([tree.support(node)[0], tree.tokens[tree.children(node)]]))
        if tree.children(node)
        else torch.zeros(0, dtype=torch.long)
        for node in range(-1, len(tree))
    ]


def extended_node(
    row: SparseNode,
    q_ids: torch.Tensor,  # [m]: q̂'s support at the node
    q_probs: torch.Tensor,  # [m]
    weights: torch.Tensor,  # [N], normalised
) -> tuple[torch.Tensor, torch.Tensor]:  # p, q on [S_v, one entry per worker]: [s + N] float64 each
    """p at the node on the extended support (Σ w_n p_n on S_v, then w_n c_n) and q̂ on it (0 off S_v)."""
    size, workers = row.support.shape[0], weights.shape[0]
    p = torch.cat([weights @ row.p.double(), weights * row.complement.double()])
    q = torch.zeros(size + workers, dtype=torch.float64)
    q[torch.searchsorted(row.support, q_ids)] = q_probs.double()
    return p, q


def verify_tree_exact(
    rows: list[SparseNode],  # [n+1]: the root's row, then each node's
    tree: TokenTree,
    weights: torch.Tensor,  # [N]
    accept_u: torch.Tensor,  # [D, W]
    final_u: torch.Tensor,  # [D+1]
) -> TreeVerdict:
    """The walk of ``verify_tree`` on the sparse payload: the same rule, the same draws."""
    w = normalise_weights(weights)
    node, path = -1, list[int]()
    while True:
        row, children = rows[node + 1], tree.children(node)
        u = float(final_u[len(path)])
        if not children:
            return TreeVerdict(path, row.samples[sample_index(w, u)], is_bonus=True)
        p, q = extended_node(row, *tree.support(node), w)
        candidates = [int(i) for i in torch.searchsorted(row.support, tree.tokens[children]).tolist()]
        rank, p_left = try_children(
            p, q, candidates, tree.rule, accept_u[len(path)], tree.num_deterministic(node)
        )
        if rank is None:
            return TreeVerdict(path, draw_extended(row.support, row.samples, p_left, u), is_bonus=False)
        node = children[rank]
        path.append(node)
