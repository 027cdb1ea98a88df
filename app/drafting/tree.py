"""A tree draft (DESIGN §3.6): one batched draft decode per depth; children the top-k of q̂ (then EAGLE-2's
rerank) or draws from it, keyed by position and lane, so lane 0 of a one-wide tree draws the chain's numbers."""

from __future__ import annotations

import math

import torch

from app.drafting.batcher import StepBatcher, Steps
from app.drafting.forced import forced_below
from app.drafting.lookup import Branch, Plan, Record, merged, with_branch
from app.drafting.request import DraftNodes, DraftRequest, delta
from core.math.random import Purpose, sample_index, uniform
from core.math.rerank import best_nodes
from core.math.shapes import ChildRule, TreeShape
from core.math.tree import TokenTree, sparse_rows
from core.runners.base import ForwardItem


def tree_steps(
    batcher: StepBatcher, request: DraftRequest, shape: TreeShape, depth_limit: int = 0, left: list[int] | None = None,
    per_path: bool = False, branch: Branch | None = None, plan: Plan | None = None, record: Record | None = None,
) -> Steps:
    """The tree's drafting. With ``left`` = [n > 0] (a grammar's free nodes still to place), a node that
    gets children first gets its forced run (``forced_below``), fed with it in the depth's decode.
    ``branch``: a lookup proposal (with a sampled tree's ``plan``); the nodes go into ``record``."""
    runner, session_id, sequence = batcher.runner, request.session_id, request.sequence
    eos, vocab_size = set(runner.info.eos_ids), runner.info.vocab_size
    logits = yield from batcher.catch_up(session_id, sequence)
    start = len(sequence)
    nodes = DraftNodes(q_at={-1: request.q(request.shaped(logits, []))})
    row_of = {-1: start - 1}  # node -> its row in the draft session
    excluded = {-1: branch.tokens[0]} if plan is not None and branch is not None and plan[0] else {}  # drawn after the lookup's child: from q̂ without it
    frontier = [-1]
    try:
        for depth in range(1, shape.max_depth + 1):
            fresh = [nodes.add(parent, token, score) for parent, token, score in children(frontier, nodes, shape, depth, start, request, excluded)]
            frontier = [n for n in fresh if nodes.tokens[n] not in eos]
            if shape.rule is ChildRule.FIXED:  # EAGLE-2: expand the best top_k of this depth
                frontier = sorted(frontier, key=lambda n: (-nodes.scores[n], n))[: shape.top_k]
            if depth == shape.max_depth or not frontier:
                break
            runs = {n: forced_below(n, nodes, request.transformer, sequence, depth_limit, left, eos, per_path) for n in frontier}
            item = _depth_item(session_id, runner.length(session_id), frontier, runs, nodes, row_of)
            rows = yield item
            frontier = _expanded(frontier, runs, rows, nodes, request, eos, depth_limit, vocab_size)
            if not frontier:
                break
    finally:
        if runner.has_session(session_id):
            runner.crop(session_id, start)  # the session is the agreed sequence again
    return _built(nodes, shape, branch, plan, record, vocab_size)


def _depth_item(session_id: str, held: int, frontier: list[int], runs: dict[int, list[int]], nodes: DraftNodes, row_of: dict[int, int]) -> ForwardItem:
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
    frontier: list[int], runs: dict[int, list[int]], rows: torch.Tensor, nodes: DraftNodes, request: DraftRequest, eos: set[int], depth_limit: int,
    vocab_size: int,
) -> list[int]:
    """q̂ after each frontier node's run (δ along the run); the run ends that get children next."""
    expand = []
    for n, node_logits in zip(frontier, rows):
        run = [n, *runs[n]]
        for above, below in zip(run, run[1:]):
            nodes.q_at[above] = delta(nodes.tokens[below], vocab_size)
        last = run[-1]
        nodes.q_at[last] = request.q(request.shaped(node_logits, nodes.path(last)))
        if nodes.tokens[last] not in eos and (not nodes.free or nodes.depths[last] < depth_limit):
            expand.append(last)
    return expand


def _built(nodes: DraftNodes, shape: TreeShape, branch: Branch | None, plan: Plan | None, record: Record | None, vocab_size: int) -> TokenTree:
    """The drafted nodes as the tree sent: a fixed tree reranked to its budget, a sampled one as drafted."""
    if shape.rule is ChildRule.FIXED:
        marks = merged(branch, nodes) if branch is not None else []
        tree, order = best_nodes(nodes.tokens, nodes.parents, nodes.scores, nodes.q_at, shape.nodes, vocab_size, nodes.free, marks)
        if record is not None and branch is not None:
            kept = {n: i for i, n in enumerate(order)}
            record.lookup = [(kept[n], key) for n, key in zip(marks, branch.keys) if n in kept]
        return tree
    if branch is None or plan is None:
        empty = torch.zeros(vocab_size)
        ids, probs = sparse_rows([nodes.q_at[-1], *(nodes.q_at.get(n, empty) for n in range(len(nodes.tokens)))])
        return TokenTree(torch.tensor(nodes.tokens, dtype=torch.long), torch.tensor(nodes.parents, dtype=torch.long), ids, probs, shape.rule)
    return with_branch(nodes, shape, branch, plan, record, vocab_size)


def children(
    frontier: list[int], nodes: DraftNodes, shape: TreeShape, depth: int, start: int, request: DraftRequest, excluded: dict[int, int] | None = None,
) -> list[tuple[int, int, float]]:
    """(parent, token, cumulative log q̂) of the children of every frontier node: the ``top_k`` most likely
    (fixed), or ``widths[depth − 1]`` draws keyed by position and lane (``nodes.lanes``); ``excluded``:
    parent -> its lookup child's token, which its draws leave out."""
    out: list[tuple[int, int, float]] = []
    for parent in frontier:
        q = nodes.q_at[parent]
        base = nodes.scores[parent] if parent >= 0 else 0.0
        position = start + (nodes.depths[parent] if parent >= 0 else 0)
        if shape.rule is ChildRule.FIXED:
            top = torch.topk(q, max(1, min(shape.top_k, int((q > 0).sum()))))
            out.extend((parent, int(t), base + math.log(float(p))) for t, p in zip(top.indices, top.values) if p > 0)
            continue
        left = q.clone()
        if excluded and parent in excluded:
            left[excluded[parent]] = 0
        for _ in range(shape.widths[depth - 1]):
            if not bool((left > 0).any()):
                break
            lane = nodes.lanes.get(position, 0)
            nodes.lanes[position] = lane + 1
            if request.params.is_greedy:
                token = int(torch.argmax(left))
            else:
                token = sample_index(left, uniform(request.seed, request.choice, position, Purpose.DRAFT_SAMPLE, lane=lane))
            out.append((parent, token, base + math.log(max(float(q[token]), 1e-45))))
            if shape.rule is ChildRule.SAMPLED_DISTINCT:
                left[token] = 0
                if not bool((left > 0).any()):
                    break
    return out
