"""A grammar's forced runs in a tree draft (docs/design.md §3.9): the draft carries a sole allowed token free,
its row q̂ a point mass like every T(p)."""

from __future__ import annotations

import math

import torch

from app.drafting.request import DraftNodes
from core.math.tree import TokenTree, depths_of, path_of
from core.transform import LogitsTransform


def forced_below(
    node: int,
    nodes: DraftNodes,
    transformer: LogitsTransform | None,
    sequence: list[int],
    depth_limit: int,
    left: list[int] | None,
    eos: set[int],
    per_path: bool = False,
) -> list[int]:
    """The grammar's forced run hung below ``node`` within ``left`` (``per_path``: each path's budget) and
    ``depth_limit``; the new nodes, top down."""
    if left is None or left[0] <= 0 or transformer is None or transformer.matcher is None:
        return []
    path = path_of(node, nodes.parents)
    used = sum(1 for v in path if v in nodes.free) if per_path else 0
    room = min(left[0] - used, depth_limit - nodes.depths[node])
    if room <= 0:
        return []
    added: list[int] = []
    for token in transformer.forced_run([*sequence, *(nodes.tokens[v] for v in path)], room, eos):
        above = added[-1] if added else node
        added.append(nodes.add(above, token, nodes.scores[above]))  # log 1
        nodes.free.add(added[-1])
    if not per_path:
        left[0] -= len(added)
    return added


def with_forced_runs(
    tree: TokenTree,
    transformer: LogitsTransform,
    sequence: list[int],
    depth_limit: int,
    extra: int,
    eos: set[int],
    per_path: bool = False,
) -> TokenTree:
    """``tree`` with the grammar's forced run after each leaf hung below it, best leaf first (``per_path``:
    ``extra`` per path less its point masses already; else for all the runs together)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    n = len(tokens)
    logq = [math.log(q) if q > 0 else -1e9 for q in tree.q_values().tolist()]
    score = [0.0] * n
    for v in range(n):
        score[v] = (score[parents[v]] if parents[v] >= 0 else 0.0) + logq[v]
    depth = depths_of(parents)
    inner = set(parents)
    leaves = sorted(
        (v for v in range(n) if v not in inner and tokens[v] not in eos), key=lambda v: (-score[v], v)
    )
    added: list[tuple[int, int]] = []  # (parent, token)
    for leaf in leaves:
        used = sum(1 for v in tree.path_to(leaf) if logq[v] == 0.0) if per_path else len(added)
        room = min(extra - used, depth_limit - depth[leaf])
        if room <= 0:
            continue
        parent = leaf
        for token in transformer.forced_run([*sequence, *(tokens[v] for v in tree.path_to(leaf))], room, eos):
            added.append((parent, token))
            parent = n + len(added) - 1
    if not added:
        return tree
    return _hung(tree, tokens, parents, added)


def _hung(tree: TokenTree, tokens: list[int], parents: list[int], added: list[tuple[int, int]]) -> TokenTree:
    """``tree`` with the nodes ``added`` (parent, token) after its own, each parent's row δ at its child."""
    width = tree.q_ids.shape[1]
    ids = torch.cat([tree.q_ids, torch.full((len(added), width), -1, dtype=tree.q_ids.dtype)])
    probs = torch.cat([tree.q_probs, torch.zeros(len(added), width, dtype=tree.q_probs.dtype)])
    for parent, token in added:  # the parent's row: δ at its forced child (a leaf had none)
        ids[parent + 1] = -1
        probs[parent + 1] = 0
        ids[parent + 1, 0], probs[parent + 1, 0] = token, 1.0
    flags = (
        None
        if tree.deterministic is None
        else torch.cat([tree.deterministic, torch.zeros(len(added), dtype=torch.bool)])
    )
    return TokenTree(
        torch.tensor([*tokens, *(t for _, t in added)], dtype=torch.long),
        torch.tensor([*parents, *(p for p, _ in added)], dtype=torch.long),
        ids,
        probs,
        tree.rule,
        flags,
    )
