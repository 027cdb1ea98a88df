"""T(p) (docs/design.md §3.2) on hand-built logits."""

from __future__ import annotations

import math

import pytest
import torch

from core.math.random import sample_index, sample_rows
from core.math.sampling import (
    TOP_BLOCK,
    SamplingParams,
    apply_sampling,
    mask_top_k,
    mask_top_p,
    top_ids,
    truncate,
    truncated_support,
    truncated_supports,
)

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))


def test_temperature_one_is_softmax() -> None:
    torch.testing.assert_close(
        apply_sampling(LOGITS, SamplingParams()), torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    )


def test_greedy_is_untruncated_softmax() -> None:
    probs = apply_sampling(LOGITS, SamplingParams(temperature=0, top_k=1, top_p=0.1))
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.25, 0.125, 0.125]]))


def test_temperature_sharpens() -> None:
    probs = apply_sampling(LOGITS, SamplingParams(temperature=0.5))
    expected = torch.tensor([0.25, 0.0625, 0.015625, 0.015625])
    torch.testing.assert_close(probs[0], expected / expected.sum())


def test_top_k_keeps_k_and_renormalises() -> None:
    probs = apply_sampling(LOGITS, SamplingParams(top_k=2))
    torch.testing.assert_close(probs, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))


def test_top_k_keeps_ties_at_the_threshold() -> None:
    masked = mask_top_k(LOGITS, 3)
    assert torch.isfinite(masked).sum() == 4


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.5, 1), (0.51, 2), (0.75, 2), (0.76, 3), (1.0, 4)],
)
def test_top_p_keeps_the_smallest_nucleus(top_p: float, kept: int) -> None:
    masked = mask_top_p(LOGITS, top_p)
    assert int(torch.isfinite(masked).sum()) == kept


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-9])
def test_a_vanishing_top_p_keeps_the_most_likely_token(top_p: float) -> None:
    # found by schemathesis: 5e-324 rounds to 0 in fp32 and used to drop every token (NaN)
    probs = apply_sampling(LOGITS, SamplingParams(top_p=top_p))
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_temperatures_that_overflow_are_refused() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=1e-300)
    assert SamplingParams(temperature=0).is_greedy


def test_top_k_then_top_p() -> None:
    probs = apply_sampling(LOGITS, SamplingParams(top_k=3, top_p=0.6))
    # after top-k 3: (0.571, 0.286, 0.143); nucleus 0.6 keeps the first two
    torch.testing.assert_close(probs, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))


def test_rows_sum_to_one_on_random_logits() -> None:
    logits = torch.randn(7, 1000, generator=torch.Generator().manual_seed(0)) * 3
    for params in (SamplingParams(), SamplingParams(0.7, 50, 0.9), SamplingParams(0)):
        sums = apply_sampling(logits, params).sum(-1)
        assert torch.allclose(sums, torch.ones(7), atol=1e-5)


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1}, {"top_k": -1}, {"top_p": 0}, {"top_p": 1.5}, {"temperature": math.nan}]
)
def test_bad_params_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sample_rows_draws_what_sample_index_draws_row_by_row() -> None:
    """The batched inverse-CDF draw the worker's exact answer uses: the same index per row, bit
    for bit (rounded-up u·total included), on the built-in vocabulary's width."""
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(24, 49152, generator=g, dtype=torch.float64) * 4, dim=-1)
    probs[3, 100:] = 0.0  # the draw lands near the end: the last entry with mass
    u = torch.rand(24, generator=g, dtype=torch.float64)
    u[3] = 1.0 - 2**-53
    assert sample_rows(probs, u).tolist() == [sample_index(row, float(v)) for row, v in zip(probs, u)]


