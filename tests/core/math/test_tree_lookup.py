"""Sibling sets that mix lookup (deterministic) children with drawn ones (docs/design.md §3.10).

A lookup child is drawn from δ_c: tested by the fixed rule (accept with p'(c), else zero it),
first among its siblings; the drawn siblings after it come from q̂ without the deterministic
tokens, and the walk's q̂' loses each rejected one. Closed forms (1e-9) under every child rule,
with duplicates, on exact's payload with weighted workers; a chi-square of the walk on a tree
with lookup branches (20,000 seeded samples) and the broken variant — the lookup child tested
as if drawn from q̂, min(1, p'/q̂) — that the same test rejects.
"""

from __future__ import annotations

import os

import pytest
import torch
from scipy import stats

from core.math.aggregation import normalise_weights
from core.math.random import Purpose, sample_index, uniform, uniforms
from core.math.sampling import truncate
from core.math.shapes import ChildRule
from core.math.tree import TokenTree, sparse_rows
from core.math.walk import verify_tree
from tests.core.math.test_tree_exact import _draws as exact_draws
from tests.oracles import exact_tree_step_law, tree_step_law

V = 5
SIGNIFICANCE = 1e-3
_FULL = bool(os.environ.get("SPECGATE_FULL_STATISTICS"))
SAMPLES = 20_000 if _FULL else 5_000  # the control's p-value is 0.0 (below double precision) from 4,000 on
SWEEP = 20_000 if _FULL else 3_000  # the with-replacement rule


def _dist(seed: int, sharpness: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * sharpness, dim=-1)


P, Q = _dist(1), _dist(2)
Q_CASES = {"full q": Q, "q top-3": truncate(Q, 3), "q one-hot": truncate(Q, 1), "q = p": P.clone()}
TOP = torch.argsort(Q, descending=True).tolist()  # q̂'s tokens, most likely first
LOOKUPS = {  # the deterministic children, first among the siblings
    "q's top token": [TOP[0]],
    "a token off q̂'s top-3": [TOP[4]],
    "two lookups": [TOP[1], TOP[4]],
    "a duplicate lookup": [TOP[2], TOP[2]],
}
WORKERS = {
    "1 worker": (torch.stack([P]), torch.tensor([1.0])),
    "3 weighted workers": (torch.stack([P, _dist(3), _dist(4)]), torch.tensor([0.5, 0.3, 0.2])),
}


def _without(q: torch.Tensor, lookups: list[int]) -> torch.Tensor:
    """q̂ without the deterministic tokens, renormalised (zeros if nothing is left)."""
    left = q.clone()
    left[lookups] = 0.0
    total = left.sum()
    return left / total if total > 0 else left


def _draws(q: torch.Tensor, k: int, rule: ChildRule) -> list[tuple[list[int], float]]:
    """Every list of k drawn children with its probability (fixed: q̂'s top-k, duplicates of a
    lookup token included: the walk never accepts them); fewer without replacement where q̂
    without the lookups has fewer tokens, none where it has none."""
    if rule is not ChildRule.FIXED and not bool((q > 0).any()):
        return [([], 1.0)]
    return exact_draws(q, min(k, int((q > 0).sum())) if rule is ChildRule.SAMPLED_DISTINCT else k, rule)


def _mixed_law(q: torch.Tensor, lookups: list[int], k: int, rule: ChildRule, law) -> torch.Tensor:  # type: ignore[no-untyped-def]
    drawn_from = q if rule is ChildRule.FIXED else _without(q, lookups)
    draws = _draws(drawn_from, k, rule)
    total = sum(w for _, w in draws)
    return sum(w * law([*lookups, *c], len(lookups)) for c, w in draws) / total  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "rule, k",
    [(ChildRule.SAMPLED, 1), (ChildRule.SAMPLED, 2), (ChildRule.SAMPLED_DISTINCT, 2), (ChildRule.FIXED, 2)],
)
@pytest.mark.parametrize("lookups", LOOKUPS)
@pytest.mark.parametrize("q_case", Q_CASES)
def test_lookup_children_then_drawn_ones_give_p(q_case: str, lookups: str, rule: ChildRule, k: int) -> None:
    q = Q_CASES[q_case]
    law = _mixed_law(
        q, LOOKUPS[lookups], k, rule, lambda children, m: tree_step_law(P, q, children, rule, deterministic=m)
    )
    assert torch.allclose(law, P, atol=1e-9, rtol=0)


