"""T(p) (DESIGN §3.2) on hand-built logits."""

from __future__ import annotations

import math

import pytest
import torch

from core.math.aggregation import aggregate, kept_weights
from core.math.random import sample_index, sample_rows
from core.math.sampling import SamplingParams, Suppression, apply_sampling, mask_top_k, mask_top_p, normalised, suppress, truncate, truncated_support

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))


def test_temperature_one_is_softmax() -> None:
    torch.testing.assert_close(apply_sampling(LOGITS, SamplingParams()), torch.tensor([[0.5, 0.25, 0.125, 0.125]]))


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


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_k": -1}, {"top_p": 0}, {"top_p": 1.5}, {"temperature": math.nan}])
def test_bad_params_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- min_tokens


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=4), SamplingParams(temperature=0)])
def test_suppression_reweighs_the_mixture_to_the_target_without_eos(params: SamplingParams) -> None:
    """Closed form: with p'_n = T(p_n) without E (as sent: zeroed, renormalised by the reader) and
    κ_n its kept mass, the mixture Σ w'_n p'_n with w' = kept_weights(w, κ) is the mixture T-mixed
    without E, renormalised — on the suppressed rows; the others are left alone (κ = 1)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 2, 10, generator=g) * 2  # [N, rows, V]
    logits[0, :, 4] += 4.0  # worker 0 puts most of its mass on EOS
    eos, w = torch.tensor([4, 7]), torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    probs = torch.stack([apply_sampling(lg, params) for lg in logits])
    suppressed = [suppress(lg, p, torch.tensor([True, False]), eos, params) for lg, p in zip(logits, probs)]
    kept = torch.stack([k for _, k in suppressed])  # [N, rows]
    mixed = aggregate(torch.stack([normalised(p) for p, _ in suppressed]), kept_weights(w, kept))
    assert all(torch.equal(p[0].index_fill(0, eos, 0.0), sent[0]) for p, (sent, _) in zip(probs, suppressed))  # T(p)'s own fp32 numbers
    target = aggregate(probs, w)
    expected_first = target[0].index_fill(0, eos, 0.0)
    assert torch.allclose(mixed[0], expected_first / expected_first.sum(), atol=1e-6)
    assert torch.allclose(mixed[1], target[1], atol=1e-6) and torch.equal(kept[:, 1], torch.ones(3, dtype=torch.float64))
    assert torch.allclose(kept[:, 0], 1 - probs[:, 0, eos].double().sum(-1), atol=1e-6)


def test_a_row_that_keeps_nothing_takes_vllms_order() -> None:
    """top_k 1 on an EOS leaves nothing without it: vLLM masks EOS before truncating, and so does
    the fallback; κ = 0 there, and kept_weights keeps w where every worker kept nothing."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    params = SamplingParams(temperature=1.0, top_k=1)
    probs, kept = suppress(logits, apply_sampling(logits, params), torch.tensor([True]), torch.tensor([1]), params)
    assert float(kept[0]) == 0.0 and torch.equal(probs[0], torch.tensor([0.0, 0.0, 0.0, 1.0]))
    w = torch.tensor([2.0, 1.0], dtype=torch.float64)
    assert torch.allclose(kept_weights(w, torch.zeros(2, 1, dtype=torch.float64))[0], w / 3)
    assert torch.allclose(kept_weights(w, torch.tensor([[0.0], [0.5]], dtype=torch.float64))[0], torch.tensor([0.0, 1.0], dtype=torch.float64))


def test_suppression_rows_count_positions_before_until() -> None:
    s = Suppression((4,), until=10)
    assert [s.rows(first, 4) for first in (5, 7, 9, 10, 12)] == [4, 3, 1, 0, 0]


def test_sample_rows_draws_what_sample_index_draws_row_by_row() -> None:
    """The batched inverse-CDF draw the worker's exact answer uses: the same index per row, bit
    for bit (rounded-up u·total included), on the built-in vocabulary's width."""
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(24, 49152, generator=g, dtype=torch.float64) * 4, dim=-1)
    probs[3, 100:] = 0.0  # the draw lands near the end: the last entry with mass
    u = torch.rand(24, generator=g, dtype=torch.float64)
    u[3] = 1.0 - 2**-53
    assert sample_rows(probs, u).tolist() == [sample_index(row, float(v)) for row, v in zip(probs, u)]


@pytest.mark.parametrize("top_k, top_p", [(1, 1.0), (3, 1.0), (32, 1.0), (50, 0.9), (0, 0.8), (32, 0.5)])
def test_the_truncated_support_equals_truncate_on_its_support(top_k: int, top_p: float) -> None:
    """The draft samples on the support alone (DESIGN §9): the same ids as the dense
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


def test_the_truncated_support_of_a_row_with_fewer_entries_than_k() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5])
    ids, kept = truncated_support(probs, top_k=3)
    assert ids.tolist() == [1, 3] and kept.tolist() == [0.5, 0.5]
