"""Top-k compression: S, ρ and σ (DESIGN §2)."""

from __future__ import annotations

import pytest
import torch

from core.math.compression import compress_top_k


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
