"""SpecFed reconstruction and aggregation (docs/design.md §3.3), Theorems 2–3, and greedy certification."""

from __future__ import annotations

import pytest
import torch

from core.math.aggregation import (
    Reconstruction,
    aggregate,
    bias_bound,
    normalise_weights,
    reconstruct,
    tv_distance,
)
from core.math.compression import compress_top_k
from core.math.greedy import certify_argmax
from core.math.speculative import argmax_lowest, beta


def _dists(num: int, vocab: int, seed: int, sharpness: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(num, vocab, generator=g, dtype=torch.float64) * sharpness, dim=-1)


def test_renormalize_is_eq_5() -> None:
    top = compress_top_k(torch.tensor([[0.5, 0.3, 0.2]]), 2)
    p_hat = reconstruct(top.ids, top.probs, 3)
    assert torch.allclose(p_hat, torch.tensor([[0.625, 0.375, 0.0]], dtype=torch.float64))


def test_residual_is_eq_6() -> None:
    top = compress_top_k(torch.tensor([[0.5, 0.3, 0.1, 0.1]]), 2)
    p_hat = reconstruct(top.ids, top.probs, 4, Reconstruction.RESIDUAL, top.tail_mass)
    assert torch.allclose(p_hat, torch.tensor([[0.5, 0.3, 0.1, 0.1]], dtype=torch.float64), atol=1e-7)


