"""A tree draft (DESIGN §3.6): one batched draft decode per depth over the nodes that get
children; children the top-k of q̂ (fixed, then EAGLE-2's rerank to the node budget) or draws
from it (sampled, with or without replacement). The draws are keyed by position and lane (a
draw's rank at its position), so lane 0 of a one-wide tree draws the chain's numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from app.drafting.batcher import StepBatcher, Steps
from app.drafting.forced import forced_below
from app.drafting.lookup import Branch, Plan, Record, merged, with_branch
from app.drafting.request import DraftRequest, delta
from core.math.random import Purpose, sample_index, uniform
from core.math.rerank import best_nodes
from core.math.shapes import ChildRule, TreeShape
from core.math.tree import TokenTree, path_of, sparse_rows
from core.runners.base import ForwardItem


@dataclass
class _Nodes:
    """The nodes drafted so far, parents before children: token, parent, cumulative draft
    log-probability (the fixed rule's ranking), depth (forced runs included), q̂ at each
    expanded node (−1 = the root), the forced runs' nodes, and the draws taken per position."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    q_at: dict[int, torch.Tensor] = field(default_factory=dict)
    free: set[int] = field(default_factory=set)
    lanes: dict[int, int] = field(default_factory=dict)  # position -> draws taken there (a draw's key: position, lane)

    def add(self, parent: int, token: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.depths.append(self.depths[parent] + 1 if parent >= 0 else 1)
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """The tokens from the root's child down to ``node``."""
        return [self.tokens[v] for v in path_of(node, self.parents)]


def tree_steps(
    batcher: StepBatcher, request: DraftRequest, shape: TreeShape, depth_limit: int = 0, left: list[int] | None = None,
    per_path: bool = False, branch: Branch | None = None, plan: Plan | None = None, record: Record | None = None,
) -> Steps:
    """The tree's drafting. With ``left`` = [n > 0] (a grammar's free nodes still to place;
    what is not used is left there), a node that gets children first gets the run of tokens
    the grammar forces after it, no deeper than ``depth_limit``: the run is fed with the node
    in the depth's decode, and the node's children come after it (the run's rows are δ).
    ``branch``: a lookup proposal joined as deterministic children (``DraftModel.propose_tree``),
    with a sampled tree's ``plan``; what the tree's nodes were goes into ``record``."""
    runner, session_id, sequence = batcher.runner, request.session_id, request.sequence
    eos, vocab_size = set(runner.info.eos_ids), runner.info.vocab_size
    logits = yield from batcher.catch_up(session_id, sequence)
    start = len(sequence)
    nodes = _Nodes(q_at={-1: request.q(request.shaped(logits, []))})
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
            runs = {n: forced_below(n, nodes.tokens, nodes.parents, nodes.scores, nodes.depths, nodes.free, request.transformer, sequence, depth_limit, left, eos, per_path) for n in frontier}
            item = _depth_item(session_id, runner.length(session_id), frontier, runs, nodes, row_of)
            rows = yield item
            frontier = _expanded(frontier, runs, rows, nodes, request, eos, depth_limit, vocab_size)
            if not frontier:
                break
    finally:
        if runner.has_session(session_id):
            runner.crop(session_id, start)  # the session is the agreed sequence again
    return _built(nodes, shape, branch, plan, record, vocab_size)


def _depth_item(session_id: str, held: int, frontier: list[int], runs: dict[int, list[int]], nodes: _Nodes, row_of: dict[int, int]) -> ForwardItem:
    """One decode of a depth: each frontier node with its forced run after it, each fed row
    attending to its parent's row; the logits wanted at the end of each run."""
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
    frontier: list[int], runs: dict[int, list[int]], rows: torch.Tensor, nodes: _Nodes, request: DraftRequest, eos: set[int], depth_limit: int,
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


def _built(nodes: _Nodes, shape: TreeShape, branch: Branch | None, plan: Plan | None, record: Record | None, vocab_size: int) -> TokenTree:
    """The drafted nodes as the tree sent: a fixed tree reranked to its budget (the lookup's
    branch merged in), a sampled one as drafted (the lookup's branch displacing places)."""
    if shape.rule is ChildRule.FIXED:
        marks = merged(branch, nodes.tokens, nodes.parents, nodes.scores, nodes.depths) if branch is not None else []
        tree, order = best_nodes(nodes.tokens, nodes.parents, nodes.scores, nodes.q_at, shape.nodes, vocab_size, nodes.free, marks)
        if record is not None and branch is not None:
            kept = {n: i for i, n in enumerate(order)}
            record.lookup = [(kept[n], key) for n, key in zip(marks, branch.keys) if n in kept]
        return tree
    if branch is None or plan is None:
        empty = torch.zeros(vocab_size)
        ids, probs = sparse_rows([nodes.q_at[-1], *(nodes.q_at.get(n, empty) for n in range(len(nodes.tokens)))])
        return TokenTree(torch.tensor(nodes.tokens, dtype=torch.long), torch.tensor(nodes.parents, dtype=torch.long), ids, probs, shape.rule)
    return with_branch(nodes.tokens, nodes.parents, nodes.q_at, nodes.free, shape, branch, plan, record, vocab_size)


def children(
    frontier: list[int], nodes: _Nodes, shape: TreeShape, depth: int, start: int, request: DraftRequest, excluded: dict[int, int] | None = None,
) -> list[tuple[int, int, float]]:
    """(parent, token, cumulative log q̂) of the children of every frontier node, in order:
    the ``top_k`` most likely (fixed), or ``widths[depth − 1]`` draws (sampled; without
    replacement a drawn token leaves q̂ for its siblings). A draw is keyed by its position and
    its lane, the draws already taken at that position (``nodes.lanes``): without forced runs,
    every node of a depth has one position and its draws take lanes 0, 1, … in order.
    ``excluded``: parent -> the token of its deterministic (lookup) child, which its draws leave out."""
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
