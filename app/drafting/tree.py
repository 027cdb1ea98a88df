"""A tree draft (docs/design.md §3.6): one batched draft decode per depth; children the top-k of q̂ (then
EAGLE-2's rerank) or draws from it, keyed by position and lane, so lane 0 of a one-wide tree draws the chain's
numbers."""

from __future__ import annotations

import math

import torch

from app.drafting.batcher import DraftSteps, StepBatcher
from app.drafting.forced import forced_below
from app.drafting.lookup import Branch, Plan, Record, merged, with_branch
from app.drafting.request import DraftNodes, DraftRequest, delta_support
from core.math.random import Purpose, sample_index, uniform
from core.math.rerank import best_nodes
from core.math.shapes import ChildRule, TreeShape
from core.math.tree import NO_ROW, TokenTree, pad_rows
from core.runners.base import ForwardItem


def tree_steps(
    batcher: StepBatcher,
    request: DraftRequest,
    shape: TreeShape,
    depth_limit: int = 0,
    left: list[int] | None = None,
    per_path: bool = False,
    branch: Branch | None = None,
    plan: Plan | None = None,
    record: Record | None = None,
) -> DraftSteps:
    """The tree's drafting. With ``left`` = [n > 0] (a grammar's free nodes still to place), a node that
    gets children first gets its forced run (``forced_below``), fed with it in the depth's decode.
    ``branch``: a lookup proposal (with a sampled tree's ``plan``); the nodes go into ``record``."""
    runner, session_id, sequence = batcher.runner, request.session_id, request.sequence
    eos = set(runner.info.eos_ids)
    logits = yield from batcher.catch_up(session_id, sequence)
    start = len(sequence)
    nodes = DraftNodes(q_at={-1: request.q(logits[None], [[]])[0]})
    row_of = {-1: start - 1}  # node -> its row in the draft session
    # drawn after the lookup's child: from q̂ without it
    excluded = {-1: branch.tokens[0]} if plan is not None and branch is not None and plan[0] else {}
    frontier = [-1]
    try:
        for depth in range(1, shape.max_depth + 1):
            fresh = [
                nodes.add(parent, token, score)
                for parent, token, score in children(frontier, nodes, shape, depth, start, request, excluded)
            ]
            frontier = [n for n in fresh if nodes.tokens[n] not in eos]
            if shape.rule is ChildRule.FIXED:  # EAGLE-2: expand the best top_k of this depth
                frontier = sorted(frontier, key=lambda n: (-nodes.scores[n], n))[: shape.top_k]
            if depth == shape.max_depth or not frontier:
                break
            runs = {
                n: forced_below(n, nodes, request.transformer, sequence, depth_limit, left, eos, per_path)
                for n in frontier
            }
            item = _depth_item(session_id, runner.length(session_id), frontier, runs, nodes, row_of)
            rows = yield item
            frontier = _expanded(frontier, runs, rows, nodes, request, eos, depth_limit)
            if not frontier:
                break
    finally:
        if runner.has_session(session_id):
            runner.crop(session_id, start)  # the session is the agreed sequence again
    return _built(nodes, shape, branch, plan, record)


def _depth_item(
    session_id: str,
    held: int,
    frontier: list[int],
    runs: dict[int, list[int]],
    nodes: DraftNodes,
    row_of: dict[int, int],
) -> ForwardItem:
    """One decode of a depth: each frontier node and its forced run, each row attending to its parent's."""
    feed: list[int] = []
    feed_parents: list[int] = []
    ends: list[int] = []
    for n in frontier:
        for k, node in enumerate([n, *runs[n]]):
            feed_parents.append(row_of[nodes.parents[node]] if k == 0 else held + len(feed) - 1)
            row_of[node] = held + len(feed)
            feed.append(nodes.tokens[node])
        ends.append(len(feed) - 1)
    return ForwardItem(session_id, held, feed, feed_parents, ends)


