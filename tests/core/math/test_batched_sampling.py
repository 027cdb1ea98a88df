"""``apply_sampling_rows`` (issue 60's device scoring, its first part) against ``apply_sampling`` row by row:
every mix of temperature, min-p, top-k and top-p in one batch, on logits with ties and ``-inf`` (a grammar's
mask), gives each row's law — the same support, probabilities within 1e-6 — and a row's law does not depend on
the rows beside it."""

from __future__ import annotations

import itertools

import pytest
import torch

from core.math.batched_sampling import RowParams, apply_sampling_rows
from core.math.sampling import SamplingParams, apply_sampling

V = 2000

PARAMS = [
    SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
    for t, k, p, m in itertools.product([0.0, 0.7, 1.0], [0, 1, 40, V], [1.0, 0.9, 0.3], [0.0, 0.05])
]


def _logits(rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=generator) * 3
    logits[:, 10:20] = logits[:, 10:11]  # ties, at the top-k threshold for some rows
    logits[::3, 500:900] = float("-inf")  # a grammar's mask on every third row
    return logits


def test_each_row_gets_its_own_law_in_one_batch() -> None:
    logits = _logits(len(PARAMS), 0)
    batched = apply_sampling_rows(logits, RowParams.of(PARAMS))
    for row, params in enumerate(PARAMS):
        alone = apply_sampling(logits[row : row + 1], params)[0]
        assert torch.equal(batched[row] > 0, alone > 0), params
        assert (batched[row] - alone).abs().max().item() <= 1e-6, params


@pytest.mark.parametrize("seed", [1, 2])
def test_a_rows_law_does_not_depend_on_its_neighbours(seed: int) -> None:
    logits = _logits(len(PARAMS), seed)
    order = torch.randperm(len(PARAMS), generator=torch.Generator().manual_seed(seed))
    batched = apply_sampling_rows(logits, RowParams.of(PARAMS))
    shuffled = apply_sampling_rows(logits[order], RowParams.of([PARAMS[i] for i in order.tolist()]))
    assert torch.equal(batched[order] > 0, shuffled > 0)
    assert (batched[order] - shuffled).abs().max().item() <= 1e-6


def test_a_broken_variant_is_caught() -> None:
    """The control: top-k applied before min-p (the wrong order) changes some row's support."""
    logits = _logits(len(PARAMS), 3)

    def wrong(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        swapped = SamplingParams(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=0.0
        )
        out = apply_sampling(row[None], swapped)[0]
        if params.min_p > 0 and not params.is_greedy:
            out = out.masked_fill(out < params.min_p * out.max(), 0.0)
            out = out / out.sum()
        return out

    batched = apply_sampling_rows(logits, RowParams.of(PARAMS))
    differ = [
        p
        for row, p in enumerate(PARAMS)
        if not torch.equal(batched[row] > 0, wrong(logits[row], p) > 0)
        or (batched[row] - wrong(logits[row], p)).abs().max() > 1e-6
    ]
    assert differ