@pytest.mark.parametrize(
    "rule, k", [(ChildRule.SAMPLED, 2), (ChildRule.SAMPLED_DISTINCT, 2), (ChildRule.FIXED, 3)]
)
@pytest.mark.parametrize("lookups", LOOKUPS)
@pytest.mark.parametrize("q_case", ["full q", "q top-3"])
@pytest.mark.parametrize("workers", WORKERS)
def test_lookup_children_under_exacts_payload_give_the_mixture(
    workers: str, q_case: str, lookups: str, rule: ChildRule, k: int
) -> None:
    """S_v holds q̂'s support and every child, the lookups included; a worker's complement
    sample stands for what lies off it."""
    p_n, weights = WORKERS[workers]
    q = Q_CASES[q_case]
    law = _mixed_law(
        q,
        LOOKUPS[lookups],
        k,
        rule,
        lambda children, m: exact_tree_step_law(p_n, weights, q, children, rule, deterministic=m),
    )
    assert torch.allclose(law, normalise_weights(weights) @ p_n.double(), atol=1e-9, rtol=0)


def test_only_lookup_children_give_p() -> None:
    for lookups in ([0], [3, 1], [2, 2, 4], list(range(V))):
        for rule in ChildRule:
            assert torch.allclose(
                tree_step_law(P, Q, lookups, rule, deterministic=len(lookups)), P, atol=1e-9, rtol=0
            )


@pytest.mark.parametrize("rule", [ChildRule.SAMPLED, ChildRule.SAMPLED_DISTINCT])
def test_negative_controls_a_lookup_child_tested_as_drawn_or_siblings_drawn_with_it_are_biased(
    rule: ChildRule,
) -> None:
    lookups = LOOKUPS["a token off q̂'s top-3"]
    q = Q_CASES["q top-3"]
    as_drawn = _mixed_law(
        q, lookups, 2, rule, lambda children, m: tree_step_law(P, q, children, rule, deterministic=0)
    )
    assert float((as_drawn - P).abs().max()) > 1e-3  # min(1, p'/q̂) on a token q̂ never drew: never accepted
    lookups = LOOKUPS["q's top token"]
    q = Q
    # siblings drawn from all of q̂
    with_it = sum(
        w * tree_step_law(P, q, [*lookups, *c], rule, deterministic=1) for c, w in _draws(q, 2, rule)
    )
    assert float((with_it / sum(w for _, w in _draws(q, 2, rule)) - P).abs().max()) > 1e-3


def test_a_tree_lists_lookup_children_first() -> None:
    ids, probs = sparse_rows([Q] * 4)
    flags = torch.tensor([True, False, True])
    tree = TokenTree(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 0]), ids, probs, ChildRule.SAMPLED, flags)
    assert (
        tree.num_deterministic(-1) == 1 and tree.num_deterministic(0) == 1 and tree.num_deterministic(1) == 0
    )
    with pytest.raises(ValueError, match="deterministic children come before"):
        TokenTree(
            torch.tensor([1, 2, 3]),
            torch.tensor([-1, -1, 0]),
            ids,
            probs,
            ChildRule.SAMPLED,
            torch.tensor([False, True, False]),
        )
    chain = TokenTree(
        torch.tensor([1, 2, 3]),
        torch.tensor([-1, 0, 1]),
        ids,
        probs,
        ChildRule.SAMPLED,
        torch.tensor([True, True, False]),
    )
    assert (
        chain.head(2).num_deterministic(0) == 1
        and chain.tail(1).num_deterministic(-1) == 1
        and chain.tail(2).num_deterministic(-1) == 0
    )


# ----------------------------------------------------------------------------- the walk, statistically


