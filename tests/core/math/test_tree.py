"""Token trees (docs/design.md §3.6): the closed-form law of one node under each child rule equals p to
1e-9 (every child draw, accept/reject and residual enumerated on V = 5, duplicates included); a
chain as a tree verifies to the chain verifier's very numbers; a seeded chi-square of the first
two tokens through the walk with its lanes; and the negative controls: Algorithm 5 on fixed
children, and the with-replacement rule on children drawn without replacement."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from scipy import stats

from core.math.random import Purpose, sample_index, uniform, uniforms
from core.math.sampling import truncate
from core.math.shapes import ChildRule
from core.math.speculative import verify_greedy
from core.math.tree import TokenTree, sparse_rows
from core.math.walk import verify_tree, verify_tree_greedy
from tests.oracles import tree_step_law, verify_sampled

V = 5
SIGNIFICANCE = 1e-3
# Algorithm 5 on fixed children: p below double precision at 5,000
SAMPLES = 10_000 if os.environ.get("SPECGATE_FULL_STATISTICS") else 5_000


def _dist(seed: int, sharpness: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * sharpness, dim=-1)


P, Q = _dist(1), _dist(2)
Q_CASES = {"full q": Q, "q top-3": truncate(Q, 3), "q one-hot": truncate(Q, 1), "q = p": P.clone()}


def _with_replacement(q: torch.Tensor, k: int) -> list[tuple[list[int], float]]:
    return [
        (list(c), float(torch.prod(q[list(c)])))
        for c in itertools.product(range(V), repeat=k)
        if float(torch.prod(q[list(c)])) > 0
    ]


def _without_replacement(q: torch.Tensor, k: int) -> list[tuple[list[int], float]]:
    out = []
    for c in itertools.permutations(range(V), k):
        weight, left = 1.0, 1.0
        for token in c:
            if not left > 0:
                break
            weight *= float(q[token]) / left
            left -= float(q[token])
        if weight > 0:
            out.append((list(c), weight))
    return out


def _expected_law(q: torch.Tensor, k: int, draws: str, rule: ChildRule) -> torch.Tensor:
    children = _with_replacement(q, k) if draws == "with" else _without_replacement(q, k)
    total = sum(w for _, w in children)
    return sum(w * tree_step_law(P, q, c, rule) for c, w in children) / total  # type: ignore[return-value]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("q_case", Q_CASES)
def test_sampled_children_with_replacement_give_p(k: int, q_case: str) -> None:
    assert torch.allclose(_expected_law(Q_CASES[q_case], k, "with", ChildRule.SAMPLED), P, atol=1e-9, rtol=0)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("q_case", ["full q", "q top-3", "q = p"])
def test_sampled_children_without_replacement_give_p(k: int, q_case: str) -> None:
    q = Q_CASES[q_case]
    if k > int((q > 0).sum()):
        pytest.skip("fewer tokens in the support than children")
    assert torch.allclose(_expected_law(q, k, "without", ChildRule.SAMPLED_DISTINCT), P, atol=1e-9, rtol=0)


@pytest.mark.parametrize("children", [[0], [3, 1], [4, 0, 2], [2, 2, 1], list(range(V))])
def test_fixed_children_give_p_whatever_they_are(children: list[int]) -> None:
    """Duplicates included: the second copy has p' = 0 by then."""
    assert torch.allclose(tree_step_law(P, Q, children, ChildRule.FIXED), P, atol=1e-9, rtol=0)


def test_negative_control_algorithm_5_on_fixed_children_is_biased() -> None:
    """docs/design.md §3.6's example: p = q = (½, ½), children {a, b}: a is always accepted."""
    half = torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert torch.allclose(
        tree_step_law(half, half, [0, 1], ChildRule.SAMPLED), torch.tensor([1.0, 0.0], dtype=torch.float64)
    )
    top2 = torch.topk(Q, 2).indices.tolist()
    assert float((tree_step_law(P, Q, top2, ChildRule.SAMPLED) - P).abs().max()) > 1e-3
    assert torch.allclose(tree_step_law(P, Q, top2, ChildRule.FIXED), P, atol=1e-9, rtol=0)


def test_negative_control_the_with_replacement_rule_on_distinct_draws_is_biased() -> None:
    law = _expected_law(Q, 2, "without", ChildRule.SAMPLED)
    assert float((law - P).abs().max()) > 1e-3


# ----------------------------------------------------------------------------- a chain is a tree


