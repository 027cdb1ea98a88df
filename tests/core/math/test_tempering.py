"""T(p) from a top-k summary: on random full distributions, the tempered top-k equals the
true T(p) renormalised over those tokens, and the tail bound holds (and is exact at T = 1)."""

from __future__ import annotations

import pytest
import torch

from core.math.sampling import SamplingParams, apply_sampling
from core.math.tempering import temper_top_k

V, K = 1000, 20


def _case(seed: int, sharpness: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * sharpness
    ids = torch.topk(logits[0], K).indices
    return logits, ids


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.5, 3.0])
@pytest.mark.parametrize("seed, sharpness", [(0, 1.0), (1, 3.0), (2, 6.0)])
def test_head_is_exact_and_the_tail_bound_holds(temperature: float, seed: int, sharpness: float) -> None:
    logits, ids = _case(seed, sharpness)
    p = apply_sampling(logits, SamplingParams()).double()[0]
    target = apply_sampling(logits, SamplingParams(temperature=temperature)).double()[0]
    result = temper_top_k(p[ids], V, SamplingParams(temperature=temperature))
    torch.testing.assert_close(result.probs, target[ids] / target[ids].sum(), rtol=1e-5, atol=1e-9)
    true_tail = 1.0 - float(target[ids].sum())
    assert result.tail_bound >= true_tail - 1e-9
    if temperature == 1.0:
        assert result.tail_bound == pytest.approx(true_tail, abs=1e-6)  # σ itself: no slack


def test_a_request_top_k_inside_the_reported_set_is_exact() -> None:
    logits, ids = _case(3, 2.0)
    p = apply_sampling(logits, SamplingParams()).double()[0]
    params = SamplingParams(temperature=0.8, top_k=5)
    result = temper_top_k(p[ids], V, params)
    target = apply_sampling(logits, params).double()[0]
    assert result.tail_bound == 0.0
    torch.testing.assert_close(result.probs, target[ids], rtol=1e-5, atol=1e-9)


def test_a_broken_bound_is_caught() -> None:
    """The check above has teeth: at T > 1 the tail grows, so the untempered σ would under-report it."""
    logits, ids = _case(0, 1.0)
    p = apply_sampling(logits, SamplingParams()).double()[0]
    target = apply_sampling(logits, SamplingParams(temperature=3.0)).double()[0]
    sigma = 1.0 - float(p[ids].sum())
    assert sigma < 1.0 - float(target[ids].sum())


@pytest.mark.parametrize("temperature", [0.3, 0.7])
def test_a_ceiling_covers_reported_tokens_left_out(temperature: float) -> None:
    """Tokens an engine named ambiguously are left out of the head: the bound must use the
    largest of them as the ceiling of the tail (the head's minimum would be too small)."""
    logits, ids = _case(4, 3.0)
    p = apply_sampling(logits, SamplingParams()).double()[0]
    target = apply_sampling(logits, SamplingParams(temperature=temperature)).double()[0]
    kept = ids[1:8]  # the largest was left out
    result = temper_top_k(p[kept], V, SamplingParams(temperature=temperature), ceiling=float(p[ids[0]]))
    assert result.tail_bound >= 1.0 - float(target[kept].sum()) - 1e-9
    if temperature == 0.3:  # without the ceiling the bound fails here
        floor = temper_top_k(p[kept], V, SamplingParams(temperature=temperature))
        assert floor.tail_bound < 1.0 - float(target[kept].sum())