TARGETS = [_dist(100 + t) for t in range(V + 1)]  # p after token t (V: after the prompt)
DRAFTS = [truncate(_dist(200 + t), 3) for t in range(V + 1)]  # q̂ there (top-3: lookups fall off it too)
# the lookup's run after the prompt (V) and after token 1: deterministic, a function of the context
LOOKUP_AFTER = {V: [4, 0], 1: [3]}


def _drawn(q: torch.Tensor, k: int, rule: ChildRule, seed: int, position: int, skip: list[int]) -> list[int]:
    left = _without(q, skip)
    out = []
    for lane in range(k):
        if not bool((left > 0).any()):
            break
        token = sample_index(left, uniform(seed, 0, position, Purpose.DRAFT_SAMPLE, lane=lane))
        out.append(token)
        if rule is ChildRule.SAMPLED_DISTINCT:
            left[token] = 0.0
            left = left / left.sum() if left.sum() > 0 else left
    return out


def _walk_first_two(seed: int, rule: ChildRule, honest: bool = True) -> tuple[int, int]:
    """A tree with a lookup branch at the root (a two-token run) and under drawn node 1, two
    drawn children at the root and two under each drawn node; the first two emitted tokens.
    ``honest`` = False tests the lookup children as if drawn from q̂: min(1, p'/q̂)."""
    tokens, parents, flags, rows = [], [], [], [DRAFTS[V]]
    run = LOOKUP_AFTER[V]
    tokens += run
    parents += [-1, 0]
    flags += [True, True]
    rows += [torch.zeros(V, dtype=torch.float64)] * 2  # a lookup node's row: no draft there
    rows[1] = torch.zeros(V, dtype=torch.float64)
    for child in _drawn(DRAFTS[V], 2, rule, seed, 0, run[:1]):
        tokens.append(child)
        parents.append(-1)
        flags.append(False)
        rows.append(DRAFTS[child])
    for parent in range(2, len(tokens)):
        below = LOOKUP_AFTER.get(tokens[parent], [])
        for child in below[:1]:
            tokens.append(child)
            parents.append(parent)
            flags.append(True)
            rows.append(torch.zeros(V, dtype=torch.float64))
        for child in _drawn(DRAFTS[tokens[parent]], 2, rule, seed, 1 + parent, below[:1]):
            tokens.append(child)
            parents.append(parent)
            flags.append(False)
            rows.append(torch.zeros(V, dtype=torch.float64))
    ids, probs = sparse_rows(rows)
    tree = TokenTree(
        torch.tensor(tokens), torch.tensor(parents), ids, probs, rule, torch.tensor(flags) if honest else None
    )
    p = torch.stack([TARGETS[V]] + [TARGETS[t] for t in tokens])
    width = tree.max_width()
    accept_u = torch.stack(
        [torch.tensor([uniform(seed, 0, d, Purpose.ACCEPT, lane=r) for r in range(width)]) for d in range(2)]
    )
    out = verify_tree(p, tree, accept_u, uniforms(seed, 0, [0, 1, 2], Purpose.RESIDUAL)).output(tree)
    if len(out) == 1:
        out.append(sample_index(TARGETS[out[0]], uniform(seed, 0, 1, Purpose.BONUS)))
    return out[0], out[1]


def _pvalue(rule: ChildRule, honest: bool = True, samples: int = SAMPLES) -> float:
    counts = torch.zeros(V, V)
    for seed in range(samples):
        a, b = _walk_first_two(seed, rule, honest)
        counts[a, b] += 1
    joint = torch.stack([TARGETS[V][a] * TARGETS[a] for a in range(V)])
    return float(stats.chisquare(counts.flatten().numpy(), (joint.flatten() * samples).numpy()).pvalue)


@pytest.mark.parametrize("rule, samples", [(ChildRule.SAMPLED_DISTINCT, SAMPLES), (ChildRule.SAMPLED, SWEEP)])
def test_the_walk_with_lookup_branches_emits_the_target_chi_square(rule: ChildRule, samples: int) -> None:
    assert _pvalue(rule, samples=samples) > SIGNIFICANCE


def test_negative_control_a_lookup_child_tested_with_min_1_p_over_q_hat_is_rejected() -> None:
    assert _pvalue(ChildRule.SAMPLED_DISTINCT, honest=False) < SIGNIFICANCE