def test_a_chain_tree_verifies_to_the_chain_verifiers_numbers() -> None:
    """Same uniforms (lane 0), bit for bit: count, token, bonus or not, over many seeds."""
    g = torch.Generator().manual_seed(5)
    for seed in range(300):
        gamma = seed % 5
        p = torch.softmax(torch.randn(gamma + 1, V, generator=g, dtype=torch.float64) * 2, dim=-1)
        q = torch.softmax(torch.randn(gamma, V, generator=g, dtype=torch.float64) * 2, dim=-1)
        if seed % 2:
            q = truncate(q, 3)
        draft = [sample_index(q[j], uniform(seed, 0, j, Purpose.DRAFT_SAMPLE)) for j in range(gamma)]
        accept_u = uniforms(seed, 0, list(range(gamma)), Purpose.ACCEPT)
        final_u = torch.cat(
            [
                uniforms(seed, 0, list(range(gamma)), Purpose.RESIDUAL),
                uniforms(seed, 0, [gamma], Purpose.BONUS),
            ]
        )
        chain = verify_sampled(p, q, draft, accept_u, final_u)
        tree = TokenTree.chain(draft, q)
        verdict = verify_tree(p, tree, accept_u[:, None], final_u)
        assert (verdict.num_accepted, verdict.token, verdict.is_bonus) == (
            chain.num_accepted,
            chain.token,
            chain.is_bonus,
        )
        assert verdict.output(tree) == chain.output(draft) and verdict.path == list(range(chain.num_accepted))
        greedy = verify_greedy(p, draft)
        tree_greedy = verify_tree_greedy(p, tree)
        assert (tree_greedy.num_accepted, tree_greedy.token, tree_greedy.is_bonus) == (
            greedy.num_accepted,
            greedy.token,
            greedy.is_bonus,
        )


def test_tree_shape() -> None:
    #        root
    #       /    \
    #      0      1
    #     / \      \
    #    2   3      4
    ids, probs = sparse_rows([Q] * 6)
    tree = TokenTree(torch.tensor([1, 2, 3, 4, 0]), torch.tensor([-1, -1, 0, 0, 1]), ids, probs)
    assert tree.depths().tolist() == [1, 1, 2, 2, 2]
    assert tree.children(-1) == [0, 1] and tree.children(0) == [2, 3] and tree.children(4) == []
    assert tree.path_to(3) == [0, 3] and tree.max_width() == 2
    mask = ancestor_mask(tree)
    assert mask[3].tolist() == [True, False, False, True, False] and mask[4].tolist() == [
        False,
        True,
        False,
        False,
        True,
    ]
    assert torch.allclose(tree.q_row(2, V), Q.double())
    with pytest.raises(ValueError, match="parent"):
        TokenTree(torch.tensor([1, 2]), torch.tensor([1, -1]), ids[:3], probs[:3])
    with pytest.raises(ValueError, match="n\\+1"):
        TokenTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), ids, probs)


