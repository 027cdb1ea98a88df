"""Transforms (docs/design.md §3.9) under the real random streams: a grammar (``TableMatcher``: it forces
the first token and a 0 after every 1), logit_bias and all three penalties together, through
the real engine, draft and worker scoring on Markov fakes, a chain and trees, one worker and
two weighted ones. The first three tokens must follow the transformed target (chi-square);
the broken variant that transforms every row as the round's first (penalty counts not advanced
along the path, the mask taken before the draft's tokens) is rejected by the same test.
``tests/app/test_lossless_matrix.py`` proves the same cells exactly; by default the chain runs here
with its control, ``SPECGATE_FULL_STATISTICS=1`` adds the trees and draws 20,000 samples a cell."""

from __future__ import annotations

import asyncio
import itertools
import os
from contextlib import aclosing

import pytest
import torch

from app.engine import GenerationRequest, SpecOptions
from core.math.sampling import SamplingParams, apply_sampling, normalised
from core.math.shapes import ChildRule, TreeShape
from core.names import Mode, Reconstruction
from tests.app.fakes import make_engine, with_table_grammar
from tests.app.helpers import FULL_STATISTICS, seed_pool
from tests.app.test_engine import pooled_chisquare
from tests.app.test_lossless_matrix import DRAFT, EOS, PROMPT, TARGETS, TRANSFORMS, V, transformed

SAMPLES = 20_000 if os.environ.get("SPECGATE_FULL_STATISTICS") else 2_000
SIGNIFICANCE = 1e-3
LENGTH = 3  # tokens checked: the forced first one, then two decided by rounds
WORKERS = {"1 worker": [1.0], "2 workers 0.7/0.3": [0.7, 0.3]}
SPECS = {
    "exact chain γ=2": SpecOptions(
        mode=Mode.EXACT, num_draft_tokens=2, k=None, reconstruction=Reconstruction.RENORMALIZE, draft_top_k=2
    ),
    "tree sampled ⟨2,1⟩, full rows": SpecOptions(
        mode=Mode.TREE,
        num_draft_tokens=1,
        k=None,
        reconstruction=Reconstruction.RENORMALIZE,
        tree=TreeShape(ChildRule.SAMPLED, widths=(2, 1)),
    ),
    "tree fixed 3 nodes, exact payload": SpecOptions(
        mode=Mode.TREE,
        num_draft_tokens=1,
        k=None,
        reconstruction=Reconstruction.RENORMALIZE,
        draft_top_k=3,
        tree=TreeShape(ChildRule.FIXED, nodes=3, depth=2, top_k=2),
        tree_payload=Mode.EXACT,
    ),
}
# the trees' cells: the matrix's transforms on every shape prove them exactly (FULL_STATISTICS runs them here
# too)
CELLS = [
    ("exact chain γ=2", "2 workers 0.7/0.3"),
    pytest.param("tree sampled ⟨2,1⟩, full rows", "1 worker", marks=FULL_STATISTICS),
    pytest.param("tree fixed 3 nodes, exact payload", "2 workers 0.7/0.3", marks=FULL_STATISTICS),
]


def _counts(
    spec_name: str, workers: str, seeds: range, parents_row: bool = False
) -> dict[tuple[int, ...], int]:
    """In a pool process: how often each outcome (the first LENGTH tokens, cut at EOS) came."""
    if parents_row:
        from workers.step import Steps

        real = Steps._shaping
        Steps._shaping = lambda self, req: (
            lambda s: None if s is None else (s[0], s[1], [[] for _ in s[2]])
        )(real(self, req))  # type: ignore[method-assign]
    engine = with_table_grammar(make_engine(DRAFT, list(zip(TARGETS, WORKERS[workers])), eos_ids=[EOS]))

    async def run() -> dict[tuple[int, ...], int]:
        counts: dict[tuple[int, ...], int] = {}
        for seed in seeds:
            req = GenerationRequest(
                request_id=f"r{seed}",
                prompt=PROMPT,
                max_tokens=8,
                params=SamplingParams(temperature=1.0),
                seed=seed,
                choice=0,
                spec=SPECS[spec_name],
                transform=TRANSFORMS["all"],
            )
            tokens: list[int] = []
            async with aclosing(engine.generate(req)) as rounds:
                async for result in rounds:
                    tokens += result.tokens
                    if len(tokens) >= LENGTH or result.finish_reason:
                        break
            outcome = tuple(tokens[:LENGTH])
            counts[outcome] = counts.get(outcome, 0) + 1
        return counts

    return asyncio.run(run())


def _target(workers: str) -> dict[tuple[int, ...], float]:
    """The law of the first LENGTH tokens under the transformed mixture, from the definitions."""
    weights = torch.tensor(WORKERS[workers], dtype=torch.float64)
    weights /= weights.sum()

    def p_next(prefix: tuple[int, ...]) -> torch.Tensor:
        last = prefix[-1] if prefix else PROMPT[-1]
        rows = [
            normalised(
                apply_sampling(
                    transformed(t.table[last], prefix, TRANSFORMS["all"])[None],
                    SamplingParams(temperature=1.0),
                )[0]
            )
            for t in TARGETS[: len(weights)]
        ]
        return sum((w * row for w, row in zip(weights, rows)), torch.zeros(V, dtype=torch.float64))

    law: dict[tuple[int, ...], float] = {}
    for outcome in itertools.product(range(V), repeat=LENGTH):
        cut = outcome[: next((i + 1 for i, t in enumerate(outcome) if t == EOS), LENGTH)]
        mass = 1.0
        for i in range(len(cut)):
            mass *= float(p_next(cut[:i])[cut[i]])
        if len(cut) == LENGTH or outcome[len(cut) :] == (0,) * (LENGTH - len(cut)):
            # each shorter outcome once
            law[cut] = law.get(cut, 0.0) + mass
    return law


def _pvalue(spec_name: str, workers: str, samples: int, parents_row: bool = False) -> float:
    with seed_pool(fresh=parents_row) as pool:
        halves = [range(samples // 2), range(samples // 2, samples)]
        parts = list(pool.map(_counts, [spec_name] * 2, [workers] * 2, halves, [parents_row] * 2))
    counts: dict[tuple[int, ...], int] = {}
    for part in parts:
        for key, n in part.items():
            counts[key] = counts.get(key, 0) + n
    target = _target(workers)
    keys = sorted(set(target) | set(counts))
    observed = torch.tensor([float(counts.get(k, 0)) for k in keys], dtype=torch.float64)
    expected = torch.tensor([target.get(k, 0.0) * samples for k in keys], dtype=torch.float64)
    return pooled_chisquare(observed, expected)


def test_the_target_law_sums_to_one() -> None:
    for workers in WORKERS:
        law = _target(workers)
        # the first token is forced
        assert abs(sum(law.values()) - 1) < 1e-9 and all(k[0] == 2 for k, v in law.items() if v > 0)


@pytest.mark.parametrize("spec_name, workers", CELLS)
def test_a_transformed_target_is_followed(spec_name: str, workers: str) -> None:
    assert _pvalue(spec_name, workers, SAMPLES) > SIGNIFICANCE


def test_negative_control_rows_transformed_as_the_first_are_rejected() -> None:
    assert _pvalue("exact chain γ=2", "2 workers 0.7/0.3", SAMPLES, parents_row=True) < SIGNIFICANCE
