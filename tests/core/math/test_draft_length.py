"""Choosing γ (issue 8): the choice equals the brute-force argmax of the analytic throughput,
written out here independently, over a grid of (α, t_d, t_v, RTT, bandwidth, overlap)."""

from __future__ import annotations

import itertools
import math

import pytest

from core.math.draft_length import RoundCosts, choose_gamma

MAX_GAMMA = 16


def expected_tokens(costs: RoundCosts, gamma: int) -> float:
    """E(γ) = Σ_{i=0}^{γ} Π_{j<i} α_j."""
    total, reach = 1.0, 1.0
    for j in range(gamma):
        reach *= costs.alpha(j)
        total += reach
    return total


def throughput(costs: RoundCosts, gamma: int) -> float:
    """Expected tokens per second at draft length γ."""
    return expected_tokens(costs, gamma) / costs.round_s(gamma)


def _brute_force(
    alpha: float | list[float],
    draft_s: float,
    v0: float,
    v1: float,
    rtt_s: float,
    mbps: float | None,
    down_per_position: float,
    overlap: bool,
    used: float,
) -> int:
    def alpha_at(j: int) -> float:
        return alpha if isinstance(alpha, float) else alpha[min(j, len(alpha) - 1)]

    rates = []
    for gamma in range(1, MAX_GAMMA + 1):
        if isinstance(alpha, float):
            tokens = (1 - alpha ** (gamma + 1)) / (1 - alpha) if alpha < 1 else gamma + 1.0
        else:
            tokens = sum(math.prod(alpha_at(j) for j in range(i)) for i in range(gamma + 1))
        up, down = 200 + 4 * gamma, 60 + down_per_position * (gamma + 1)
        wire = (8 * up + 8 * down) / (mbps * 1e6) if mbps else 0.0
        flight = rtt_s + wire + v0 + v1 * (gamma + 1)
        if overlap:
            seconds = used * max(flight, (gamma + 1) * draft_s) + (1 - used) * (flight + gamma * draft_s)
        else:
            seconds = gamma * draft_s + flight
        rates.append(tokens / seconds)
    best = max(rates)
    return next(g for g, r in zip(range(1, MAX_GAMMA + 1), rates) if r >= best * (1 - 1e-12))


# α, or α_j falling with j
ALPHAS: list[float | list[float]] = [0.3, 0.6, 0.75, 0.9, 0.97, [0.9, 0.8, 0.6, 0.4]]
GRID = list(
    itertools.product(
        ALPHAS,
        [0.001, 0.006, 0.025],  # t_d
        [(0.005, 0.002), (0.030, 0.0005), (0.002, 0.012)],  # t_v(m) = v0 + v1·m
        [0.0, 0.020, 0.050, 0.100],  # RTT
        [(None, 4.0), (10.0, 4.0), (10.0, 196_608.0), (1.0, 400.0)],  # (Mbps, bytes down per position)
        [(False, 0.0), (True, 0.3), (True, 0.8)],  # overlap, share of prepared drafts used
    )
)


def _costs(
    alpha: float | list[float],
    draft_s: float,
    verify: tuple[float, float],
    rtt_s: float,
    mbps: float | None,
    per_position: float,
    overlap: bool,
    used: float,
) -> RoundCosts:
    return RoundCosts(
        alphas=tuple(alpha) if isinstance(alpha, list) else (alpha,),
        draft_s=draft_s,
        verify_s=verify,
        rtt_s=rtt_s,
        up_bytes=(200, 4),
        down_bytes=(60, per_position),
        up_bits_per_s=mbps * 1e6 if mbps else None,
        down_bits_per_s=mbps * 1e6 if mbps else None,
        overlap=overlap,
        prepared_used=used,
    )


def test_the_choice_is_the_argmax_of_the_analytic_throughput_over_the_grid() -> None:
    chosen = set()
    for alpha, draft_s, verify, rtt_s, (mbps, per_position), (overlap, used) in GRID:
        gamma = choose_gamma(
            _costs(alpha, draft_s, verify, rtt_s, mbps, per_position, overlap, used), MAX_GAMMA
        )
        assert gamma == _brute_force(alpha, draft_s, *verify, rtt_s, mbps, per_position, overlap, used), (
            alpha,
            draft_s,
            verify,
            rtt_s,
            mbps,
            overlap,
        )
        chosen.add(gamma)
    assert len(chosen) >= 8  # the grid exercises many answers, not one


def test_the_choice_moves_the_way_it_should() -> None:
    near = RoundCosts(alphas=(0.75,), draft_s=0.006, verify_s=(0.02, 0.005))
    assert choose_gamma(RoundCosts(alphas=(0.2,), draft_s=0.006, verify_s=(0.02, 0.005)), MAX_GAMMA) == 1
    far = RoundCosts(alphas=(0.75,), draft_s=0.006, verify_s=(0.02, 0.005), rtt_s=0.1)
    assert choose_gamma(far, MAX_GAMMA) > choose_gamma(near, MAX_GAMMA)
    assert expected_tokens(near, 4) == pytest.approx((1 - 0.75**5) / 0.25)
    assert throughput(near, 2) == pytest.approx(expected_tokens(near, 2) / (2 * 0.006 + 0.02 + 0.005 * 3))
