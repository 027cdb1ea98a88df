"""Speculative sampling (docs/design.md §3.1): hand-built distributions, the exact output law in closed
form, and seeded statistical tests with a negative control."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from core.math.random import Purpose, philox4x32, sample_index, uniform, uniforms
from core.math.speculative import (
    Verdict,
    acceptance_probs,
    argmax_lowest,
    beta,
    residual,
    verify_greedy,
)
from tests import oracles
from tests.oracles import output_law, verify_sampled

SIGNIFICANCE = 1e-3  # chi-square tests reject below this p-value; seeds are fixed


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


CASES = {
    "p = q": (t(0.5, 0.3, 0.2), t(0.5, 0.3, 0.2)),
    "disjoint supports": (t(0.6, 0.4, 0.0, 0.0), t(0.0, 0.0, 0.7, 0.3)),
    "one-hot q": (t(0.2, 0.5, 0.3), t(0.0, 1.0, 0.0)),
    "zeros in q": (t(0.25, 0.25, 0.25, 0.25), t(0.5, 0.0, 0.5, 0.0)),
    "q wider than p": (t(0.9, 0.1, 0.0), t(0.4, 0.3, 0.3)),
    "random": (
        torch.softmax(torch.randn(7, generator=torch.Generator().manual_seed(0), dtype=torch.float64), 0),
        torch.softmax(torch.randn(7, generator=torch.Generator().manual_seed(1), dtype=torch.float64), 0),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_closed_form_output_law_equals_p(name: str) -> None:
    p, q = CASES[name]
    assert torch.allclose(output_law(p, q), p, atol=1e-9, rtol=0)


@pytest.mark.parametrize("name", CASES)
def test_acceptance_equals_beta(name: str) -> None:
    p, q = CASES[name]
    support = q > 0
    accepted = (q[support] * acceptance_probs(p[support], q[support])).sum()
    assert float(accepted) == pytest.approx(float(beta(p, q)), abs=1e-12)


def test_residual_falls_back_to_p_when_empty() -> None:
    p = t(0.5, 0.5, 0.0)
    assert torch.equal(residual(p, t(0.5, 0.5, 0.0)), p)
    assert torch.allclose(residual(t(0.6, 0.4), t(0.5, 0.5)), t(1.0, 0.0))


def test_sample_index_is_the_inverse_cdf() -> None:
    p = t(0.2, 0.0, 0.5, 0.3)
    assert [sample_index(p, u) for u in (0.0, 0.19, 0.2, 0.69, 0.7, 0.999999)] == [0, 0, 2, 2, 3, 3]
    assert sample_index(t(0.0, 1.0, 0.0), 0.9999999999) == 1


def test_streams_are_deterministic_and_distinct() -> None:
    a = uniform(7, 0, 12, Purpose.ACCEPT)
    assert a == uniform(7, 0, 12, Purpose.ACCEPT)
    others = [
        uniform(8, 0, 12, Purpose.ACCEPT),
        uniform(7, 1, 12, Purpose.ACCEPT),
        uniform(7, 0, 13, Purpose.ACCEPT),
        uniform(7, 0, 12, Purpose.RESIDUAL),
        uniform(7, 0, 12, Purpose.ACCEPT, worker=1),
    ]
    assert len({a, *others}) == 6
    assert torch.equal(uniforms(7, 0, [12, 13], Purpose.ACCEPT), t(a, others[2]))


def test_lanes_are_distinct_streams_and_lane_zero_is_the_chains() -> None:
    """docs/design.md §3.6: a tree candidate draws from its own lane; lane 0 is today's stream, bit for bit
    (the value below was drawn before lanes existed)."""
    assert uniform(7, 0, 12, Purpose.ACCEPT, lane=0) == uniform(7, 0, 12, Purpose.ACCEPT) == 0.588418131330483
    lanes = [uniform(7, 0, 12, Purpose.ACCEPT, lane=lane) for lane in range(8)]
    assert len(set(lanes)) == 8
    assert torch.equal(
        uniforms(7, 0, [12, 13], Purpose.ACCEPT, lane=3),
        t(lanes[3], uniform(7, 0, 13, Purpose.ACCEPT, lane=3)),
    )
    across = torch.tensor([uniform(1, 0, 5, Purpose.ACCEPT, lane=lane) for lane in range(5_000)]).numpy()
    assert stats.kstest(across, "uniform").pvalue > SIGNIFICANCE
    with pytest.raises(ValueError, match="lane"):
        uniform(7, 0, 12, Purpose.ACCEPT, lane=-1)


def test_streams_are_uniform() -> None:
    values = uniforms(1, 0, list(range(20_000)), Purpose.DRAFT_SAMPLE).numpy()
    assert stats.kstest(values, "uniform").pvalue > SIGNIFICANCE


def test_greedy_accepts_while_the_draft_is_the_argmax() -> None:
    p = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.5, 0.0], [0.2, 0.2, 0.6]])
    assert verify_greedy(p, [1, 0]) == Verdict(2, 2, True)
    assert verify_greedy(p, [1, 1]) == Verdict(1, 0, False)  # tie at position 2 goes to id 0
    assert verify_greedy(p, [2, 0]) == Verdict(0, 1, False)
    assert argmax_lowest(torch.tensor([[0.3, 0.3, 0.4], [0.4, 0.4, 0.2]])) == [2, 0]


def test_verdict_output() -> None:
    assert Verdict(1, 9, False).output([4, 5, 6]) == [4, 9]
    assert Verdict(3, 9, True).output([4, 5, 6]) == [4, 5, 6, 9]


# ----------------------------------------------------------------------------- statistical


def _first_tokens(p: torch.Tensor, q: torch.Tensor, num_samples: int) -> tuple[torch.Tensor, float]:
    """First emitted token of γ = 1 rounds over seeds, and the acceptance rate, drawn with the
    sampler's own functions and streams."""
    tokens, accepted = [], 0
    for seed in range(num_samples):
        x = sample_index(q, uniform(seed, 0, 0, Purpose.DRAFT_SAMPLE))
        accept_u = uniforms(seed, 0, [0], Purpose.ACCEPT)
        final_u = uniforms(seed, 0, [0, 1], Purpose.RESIDUAL)
        verdict = verify_sampled(torch.stack([p, p]), q[None], [x], accept_u, final_u)
        tokens.append(verdict.output([x])[0])
        accepted += verdict.num_accepted
    return torch.bincount(torch.tensor(tokens), minlength=len(p)), accepted / num_samples