def test_a_short_rows_draw_in_python_is_the_tensors_draw() -> None:
    """``sample_index`` sums a row of at most SHORT_ROW entries in Python floats: the index ``sample_rows``
    (tensors) gives, on rows with zeros, ties, float32 and float64, draws at 0, just below 1 (rounded up to
    the total) and on a boundary."""
    from core.math.random import SHORT_ROW

    g = torch.Generator().manual_seed(61)
    for case in range(300):
        width = 1 + case % SHORT_ROW
        probs = torch.rand(width, generator=g, dtype=torch.float64 if case % 2 else torch.float32) ** 4
        if case % 3 == 0:
            probs[torch.rand(width, generator=g) < 0.4] = 0.0
        if not bool((probs > 0).any()):
            probs[width // 2] = 1.0
        boundary = float(torch.cumsum(probs.double(), 0)[width // 2] / torch.cumsum(probs.double(), 0)[-1])
        for u in (0.0, 1.0 - 2**-53, boundary, float(torch.rand(1, generator=g, dtype=torch.float64))):
            assert sample_index(probs, u) == int(
                sample_rows(probs[None], torch.tensor([u], dtype=torch.float64))[0]
            ), (case, u)
    with pytest.raises(ValueError, match="no mass"):
        sample_index(torch.zeros(5), 0.5)


@pytest.mark.parametrize("top_k, top_p", [(1, 1.0), (3, 1.0), (32, 1.0), (50, 0.9), (0, 0.8), (32, 0.5)])
def test_the_truncated_support_equals_truncate_on_its_support(top_k: int, top_p: float) -> None:
    """The draft samples on the support alone (docs/design.md §9): the same ids as the dense
    ``truncate`` — ties at the threshold kept, zeros left out — and its probabilities up to the
    last bits of the float64 sum; the same token for the same draw."""
    generator = torch.Generator().manual_seed(5)
    for case in range(12):
        logits = torch.randn(1, 3000, generator=generator) * (1 + case % 4)
        if case % 3 == 0:
            logits[0, :40] = logits[0, 0]  # a block of ties, at the threshold or above it
        probs = apply_sampling(logits, SamplingParams(1.0, top_k=[0, 5, 60][case % 3]))[0]
        dense = truncate(probs, top_k, top_p)
        ids, kept = truncated_support(probs, top_k, top_p)
        assert torch.equal(ids, (dense > 0).nonzero()[:, 0])
        assert kept.dtype == torch.float64
        torch.testing.assert_close(kept, dense[ids], rtol=1e-12, atol=0)
        for u in (0.0, 0.31, 0.999):
            assert int(ids[sample_index(kept, u)]) == sample_index(dense, u)


def _top_rows(generator: torch.Generator) -> tuple[torch.Tensor, list[str]]:
    """Rows of 64 blocks that take each of ``top_ids``' ways: a spread row, its k best in a few blocks, a tie
    at the k-th, a block left out holding an entry as large as the k-th (a tie across blocks), fewer than k
    entries with mass."""
    width, k = 64 * TOP_BLOCK, 8
    rows, kinds = [], []
    spread = torch.softmax(torch.randn(width, generator=generator) * 3, -1)
    rows.append(spread), kinds.append("spread")
    few = torch.full((width,), 1e-7)
    # the k best in one block
    few[TOP_BLOCK * 5 : TOP_BLOCK * 5 + k + 3] = torch.rand(k + 3, generator=generator) + 1
    rows.append(few / few.sum()), kinds.append("one block")
    tie = spread.clone()
    order = torch.topk(tie, k + 4).indices
    tie[order[k - 2 : k + 2]] = float(tie[order[k - 1]])  # four entries equal to the k-th: all kept
    rows.append(tie), kinds.append("tie at the k-th")
    across = torch.full((width,), 1e-7)
    # block k's maximum equals the k-th
    across[torch.arange(k + 1) * TOP_BLOCK] = torch.tensor([9.0, 8, 7, 6, 5, 4, 3, 2, 2])
    rows.append(across), kinds.append("tie across blocks")
    sparse = torch.zeros(width)
    sparse[torch.randperm(width, generator=generator)[: k - 3]] = 1.0
    rows.append(sparse), kinds.append("fewer than k")
    return torch.stack(rows), kinds


def test_top_ids_keeps_what_mask_top_k_keeps_in_each_of_its_ways() -> None:
    """The blocks' shortcut (``top_ids``) against the whole row's top-k, on rows built to take each branch,
    and on random rows alone and together; a broken shortcut (the k-th block left out) loses the k-th entry of
    a row."""
    generator = torch.Generator().manual_seed(61)
    k = 8
    rows, kinds = _top_rows(generator)
    for kind, row, ids in zip(kinds, rows, top_ids(rows, k)):
        expected = ((row >= torch.topk(row, k).values[-1]) & (row > 0)).nonzero()[:, 0]
        assert torch.equal(ids, expected), kind
        assert torch.equal(top_ids(row[None], k)[0], ids), kind  # alone or together: the same ids
    assert [len(ids) for ids in top_ids(rows, k)] == [k, k, k + 2, k + 1, k - 3]
    for case in range(40):
        row = torch.softmax(torch.randn(1, 48 * TOP_BLOCK, generator=generator) * (1 + case % 5), -1)
        for top in (1, 4, 32, 47):
            assert torch.equal(
                top_ids(row, top)[0], (row[0] >= torch.topk(row[0], top).values[-1]).nonzero()[:, 0]
            )
    across = rows[3].view(64, TOP_BLOCK)  # its k best each in a block of its own
    broken = across[torch.topk(across.amax(dim=-1), k - 1).indices]  # the shortcut with k − 1 blocks
    assert torch.topk(broken.flatten(), k).values[-1] != torch.topk(rows[3], k).values[-1]


@pytest.mark.parametrize("top_k, top_p", [(32, 1.0), (8, 0.5), (0, 0.9), (32, 0.95)])
def test_truncated_supports_together_are_each_rows_alone_bit_for_bit(top_k: int, top_p: float) -> None:
    """A tree's depth truncates its rows together: each row's ids and probabilities are the very ones
    alone."""
    generator = torch.Generator().manual_seed(7)
    probs = torch.softmax(torch.randn(4, 96 * TOP_BLOCK, generator=generator) * 3, -1)
    probs[2, : 90 * TOP_BLOCK] = 0  # a row of another support size: the rows then go one by one
    for together, row in zip(truncated_supports(probs, top_k, top_p), probs):
        alone = truncated_support(row, top_k, top_p)
        assert torch.equal(together[0], alone[0]) and torch.equal(together[1], alone[1])


def test_the_truncated_support_of_a_row_with_fewer_entries_than_k() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5])
    ids, kept = truncated_support(probs, top_k=3)
    assert ids.tolist() == [1, 3] and kept.tolist() == [0.5, 0.5]
