"""`exact` (docs/design.md §3.5): the closed-form output law equals p for any number of weighted
workers, with and without draft truncation; a seeded chi-square test and a negative control."""

from __future__ import annotations

import os

import pytest
import torch
from scipy import stats

from core.math import exact
from core.math.exact import ExactPosition, verify_exact
from core.math.random import Purpose, sample_index, uniform, uniforms
from core.math.sampling import truncate
from tests.oracles import exact_output_law

V = 12
SIGNIFICANCE = 1e-3
WEIGHTS = {1: torch.tensor([1.0], dtype=torch.float64), 3: torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)}


def _dists(num: int, seed: int, sharpness: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(num, V, generator=g, dtype=torch.float64) * sharpness, dim=-1)


Q = _dists(1, 99)[0]
TRUNCATIONS = {"none": (0, 1.0), "top_k 4": (4, 1.0), "top_p 0.6": (0, 0.6), "top_k 1": (1, 1.0)}


@pytest.mark.parametrize("num_workers", [1, 3])
@pytest.mark.parametrize("truncation", TRUNCATIONS)
def test_closed_form_output_law_is_the_mixture(num_workers: int, truncation: str) -> None:
    p_n = _dists(num_workers, 7)
    q_hat = truncate(Q, *TRUNCATIONS[truncation])
    target = WEIGHTS[num_workers] @ p_n / WEIGHTS[num_workers].sum()
    assert torch.allclose(
        exact_output_law(p_n, WEIGHTS[num_workers], q_hat), target.double(), atol=1e-9, rtol=0
    )


def test_truncation_renormalises_to_the_support() -> None:
    q_hat = truncate(Q, 4)
    assert int((q_hat > 0).sum()) == 4 and float(q_hat.sum()) == pytest.approx(1.0)
    top = torch.topk(Q, 4).indices
    assert torch.allclose(q_hat[top], Q[top] / Q[top].sum())


def _round(p_n: torch.Tensor, w: torch.Tensor, q_hat: torch.Tensor, seed: int) -> int:
    """First token of a γ = 1 round, drawn as gateway and workers draw it."""
    support = (q_hat > 0).nonzero()[:, 0]
    outside = torch.ones(V, dtype=torch.bool)
    outside[support] = False
    x = sample_index(q_hat, uniform(seed, 0, 0, Purpose.DRAFT_SAMPLE))
    complement = (p_n * outside).sum(dim=-1)
    samples = [
        sample_index(p_n[n] * outside, uniform(seed, 0, 0, Purpose.WORKER_COMPLEMENT, n))
        if complement[n] > 0
        else -1
        for n in range(p_n.shape[0])
    ]
    bonus = [sample_index(p_n[n], uniform(seed, 0, 1, Purpose.WORKER_BONUS, n)) for n in range(p_n.shape[0])]
    position = ExactPosition(support, p_n[:, support], complement, samples, q_hat[support])
    verdict = verify_exact(
        [position],
        [int((support == x).nonzero()[0, 0])],
        bonus,
        w,
        uniforms(seed, 0, [0], Purpose.ACCEPT),
        uniforms(seed, 0, [0], Purpose.RESIDUAL),
        uniform(seed, 0, 1, Purpose.WORKER_CHOICE),
    )
    return verdict.output([x])[0]


# ignoring the complement: p below double precision at 8,000
SAMPLES = 20_000 if os.environ.get("SPECGATE_FULL_STATISTICS") else 8_000


def _chi_square(num_workers: int, truncation: str, num: int = SAMPLES) -> float:
    p_n, w = _dists(num_workers, 7), WEIGHTS[num_workers]
    q_hat = truncate(Q, *TRUNCATIONS[truncation])
    counts = torch.bincount(torch.tensor([_round(p_n, w, q_hat, s) for s in range(num)]), minlength=V)
    target = (w @ p_n) / w.sum()
    return float(stats.chisquare(counts.numpy(), (target * num).numpy()).pvalue)


# N = 3, top-k: tests/app/test_engine.py
@pytest.mark.parametrize("num_workers, truncation", [(1, "top_k 4"), (3, "top_p 0.6")])
def test_chi_square_first_token_follows_the_mixture(num_workers: int, truncation: str) -> None:
    assert _chi_square(num_workers, truncation) > SIGNIFICANCE


def test_negative_control_ignoring_the_complement_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    original = exact.extended_residual

    def without_complement(p_mix, q, complement, weights):  # type: ignore[no-untyped-def]
        return original(p_mix, q, torch.zeros_like(complement), weights)

    monkeypatch.setattr(exact, "extended_residual", without_complement)
    assert _chi_square(3, "top_k 4") < SIGNIFICANCE
