"""Relaxed verification (DSD, docs/design.md §3.8): the output law τ q + (1 − τ) p in closed form and
by seeded chi-square (with a broken variant the same test rejects), its distance τ (1 − β)
exactly, τ = 0 bit-identical to strict verification, and the τ function's shape."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from core.math import relaxed
from core.math.aggregation import tv_distance
from core.math.random import Purpose, sample_index, uniform, uniforms
from core.math.relaxed import (
    Relaxation,
    relaxation_factor,
    relaxed_distance,
    verify_relaxed,
)
from core.math.speculative import beta
from tests.core.math.test_speculative import CASES, SIGNIFICANCE
from tests.oracles import relaxed_output_law, verify_sampled

SAMPLES = 10_000


@pytest.mark.parametrize("tau", [0.0, 0.3, 0.9])
@pytest.mark.parametrize("name", CASES)
def test_closed_form_law_and_its_distance(name: str, tau: float) -> None:
    p, q = CASES[name]
    law = relaxed_output_law(p, q, tau)
    assert torch.allclose(law, tau * q + (1 - tau) * p, atol=1e-12, rtol=0)
    assert float(tv_distance(law, p)) == pytest.approx(
        float(relaxed_distance(p, q, torch.tensor(tau, dtype=torch.float64))), abs=1e-12
    )
    assert float(relaxed_distance(p, q, torch.tensor(tau, dtype=torch.float64))) == pytest.approx(
        tau * (1 - float(beta(p, q))), abs=1e-12
    )


def test_tau_zero_is_bit_identical_to_strict() -> None:
    g = torch.Generator().manual_seed(3)
    for seed in range(300):
        p = torch.softmax(torch.randn(4, 12, generator=g, dtype=torch.float64) * 2, -1)
        q = torch.softmax(torch.randn(3, 12, generator=g, dtype=torch.float64) * 2, -1)
        draft = [sample_index(q[j], uniform(seed, 0, j, Purpose.DRAFT_SAMPLE)) for j in range(3)]
        accept_u, final_u = (
            uniforms(seed, 0, [0, 1, 2], Purpose.ACCEPT),
            uniforms(seed, 0, [0, 1, 2, 3], Purpose.RESIDUAL),
        )
        assert verify_relaxed(
            p, q, draft, accept_u, final_u, torch.zeros(3, dtype=torch.float64)
        ) == verify_sampled(p, q, draft, accept_u, final_u)


def _first_tokens(p: torch.Tensor, q: torch.Tensor, tau: float) -> torch.Tensor:
    tokens = []
    for seed in range(SAMPLES):
        x = sample_index(q, uniform(seed, 0, 0, Purpose.DRAFT_SAMPLE))
        verdict = verify_relaxed(
            torch.stack([p, p]),
            q[None],
            [x],
            uniforms(seed, 0, [0], Purpose.ACCEPT),
            uniforms(seed, 0, [0, 1], Purpose.RESIDUAL),
            torch.tensor([tau], dtype=torch.float64),
        )
        tokens.append(verdict.output([x])[0])
    return torch.bincount(torch.tensor(tokens), minlength=len(p))


@pytest.mark.parametrize("name, tau", [("random", 0.4), ("q wider than p", 0.7), ("zeros in q", 0.25)])
def test_chi_square_first_token_follows_the_relaxed_law(name: str, tau: float) -> None:
    p, q = CASES[name]
    expected = tau * q + (1 - tau) * p
    counts = _first_tokens(p, q, tau)
    support = expected > 0
    assert counts[~support].sum() == 0
    assert (
        stats.chisquare(counts[support].numpy(), (expected[support] * SAMPLES).numpy()).pvalue > SIGNIFICANCE
    )
    # and not the target: the relaxed output is measurably off p
    if bool((p > 0).all()):
        assert stats.chisquare(counts.numpy(), (p * SAMPLES).numpy()).pvalue < SIGNIFICANCE
    else:
        assert counts[p == 0].sum() > 0


def test_negative_control_a_residual_of_p_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    p, q = CASES["random"]
    monkeypatch.setattr(relaxed, "residual", lambda p, q: p.double() / p.double().sum())
    counts = _first_tokens(p, q, 0.4)
    assert stats.chisquare(counts.numpy(), ((0.4 * q + 0.6 * p) * SAMPLES).numpy()).pvalue < SIGNIFICANCE


def test_tau_is_large_only_where_the_models_agree() -> None:
    settings = Relaxation(tau_max=0.6, kl_scale=1.0)
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    assert relaxation_factor(p, p, settings) == pytest.approx(0.6)  # KL 0, β 1
    # top-1 differs
    assert relaxation_factor(p, torch.tensor([0.1, 0.8, 0.1], dtype=torch.float64), settings) == 0.0
    assert relaxation_factor(p, p, Relaxation(tau_max=0.0)) == 0.0
    # KL ∞
    assert (
        relaxation_factor(
            torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64),
            torch.tensor([0.6, 0.2, 0.2], dtype=torch.float64),
            settings,
        )
        == 0.0
    )
    near, far = (
        torch.tensor([0.6, 0.25, 0.15], dtype=torch.float64),
        torch.tensor([0.4, 0.35, 0.25], dtype=torch.float64),
    )
    assert 0 < relaxation_factor(p, far, settings) < relaxation_factor(p, near, settings) < 0.6
    with pytest.raises(ValueError):
        Relaxation(tau_max=1.0)
    with pytest.raises(ValueError):
        Relaxation(kl_scale=0.0)


@pytest.mark.parametrize("tau", [0.0, 0.35, 0.8])
@pytest.mark.parametrize("seed", range(4))
def test_exact_relaxed_law_in_closed_form(seed: int, tau: float) -> None:
    """exact's sampler with the relaxed accept test (three weighted workers, a top-3 draft):
    the first token follows τ q̂ + (1 − τ) p, p the mixture."""
    from core.math.sampling import truncate
    from tests.oracles import exact_output_law

    g = torch.Generator().manual_seed(seed)
    p_n = torch.softmax(torch.randn(3, 8, generator=g, dtype=torch.float64) * 1.5, -1)
    weights = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q_hat = truncate(torch.softmax(torch.randn(8, generator=g, dtype=torch.float64) * 1.5, -1), 3).double()
    law = exact_output_law(p_n, weights, q_hat, tau)
    assert torch.allclose(law, tau * q_hat + (1 - tau) * (weights @ p_n), atol=1e-12, rtol=0)


def test_tau_on_the_support_matches_tau_on_the_whole_vocabulary() -> None:
    from core.math.relaxed import relaxation_factor_on_support

    settings = Relaxation(tau_max=0.7)
    p = torch.tensor([0.55, 0.2, 0.1, 0.1, 0.05], dtype=torch.float64)
    q = torch.tensor([0.6, 0.3, 0.1, 0.0, 0.0], dtype=torch.float64)
    support = q > 0
    assert relaxation_factor_on_support(
        p[support], q[support], float(p[~support].sum()), settings
    ) == pytest.approx(relaxation_factor(p, q, settings))
    # the target's mass off the support could hide its argmax: no relaxation
    assert relaxation_factor_on_support(p[support] * 0.3, q[support], 0.7, settings) == 0.0


def test_a_tau_per_draft_token_no_more() -> None:
    """More relaxation factors than draft tokens would test tokens never drafted: refused (issue 63), as are
    fewer uniforms than tests."""
    p = torch.softmax(torch.randn(3, 8, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(2, 8, dtype=torch.float64), -1)
    u = torch.full((3,), 0.5, dtype=torch.float64)
    with pytest.raises(ValueError, match="relaxation factors"):
        verify_relaxed(p, q, [1, 2], u[:2], u, torch.tensor([0.2, 0.2, 0.2], dtype=torch.float64))
    assert (
        verify_relaxed(p, q, [1, 2], u[:2], u, torch.tensor([0.2, 0.2], dtype=torch.float64)).num_accepted
        <= 2
    )
    from core.math.speculative import first_rejection

    with pytest.raises(ValueError, match="uniforms"):
        first_rejection(torch.ones(3, dtype=torch.float64), u[:2])