@pytest.mark.parametrize("name", ["disjoint supports", "one-hot q", "zeros in q", "random"])
def test_chi_square_first_token_follows_p(name: str) -> None:
    p, q = CASES[name]
    counts, accepted = _first_tokens(p, q, 20_000)
    support = p > 0
    assert counts[~support].sum() == 0
    assert stats.chisquare(counts[support].numpy(), (p[support] * 20_000).numpy()).pvalue > SIGNIFICANCE
    # the rate the accept test fires at is β = Σ min(p, q): a verifier that ignored the draft would not match
    assert accepted == pytest.approx(float(beta(p, q)), abs=4 * (0.25 / 20_000) ** 0.5)


def test_negative_control_skipping_the_residual_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    p, q = CASES["random"]
    # the reference chain verifier's
    monkeypatch.setattr(oracles, "residual", lambda p, q: p.double() / p.double().sum())
    counts, _ = _first_tokens(p, q, 20_000)
    assert stats.chisquare(counts.numpy(), (p * 20_000).numpy()).pvalue < SIGNIFICANCE


@pytest.mark.parametrize(
    "counter, key, expected",
    [  # Random123's known-answer vectors for Philox-4x32-10
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_known_answers(
    counter: tuple[int, int, int, int], key: tuple[int, int], expected: tuple[int, ...]
) -> None:
    assert philox4x32(counter, key) == expected


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("seed", range(5))
def test_split_with_top_k_stays_within_its_bound(k: int, seed: int) -> None:
    """split's worker tests with its full p; the gateway's residual uses p̂ from the top-k it
    was sent. The output's distance to p is at most that position's tail mass σ."""
    from core.math.aggregation import reconstruct, tv_distance
    from core.math.compression import compress_top_k

    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(8, generator=g, dtype=torch.float64) * 1.5, 0)
    q = torch.softmax(torch.randn(8, generator=g, dtype=torch.float64) * 1.5, 0)
    top = compress_top_k(p[None].float(), k)
    p_hat = reconstruct(top.ids, top.probs, 8)[0]
    law = output_law(p, q, p_residual=p_hat)
    assert float(law.sum()) == pytest.approx(1.0)
    assert float(tv_distance(law, p)) <= float(top.tail_mass[0]) + 1e-6
    if k == 8:
        assert torch.allclose(law, p, atol=1e-9)
