"""``exact``'s sparse payload on trees (docs/design.md §3.5, §3.6): the closed-form law of one node —
every child draw, accept/reject, and the recovered draw over S_v plus each worker's entry
(whose sample y_n follows p_n off S_v) enumerated on V = 5 — equals the mixture p to 1e-9 for
each child rule, with one and three weighted workers, truncated q̂ so that mass lies off S_v;
a seeded chi-square of the walk on sampled payloads; and the negative controls: Algorithm 5 on
fixed children, and a worker whose sample ignores S_v (y_n ~ p_n instead of p_n(· | x ∉ S_v))."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy import stats

from core.math.aggregation import normalise_weights
from core.math.random import Purpose, sample_index, uniform, uniforms
from core.math.sampling import truncate
from core.math.shapes import ChildRule
from core.math.tree import TokenTree, sparse_rows
from core.math.walk import SparseNode, node_supports, verify_tree_exact
from tests.core.math.test_tree import _children
from tests.oracles import exact_tree_step_law

V = 5
SIGNIFICANCE = 1e-3
SAMPLES = 4_000  # the engine-level test (tree strategy, exact payload) draws 20,000


def _dist(seed: int, sharpness: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * sharpness, dim=-1)


WORKERS = {
    "1 worker": (torch.stack([_dist(1)]), torch.tensor([1.0])),
    "3 weighted workers": (torch.stack([_dist(1), _dist(3), _dist(4)]), torch.tensor([0.5, 0.3, 0.2])),
}
Q = _dist(2)
Q_CASES = {"full q": Q, "q top-3": truncate(Q, 3), "q top-2": truncate(Q, 2)}


def _mixture(p_n: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return normalise_weights(weights) @ p_n.double()


def _draws(q: torch.Tensor, k: int, rule: ChildRule) -> list[tuple[list[int], float]]:
    """Every child list of ``rule`` with its probability (top-k for fixed children)."""
    if rule is ChildRule.FIXED:
        return [(torch.topk(q, k).indices.tolist(), 1.0)]
    if rule is ChildRule.SAMPLED:
        return [
            (list(c), float(torch.prod(q[list(c)])))
            for c in itertools.product(range(V), repeat=k)
            if float(torch.prod(q[list(c)])) > 0
        ]
    out = []
    for c in itertools.permutations(range(V), k):
        weight, left = 1.0, 1.0
        for token in c:
            weight *= float(q[token]) / left if left > 0 else 0.0
            left -= float(q[token])
        if weight > 0:
            out.append((list(c), weight))
    return out


def _law(p_n: torch.Tensor, weights: torch.Tensor, q: torch.Tensor, k: int, rule: ChildRule) -> torch.Tensor:
    draws = _draws(q, k, rule)
    total = sum(w for _, w in draws)
    return sum(w * exact_tree_step_law(p_n, weights, q, c, rule) for c, w in draws) / total  # type: ignore[return-value]


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("q_case", Q_CASES)
@pytest.mark.parametrize(
    "rule, k",
    [
        (ChildRule.SAMPLED, 1),
        (ChildRule.SAMPLED, 3),
        (ChildRule.SAMPLED_DISTINCT, 2),
        (ChildRule.FIXED, 2),
        (ChildRule.FIXED, 1),
    ],
)
def test_one_node_under_exacts_payload_gives_the_mixture(
    workers: str, q_case: str, rule: ChildRule, k: int
) -> None:
    p_n, weights = WORKERS[workers]
    q = Q_CASES[q_case]
    if rule is ChildRule.SAMPLED_DISTINCT and k > int((q > 0).sum()):
        pytest.skip("fewer tokens in the support than children")
    assert torch.allclose(_law(p_n, weights, q, k, rule), _mixture(p_n, weights), atol=1e-9, rtol=0)


def test_negative_control_algorithm_5_on_fixed_children_is_biased_here_too() -> None:
    p_n, weights = WORKERS["3 weighted workers"]
    top2 = torch.topk(Q, 2).indices.tolist()
    law = exact_tree_step_law(p_n, weights, Q_CASES["q top-3"], top2, ChildRule.SAMPLED)
    assert float((law - _mixture(p_n, weights)).abs().max()) > 1e-3


# ----------------------------------------------------------------------------- the walk, statistically


# [N, V] after token t (V: the prompt)
TARGETS = [torch.stack([_dist(100 + t), _dist(300 + t), _dist(500 + t)]) for t in range(V + 1)]
WEIGHTS = torch.tensor([0.5, 0.3, 0.2])
DRAFTS = [truncate(_dist(200 + t), 3) for t in range(V + 1)]


def _payload(p_n: torch.Tensor, support: torch.Tensor, seed: int, row: int, honest: bool) -> SparseNode:
    """What the workers send for one row; a dishonest worker samples y_n from all of p_n."""
    outside = torch.ones(V, dtype=torch.bool)
    outside[support] = False
    off = p_n * outside
    samples = []
    for n in range(p_n.shape[0]):
        u = uniform(seed, 0, row, Purpose.WORKER_COMPLEMENT, n)
        mass = float(off[n].sum())
        samples.append(sample_index(off[n] if honest else p_n[n], u) if mass > 0 else -1)
    return SparseNode(support, p_n[:, support], off.sum(dim=-1), samples)


def _walk_first(seed: int, rule: ChildRule, honest: bool = True) -> int:
    """The first emitted token of a depth-2 tree (2 children at the root, 2 under each)."""
    tokens, parents, rows = [], [], [DRAFTS[V]]
    for child in _children(DRAFTS[V], 2, rule, seed, 0):
        tokens.append(child)
        parents.append(-1)
        rows.append(DRAFTS[child])
    for parent in range(2):
        for child in _children(DRAFTS[tokens[parent]], 2, rule, seed, 1 + parent):
            tokens.append(child)
            parents.append(parent)
            rows.append(torch.zeros(V, dtype=torch.float64))
    ids, probs = sparse_rows(rows)
    tree = TokenTree(torch.tensor(tokens), torch.tensor(parents), ids, probs, rule)
    targets = [TARGETS[V]] + [TARGETS[t] for t in tokens]
    payload = [_payload(p, s, seed, r, honest) for r, (p, s) in enumerate(zip(targets, node_supports(tree)))]
    accept_u = torch.stack(
        [torch.tensor([uniform(seed, 0, d, Purpose.ACCEPT, lane=r) for r in range(2)]) for d in range(2)]
    )
    return verify_tree_exact(
        payload, tree, WEIGHTS, accept_u, uniforms(seed, 0, [0, 1, 2], Purpose.RESIDUAL)
    ).output(tree)[0]


def _pvalue(rule: ChildRule, honest: bool = True) -> float:
    counts = torch.zeros(V)
    for seed in range(SAMPLES):
        counts[_walk_first(seed, rule, honest)] += 1
    return float(stats.chisquare(counts.numpy(), (_mixture(TARGETS[V], WEIGHTS) * SAMPLES).numpy()).pvalue)


@pytest.mark.parametrize("rule", list(ChildRule))
def test_the_walk_on_the_sparse_payload_emits_the_mixture_chi_square(rule: ChildRule) -> None:
    assert _pvalue(rule) > SIGNIFICANCE


def test_negative_control_a_worker_sample_that_ignores_the_support_is_rejected() -> None:
    assert _pvalue(ChildRule.SAMPLED, honest=False) < SIGNIFICANCE


def test_node_supports_hold_q_and_the_children_and_leaves_are_empty() -> None:
    ids, probs = sparse_rows(
        [truncate(Q, 2), torch.zeros(V, dtype=torch.float64), torch.zeros(V, dtype=torch.float64)]
    )
    top = torch.topk(Q, 3).indices
    # a child outside q̂'s top-2
    tree = TokenTree(top[[0, 2]], torch.tensor([-1, -1]), ids, probs, ChildRule.FIXED)
    supports = node_supports(tree)
    assert (
        supports[0].tolist() == sorted(top.tolist()) and supports[1].numel() == 0 and supports[2].numel() == 0
    )
