"""The walk that verifies a token tree (DESIGN §3.6, ``core.math.tree``).

The target sends p at the root and at every node (``[n+1, V]``). The walk starts at the root
with p' = p(root) and tries its children in draft order with the rule that matches how they
were chosen — using another one is biased:

- ``sampled`` (i.i.d. from q̂ with replacement; SpecInfer, TSLT Algorithm 5): accept c if
  r < min(1, p'(c)/q̂(c)); else p' ← norm(max(0, p' − q̂)). Duplicates are tried again.
- ``sampled_distinct`` (without replacement, Gumbel-top-k; Sequoia): the same, and q̂ also
  loses the rejected token (renormalised).
- ``fixed`` (top-k, EAGLE-2's cumulative score): accept c with probability p'(c); else
  p'(c) ← 0, renormalised. A duplicate sibling has p'(c) = 0 by then: never accepted.

Deterministic children (lookup candidates, DESIGN §3.10: drawn from δ_c) come first among their
siblings (``TokenTree.deterministic``) and are tested by the fixed rule whatever the tree's; a
rejected one also leaves q̂ (renormalised), since the sampled siblings after it were drawn from q̂
without the deterministic ones: each candidate is tested with the law it was drawn from given
the candidates before it, which is what keeps a mixed sibling set exact.

An accepted child becomes the node (p' = p there); at a node whose children are all rejected
the walk ends with the recovered token drawn from p', at a leaf with the bonus token from p.
Each candidate draws from its own lane (its rank among its siblings): ``accept_u[d, rank]`` at
walk depth d; the recovered / bonus draw at depth d is ``final_u[d]``. T = 0 follows argmax p.

``exact``'s sparse payload (DESIGN §3.5) walks the same way on an extended support per node:
the ids S_v the gateway sent (q̂'s support there, and the children), then one entry per worker
holding w_n c_n, its mass off S_v. Off S_v q̂ is 0 and no child lies there, so every rule leaves
that part of p' proportional to p: a draw that lands on worker n's entry emits its sample
y_n ~ p_n(· | x ∉ S_v). At a leaf the worker sent y_n ~ p_n (S_v empty), chosen with weight w_n.

"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.math.aggregation import normalise_weights
from core.math.random import accepts, sample_index
from core.math.speculative import acceptance_probs, argmax_lowest, residual
from core.math.shapes import ChildRule
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


# ----------------------------------------------------------------------------- one node


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
        kept = p.double().clone()
        kept[token] = 0.0
        total = kept.sum()
        p_next = kept / total if total > 0 else p.double()
        if rule is ChildRule.FIXED:
            return p_next, q
        q_next = q.double().clone()  # the drawn siblings after it came from q̂ without it
        q_next[token] = 0.0
        left = q_next.sum()
        return p_next, (q_next / left if left > 0 else q_next)
    p_next = residual(p, q)
    if rule is ChildRule.SAMPLED_DISTINCT:
        q_next = q.double().clone()
        q_next[token] = 0.0
        total = q_next.sum()
        q = q_next / total if total > 0 else q_next
    return p_next, q


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


# ----------------------------------------------------------------------------- the walk


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
        rank, p_left = try_children(p[node + 1], tree.q_row(node, vocab), candidates, tree.rule, accept_u[len(path)], tree.num_deterministic(node))
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


# ----------------------------------------------------------------------------- exact's sparse payload


@dataclass(frozen=True)
class SparseNode:
    """What the workers sent for one row of a tree under ``exact`` (the root, or a node)."""

    support: torch.Tensor  # [s] long, ascending: S_v (empty at a leaf)
    p: torch.Tensor  # [N, s]: p_n on S_v, per worker
    complement: torch.Tensor  # [N]: c_n = Σ_{x∉S_v} p_n(x)
    samples: list[int]  # [N]: y_n ~ p_n(· | x ∉ S_v); −1 where c_n = 0


def node_supports(tree: TokenTree) -> list[torch.Tensor]:
    """S_v per row (root, then each node): q̂'s support there and the children's tokens,
    ascending; empty at a leaf (its worker sample is then drawn from all of p_n)."""
    out = []
    for node in range(-1, len(tree)):
        children = tree.children(node)
        if not children:
            out.append(torch.zeros(0, dtype=torch.long))
            continue
        ids, _ = tree.support(node)
        out.append(torch.unique(torch.cat([ids, tree.tokens[children]])))
    return out


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
        rank, p_left = try_children(p, q, candidates, tree.rule, accept_u[len(path)], tree.num_deterministic(node))
        if rank is None:
            index = sample_index(p_left, u)
            size = row.support.shape[0]
            return TreeVerdict(path, int(row.support[index]) if index < size else row.samples[index - size], is_bonus=False)
        node = children[rank]
        path.append(node)