def _expanded(
    frontier: list[int],
    runs: dict[int, list[int]],
    rows: torch.Tensor,
    nodes: DraftNodes,
    request: DraftRequest,
    eos: set[int],
    depth_limit: int,
) -> list[int]:
    """q̂ after each frontier node's run (δ along the run), all rows together; the run ends that get children
    next."""
    lasts = [runs[n][-1] if runs[n] else n for n in frontier]
    for n in frontier:
        run = [n, *runs[n]]
        for above, below in zip(run, run[1:]):
            nodes.q_at[above] = delta_support(nodes.tokens[below])
    for last, q in zip(lasts, request.q(rows, [nodes.path(last) for last in lasts])):
        nodes.q_at[last] = q
    return [
        last
        for last in lasts
        if nodes.tokens[last] not in eos and (not nodes.free or nodes.depths[last] < depth_limit)
    ]


def _built(
    nodes: DraftNodes, shape: TreeShape, branch: Branch | None, plan: Plan | None, record: Record | None
) -> TokenTree:
    """The drafted nodes as the tree sent: a fixed tree reranked to its budget, a sampled one as drafted."""
    if shape.rule is ChildRule.FIXED:
        marks = merged(branch, nodes) if branch is not None else []
        tree, order = best_nodes(
            nodes.tokens, nodes.parents, nodes.scores, nodes.q_at, shape.nodes, nodes.free, marks
        )
        if record is not None and branch is not None:
            kept = {n: i for i, n in enumerate(order)}
            record.lookup = [(kept[n], key) for n, key in zip(marks, branch.keys) if n in kept]
        return tree
    if branch is None or plan is None:
        ids, probs = pad_rows(
            [nodes.q_at[-1], *(nodes.q_at.get(n, NO_ROW) for n in range(len(nodes.tokens)))]
        )
        return TokenTree(
            torch.tensor(nodes.tokens, dtype=torch.long),
            torch.tensor(nodes.parents, dtype=torch.long),
            ids,
            probs,
            shape.rule,
        )
    return with_branch(nodes, shape, branch, plan, record)


def children(
    frontier: list[int],
    nodes: DraftNodes,
    shape: TreeShape,
    depth: int,
    start: int,
    request: DraftRequest,
    excluded: dict[int, int] | None = None,
) -> list[tuple[int, int, float]]:
    """(parent, token, cumulative log q̂) of the children of every frontier node: the ``top_k`` most likely
    (fixed), or ``widths[depth − 1]`` draws keyed by position and lane (``nodes.lanes``); ``excluded``:
    parent -> its lookup child's token, which its draws leave out."""
    out: list[tuple[int, int, float]] = []
    for parent in frontier:
        ids, q = nodes.q_at[parent]  # q̂ on its support, ascending ids
        base = nodes.scores[parent] if parent >= 0 else 0.0
        position = start + (nodes.depths[parent] if parent >= 0 else 0)
        if shape.rule is ChildRule.FIXED:
            top = torch.topk(q, max(1, min(shape.top_k, int(torch.count_nonzero(q)))))
            out.extend(
                (parent, token, base + math.log(p))
                for token, p in zip(ids[top.indices].tolist(), top.values.tolist())
                if p > 0
            )
            continue
        # the row's entries still to draw from (a copy once one is taken out)
        left, alive = q, int(torch.count_nonzero(q))
        if excluded and parent in excluded:
            left = torch.where(ids == excluded[parent], 0.0, q)
            alive = int(torch.count_nonzero(left))
        for _ in range(shape.widths[depth - 1]):
            if alive == 0:
                break
            lane = nodes.lanes.get(position, 0)
            nodes.lanes[position] = lane + 1
            if request.params.is_greedy:
                index = int(torch.argmax(left))
            else:
                index = sample_index(
                    left, uniform(request.seed, request.choice, position, Purpose.DRAFT_SAMPLE, lane=lane)
                )
            out.append((parent, int(ids[index]), base + math.log(max(float(q[index]), 1e-45))))
            if shape.rule is ChildRule.SAMPLED_DISTINCT:
                left = left.clone() if left is q else left
                left[index] = 0
                alive -= 1
    return out
