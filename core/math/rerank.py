"""EAGLE-2's rerank (docs/design.md §3.6): the budget's best nodes by cumulative draft logprob; a node never
outscores its parent, so they form a tree."""

from __future__ import annotations

from collections.abc import Collection

import torch

from core.math.shapes import ChildRule
from core.math.tree import NO_ROW, SparseRow, TokenTree, depths_of, pad_rows


def drafted_above(node: int, parents: list[int], free: Collection[int]) -> int:
    """The nearest ancestor of ``node`` that was drafted (not in ``free``: a grammar's forced run); −1 for the
    root."""
    node = parents[node]
    while node >= 0 and node in free:
        node = parents[node]
    return node


def best_nodes(
    tokens: list[int],
    parents: list[int],
    scores: list[float],
    q_at: dict[int, SparseRow],
    budget: int,
    free: Collection[int] = (),
    marks: Collection[int] = (),
) -> tuple[TokenTree, list[int]]:  # the tree, and which node each of its nodes was
    """The ``budget`` nodes of best cumulative score, by depth, siblings best first (``marks``, the lookup's
    children, first of all); the ``free`` nodes (forced runs) are not counted: one stays when the drafted node
    above it stays."""
    kept_set = set(
        sorted((n for n in range(len(tokens)) if n not in free), key=lambda n: (-scores[n], n))[:budget]
    )
    for n in range(len(tokens)):  # parents come first
        if n in free and drafted_above(n, parents, free) in kept_set | {-1}:
            kept_set.add(n)
        elif n in kept_set and parents[n] >= 0 and parents[n] not in kept_set:
            # below a run that went (a lookup's child)
            kept_set.discard(n)
    depth = depths_of(parents)
    marked = set(marks)
    order = sorted(kept_set, key=lambda n: (depth[n], n not in marked, -scores[n], n))
    index = {-1: -1, **{n: i for i, n in enumerate(order)}}
    ids, probs = pad_rows([q_at[-1], *(q_at.get(n, NO_ROW) for n in order)])
    flags = torch.tensor([n in marked for n in order], dtype=torch.bool) if marked else None
    tree = TokenTree(
        torch.tensor([tokens[n] for n in order], dtype=torch.long),
        torch.tensor([index[parents[n]] for n in order], dtype=torch.long),
        ids,
        probs,
        ChildRule.FIXED,
        flags,
    )
    return tree, order