def test_greedy_follows_the_argmax_through_the_tree() -> None:
    p = torch.tensor(
        [[0.1, 0.6, 0.3], [0.2, 0.2, 0.6], [0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64
    )
    ids, probs = sparse_rows([torch.full((3,), 1 / 3)] * 4)
    tree = TokenTree(torch.tensor([0, 1, 2]), torch.tensor([-1, -1, 1]), ids, probs, ChildRule.FIXED)
    verdict = verify_tree_greedy(p, tree)  # argmax 1 at the root: node 1; argmax 0 there, node 2 is token 2
    assert verdict.path == [1] and verdict.token == 0 and not verdict.is_bonus


# ----------------------------------------------------------------------------- the walk, statistically


TARGETS = [_dist(100 + t) for t in range(V + 1)]  # p after token t (V: after the prompt)
DRAFTS = [_dist(200 + t) for t in range(V + 1)]


def _target(parent_token: int | None) -> torch.Tensor:
    return TARGETS[V if parent_token is None else parent_token]


def _draft(parent_token: int | None) -> torch.Tensor:
    return DRAFTS[V if parent_token is None else parent_token]


def _children(q: torch.Tensor, k: int, rule: ChildRule, seed: int, position: int) -> list[int]:
    if rule is ChildRule.FIXED:
        return torch.topk(q, k).indices.tolist()
    out, left = [], q.clone()
    for lane in range(k):
        token = sample_index(
            left if rule is ChildRule.SAMPLED_DISTINCT else q,
            uniform(seed, 0, position, Purpose.DRAFT_SAMPLE, lane=lane),
        )
        out.append(token)
        if rule is ChildRule.SAMPLED_DISTINCT:
            left[token] = 0.0
    return out


def _walk_first_two(
    seed: int, chosen: ChildRule, widths: tuple[int, int], verified: ChildRule | None = None
) -> tuple[int, int]:
    """A depth-2 tree with widths[0] children at the root and widths[1] under each, chosen by
    ``chosen`` and verified by ``verified`` (the same unless a test breaks it); its first two
    emitted tokens (a second round after a one-token answer)."""
    tokens, parents, rows = [], [], [_draft(None)]
    for child in _children(_draft(None), widths[0], chosen, seed, 0):
        tokens.append(child)
        parents.append(-1)
        rows.append(_draft(child))
    for parent in range(len(tokens)):
        for child in _children(_draft(tokens[parent]), widths[1], chosen, seed, 1 + parent):
            tokens.append(child)
            parents.append(parent)
            rows.append(torch.zeros(V, dtype=torch.float64))
    ids, probs = sparse_rows(rows)
    tree = TokenTree(torch.tensor(tokens), torch.tensor(parents), ids, probs, verified or chosen)
    p = torch.stack([_target(None)] + [_target(t) for t in tokens])
    width = tree.max_width()
    accept_u = torch.stack(
        [torch.tensor([uniform(seed, 0, d, Purpose.ACCEPT, lane=r) for r in range(width)]) for d in range(2)]
    )
    final_u = uniforms(seed, 0, [0, 1, 2], Purpose.RESIDUAL)
    out = verify_tree(p, tree, accept_u, final_u).output(tree)
    if len(out) == 1:
        out.append(sample_index(_target(out[0]), uniform(seed, 0, 1, Purpose.BONUS)))
    return out[0], out[1]


def _pvalue(chosen: ChildRule, widths: tuple[int, int], verified: ChildRule | None = None) -> float:
    counts = torch.zeros(V, V)
    for seed in range(SAMPLES):
        a, b = _walk_first_two(seed, chosen, widths, verified)
        counts[a, b] += 1
    joint = torch.stack([_target(None)[a] * _target(a) for a in range(V)])
    return float(stats.chisquare(counts.flatten().numpy(), (joint.flatten() * SAMPLES).numpy()).pvalue)


@pytest.mark.parametrize(
    "rule, widths",
    [(ChildRule.SAMPLED, (3, 2)), (ChildRule.SAMPLED_DISTINCT, (3, 2)), (ChildRule.FIXED, (2, 2))],
)
def test_the_walk_emits_the_target_chi_square(rule: ChildRule, widths: tuple[int, int]) -> None:
    assert _pvalue(rule, widths) > SIGNIFICANCE


def test_negative_control_the_walk_with_algorithm_5_on_fixed_children_is_rejected() -> None:
    """Fixed top-2 children verified as if they were sampled (TSLT's Algorithm 5): rejected."""
    assert _pvalue(ChildRule.FIXED, (2, 2), verified=ChildRule.SAMPLED) < SIGNIFICANCE


def test_q_values_are_q_of_each_node_in_chains_and_trees() -> None:
    """q̂(x) of every node's token under its parent's q̂, in one pass: full rows, sparse rows
    with pads, and a token outside its parent's support (0)."""
    generator = torch.Generator().manual_seed(4)
    full = [torch.softmax(torch.randn(50, generator=generator), -1) for _ in range(3)]
    chain = TokenTree.chain([4, 9, 17], full)
    assert chain.q_values().tolist() == [float(full[j][t]) for j, t in enumerate([4, 9, 17])]
    sparse = [truncate(row, 5) for row in full]
    outside = int((sparse[1] == 0).nonzero()[0, 0])
    tree = TokenTree.chain([int(sparse[0].argmax()), outside, int(sparse[2].argmax())], sparse)
    assert tree.q_values().tolist() == [float(sparse[0].max()), 0.0, float(sparse[2].max())]
    ids, probs = sparse_rows([sparse[0], sparse[1], sparse[2]])
    branched = TokenTree(
        torch.tensor([3, 7, 8]),
        torch.tensor([-1, -1, 0]),
        torch.cat([ids, torch.full((1, ids.shape[1]), -1)]),
        torch.cat([probs, torch.zeros(1, probs.shape[1], dtype=probs.dtype)]),
    )
    expected = [float(sparse[0][3]), float(sparse[0][7]), float(sparse[1][8])]
    assert branched.q_values().tolist() == expected == [q_of(branched, n) for n in range(3)]


def ancestor_mask(tree: TokenTree) -> torch.Tensor:
    # [n, n] bool: node i attends to node j (j an ancestor of i, or i itself)
    mask = torch.eye(len(tree), dtype=torch.bool)
    for i, parent in enumerate(tree.parents.tolist()):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def q_of(tree: TokenTree, node: int) -> float:
    """q̂(x) of ``node``'s token x under its parent's q̂, one row at a time: what ``q_values`` computes at
    once."""
    row = int(tree.parents[node]) + 1
    hits = (tree.q_ids[row] == tree.tokens[node]).nonzero()
    return float(tree.q_probs[row, hits[0, 0]]) if len(hits) else 0.0


def test_a_chain_of_sparse_rows_lays_out_as_one_of_dense_rows() -> None:
    rows = [truncate(torch.softmax(torch.randn(40), -1), k) for k in (3, 7)]
    dense = TokenTree.chain([1, 2], rows)
    supports = TokenTree.chain([1, 2], [((row > 0).nonzero()[:, 0], row[row > 0]) for row in rows])
    assert torch.equal(dense.q_ids, supports.q_ids) and torch.equal(dense.q_probs, supports.q_probs)
