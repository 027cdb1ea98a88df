"""Top-k compression: S, ρ and σ (docs/design.md §2)."""

from __future__ import annotations

import pytest
import torch

from core.math.compression import compress_top_k, top_k_entries


def test_top_k_ids_probs_and_tail() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]])
    top = compress_top_k(probs, 2)
    assert top.ids.tolist() == [[1, 3], [0, 1]]  # ties to the lowest id
    torch.testing.assert_close(top.probs, torch.tensor([[0.4, 0.3], [0.25, 0.25]]))
    torch.testing.assert_close(top.tail_mass, torch.tensor([0.3, 0.5]))


def test_full_k_has_no_tail() -> None:
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), -1)
    top = compress_top_k(probs, 50)
    assert torch.all(top.tail_mass == 0)
    torch.testing.assert_close(top.probs.sum(-1) + top.tail_mass, torch.ones(3))


def test_tail_is_summed_directly_not_one_minus_rho() -> None:
    probs = torch.zeros(1, 1000)
    probs[0, 0] = 1.0
    probs[0, 1:] = 1e-9
    top = compress_top_k(probs, 1)
    assert top.tail_mass.item() == pytest.approx(999e-9, rel=1e-3)


@pytest.mark.parametrize("k", [0, 5])
def test_k_out_of_range(k: int) -> None:
    with pytest.raises(ValueError):
        compress_top_k(torch.full((1, 4), 0.25), k)


def test_ties_at_the_threshold_go_to_the_lowest_ids() -> None:
    probs = torch.tensor([[0.1, 0.2, 0.1, 0.2, 0.1, 0.3]])
    top = compress_top_k(probs, 4)
    assert top.ids.tolist() == [[5, 1, 3, 0]]
    torch.testing.assert_close(top.tail_mass, torch.tensor([0.2]))


def test_matches_a_stable_full_sort_on_random_rows() -> None:
    generator = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(6, 5000, generator=generator) * 4, -1)
    probs[0, :100] = probs[0, 0]  # a block of ties
    for k in (1, 7, 32, 256):
        top = compress_top_k(probs, k)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        assert torch.equal(top.ids, order[:, :k])
        assert torch.equal(top.probs, sorted_probs[:, :k])


def test_top_k_entries_without_ties_equal_the_tie_breaking_rule() -> None:
    """The fast path (no tie at the threshold: topk's ids) and the rule (ties to the lowest ids)
    give the same mask and ids, row by row, with ties in some rows and not in others."""
    generator = torch.Generator().manual_seed(8)
    probs = torch.softmax(torch.randn(4, 2000, generator=generator) * 3, -1)
    probs[1, 10:30] = probs[1].max()  # a tied block in one row only
    for k in (1, 5, 20, 64):
        kept, ids = top_k_entries(probs, k)
        threshold = torch.sort(probs, dim=-1, descending=True).values[:, k - 1 : k]
        above, tied = probs > threshold, probs == threshold
        rule = above | (tied & (torch.cumsum(tied, dim=-1) <= k - above.sum(-1, keepdim=True)))
        assert torch.equal(kept, rule)
        assert torch.equal(ids, rule.nonzero()[:, 1].view(4, k))
        assert torch.equal(top_k_entries(probs[[0]], k)[1], ids[[0]])  # the no-tie path alone