def test_residual_under_a_grammar_fills_the_allowed_ids_only() -> None:
    """T(p) is zero on the ids a grammar masks: σ goes to the allowed ids outside the top-k, the
    bound TV(p̂, p) ≤ σ still holds, and a row whose allowed ids are all in the top-k renormalises."""
    p = torch.tensor([[0.5, 0.3, 0.0, 0.15, 0.05, 0.0], [0.6, 0.4, 0.0, 0.0, 0.0, 0.0]])
    allowed = torch.tensor([[True, True, False, True, True, False], [True, True, False, False, False, False]])
    top = compress_top_k(p, 2)
    p_hat = reconstruct(top.ids, top.probs, 6, Reconstruction.RESIDUAL, top.tail_mass, allowed)
    expected = torch.tensor(
        [[0.5, 0.3, 0.0, 0.1, 0.1, 0.0], [0.6, 0.4, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64
    )
    assert torch.allclose(p_hat, expected, atol=1e-7)
    assert (tv_distance(p_hat, p.double()) <= top.tail_mass.double() + 1e-7).all()
    # without it: masked ids filled
    assert reconstruct(top.ids, top.probs, 6, Reconstruction.RESIDUAL, top.tail_mass)[0, 2] > 0


def test_full_k_reconstructs_exactly() -> None:
    p = _dists(3, 50, 0)
    top = compress_top_k(p.float(), 50)
    for method in Reconstruction:
        assert torch.allclose(reconstruct(top.ids, top.probs, 50, method, top.tail_mass), p, atol=1e-6)


def test_aggregate_is_the_weighted_mixture() -> None:
    dists = _dists(3, 20, 1)[:, None, :]  # 3 workers, 1 position
    w = torch.tensor([0.7, 0.2, 0.1])
    assert torch.allclose(aggregate(dists, w)[0], 0.7 * dists[0, 0] + 0.2 * dists[1, 0] + 0.1 * dists[2, 0])
    assert torch.allclose(
        normalise_weights(torch.tensor([7.0, 3.0])), torch.tensor([0.7, 0.3], dtype=torch.float64)
    )
    with pytest.raises(ValueError):
        normalise_weights(torch.tensor([0.0, 0.0]))


@pytest.mark.parametrize("method", list(Reconstruction))
@pytest.mark.parametrize("k", [1, 4, 16])
def test_theorems_2_and_3_bound_bias_and_acceptance_change(method: Reconstruction, k: int) -> None:
    vocab, positions = 64, 8
    weights = torch.tensor([0.5, 0.3, 0.2])
    p_n = torch.stack([_dists(positions, vocab, seed) for seed in (10, 11, 12)])  # [N, m, V]
    q = _dists(positions, vocab, 13)
    tops = [compress_top_k(p.float(), k) for p in p_n]
    p_hat_n = torch.stack([reconstruct(t.ids, t.probs, vocab, method, t.tail_mass) for t in tops])
    p, p_hat = aggregate(p_n, weights), aggregate(p_hat_n, weights)
    e_n = torch.stack([tv_distance(a, b) for a, b in zip(p_hat_n, p_n)])  # [N, m]
    sigma = torch.stack([t.tail_mass for t in tops])
    bound = bias_bound(sigma, weights)
    tol = 1e-6  # fp32 probabilities on the wire
    if method is Reconstruction.RENORMALIZE:
        assert torch.allclose(e_n, sigma.double(), atol=tol)  # e_n = σ_n
    assert (e_n <= sigma + tol).all()
    bias = tv_distance(p_hat, p)
    assert (bias <= bias_bound(e_n, weights) + tol).all() and (bias <= bound + tol).all()  # Theorem 2
    assert ((beta(p_hat, q) - beta(p, q)).abs() <= bound + tol).all()  # Theorem 3


def test_mixture_argmax_differs_from_the_vote() -> None:
    # two of three workers prefer token 0 by a hair; the third is sure of token 1
    p_n = torch.tensor([[0.51, 0.49, 0.0], [0.51, 0.49, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    w = torch.ones(3)
    votes = [argmax_lowest(p[None])[0] for p in p_n]
    assert max(set(votes), key=votes.count) == 0
    assert argmax_lowest(aggregate(p_n[:, None, :], w))[0] == 1
    ids = [torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2]), torch.tensor([1, 0, 2])]
    probs = [p_n[0], p_n[1], torch.tensor([1.0, 0.0, 0.0])]
    assert certify_argmax(ids, probs, w, 3) == 1


def test_certification_from_top_k_bounds() -> None:
    vocab = 100
    p_n = _dists(3, vocab, 5, sharpness=4.0)
    w = torch.tensor([0.5, 0.3, 0.2])
    truth = argmax_lowest(aggregate(p_n[:, None, :], w))[0]
    answers = {}
    for k in (1, 2, 4, 8, 32, vocab):
        tops = [compress_top_k(p[None].float(), k) for p in p_n]
        answers[k] = certify_argmax([t.ids[0] for t in tops], [t.probs[0] for t in tops], w, vocab)
    assert all(a in (None, truth) for a in answers.values())  # never a wrong certificate
    assert answers[vocab] == truth


def test_an_uncertifiable_top_1_asks_for_more() -> None:
    # worker 0 sends token 0 at 0.4, worker 1 token 1 at 0.4: either could win with unseen mass
    ids = [torch.tensor([0]), torch.tensor([1])]
    probs = [torch.tensor([0.4]), torch.tensor([0.4])]
    assert certify_argmax(ids, probs, torch.ones(2), 10) is None


def _certify_dense(
    ids: list[torch.Tensor], probs: list[torch.Tensor], weights: torch.Tensor, vocab_size: int
) -> int | None:
    """The certificate computed over the whole vocabulary, as docs/design.md §3.5 states it."""
    w = weights.double() / weights.double().sum()
    seen = torch.zeros(len(ids), vocab_size, dtype=torch.bool)
    dense = torch.zeros(len(ids), vocab_size, dtype=torch.float64)
    for n, (i, p) in enumerate(zip(ids, probs)):
        seen[n, i] = True
        dense[n, i] = p.double()
    kth = torch.tensor(
        [float(p.min()) if p.numel() < vocab_size else 0.0 for p in probs], dtype=torch.float64
    )
    lower = (w[:, None] * dense).sum(0)
    upper = lower + (w[:, None] * kth[:, None] * ~seen).sum(0)
    best = int(torch.argmax(lower))
    if bool(seen.all()):
        return best
    upper[best] = float("-inf")
    return best if bool(lower[best] > upper.max()) else None


def test_the_certificate_over_the_sent_ids_is_the_one_over_the_vocabulary() -> None:
    """certify_argmax works on the union of the sent ids; the same answer as over all of V,
    ties and near-ties included (peaked and flat workers, k from 1 to V)."""
    g = torch.Generator().manual_seed(11)
    vocab = 40
    for trial in range(400):
        workers = 1 + trial % 3
        logits = torch.randn(workers, vocab, generator=g, dtype=torch.float64) * (0.3 + 4 * (trial % 5) / 4)
        p_n = torch.softmax(logits, dim=-1).float()
        if trial % 7 == 0:
            p_n[:, :2] = p_n[:, :2].mean()  # a tie at the top
        k = [1, 2, 4, 8, vocab][trial % 5]
        tops = [compress_top_k(p[None], k) for p in p_n]
        ids, probs = [t.ids[0] for t in tops], [t.probs[0] for t in tops]
        w = torch.rand(workers, generator=g, dtype=torch.float64) + 0.1
        assert certify_argmax(ids, probs, w, vocab) == _certify_dense(ids, probs, w, vocab), trial
