"""``specgate law``'s statistics on a known law (no model): answers drawn from the law itself give
p-values spread over (0, 1) — including when first tokens of tiny mass are drawn, the case whose
cells were once chosen from the answers and failed every lossless gateway — and a biased sampler
is rejected. The first token's TV sits at its noise floor for the law itself and above it for the
biased one."""

from __future__ import annotations

from collections import Counter

import numpy as np

from clients.law import Pair, chi_square, first_token_tv, tv_floor

ROWS = 12  # first tokens with a row; the tail has none
TAIL = 400  # first tokens of tiny mass, no row: together they hold 6 % of the first token's mass
V = 30  # second tokens per row
SAMPLES = 1500


def _law() -> tuple[dict[Pair, float], np.ndarray, np.ndarray]:
    """The expected cells (rows and the tail's one cell), and the full first and second laws."""
    rng = np.random.default_rng(7)
    first = np.concatenate([rng.dirichlet(np.full(ROWS, 2.0)) * 0.94, rng.dirichlet(np.ones(TAIL)) * 0.06])
    second = rng.dirichlet(np.full(V, 0.3), size=ROWS)
    expected: dict[Pair, float] = {(-1, None): float(first[ROWS:].sum())}
    for a in range(ROWS):
        for b in range(V):
            expected[(a, b)] = float(first[a] * second[a, b])
    return expected, first, second


def _draw(first: np.ndarray, second: np.ndarray, seed: int, shift: float = 0.0) -> Counter[Pair]:
    """SAMPLES pairs; with ``shift`` the most likely first token gives that much mass to the next."""
    rng = np.random.default_rng(seed)
    first = first.copy()
    top = int(np.argmax(first[:ROWS]))
    first[top] -= shift
    first[(top + 1) % ROWS] += shift
    pairs: Counter[Pair] = Counter()
    for a in rng.choice(len(first), size=SAMPLES, p=first):
        a = int(a)
        # tail ids have no row
        pairs[(ROWS + a, None) if a >= ROWS else (a, int(rng.choice(V, p=second[a])))] += 1
    return pairs


def test_answers_from_the_law_itself_pass_and_a_biased_sampler_fails() -> None:
    expected, first, second = _law()
    pvalues = [chi_square(_draw(first, second, seed), expected, SAMPLES)[2] for seed in range(40)]
    assert min(pvalues) > 1e-3, pvalues
    assert 0.2 < float(np.median(pvalues)) < 0.8, pvalues  # spread over (0, 1), not piled at 0 or 1
    assert sum(p < 0.05 for p in pvalues) <= 6, pvalues
    biased = [chi_square(_draw(first, second, seed, shift=0.1), expected, SAMPLES)[2] for seed in range(5)]
    assert max(biased) < 1e-4, biased


def test_tail_answers_land_in_the_tail_cell() -> None:
    expected, first, second = _law()
    observed = _draw(first, second, 0)
    assert any(a >= ROWS for a, _ in observed)  # the tail is drawn …
    statistic, dof, _ = chi_square(observed, expected, SAMPLES)
    tail_only: Counter[Pair] = Counter({(ROWS + 5, None): SAMPLES})
    # … and counted in (−1, None), not a new cell
    assert chi_square(tail_only, expected, SAMPLES)[0] > statistic
    assert dof == chi_square(tail_only, expected, SAMPLES)[1]  # the cells do not depend on the answers


def test_first_token_tv_against_its_floor() -> None:
    expected, first, second = _law()
    floor = tv_floor(expected, SAMPLES)
    fair = [first_token_tv(_draw(first, second, seed), expected, SAMPLES) for seed in range(10)]
    biased = [first_token_tv(_draw(first, second, seed, shift=0.1), expected, SAMPLES) for seed in range(10)]
    assert 0.5 * floor < float(np.median(fair)) < 1.5 * floor
    assert float(np.median(biased)) > floor + 0.05
