"""Chains of fixed children, seeded, through the real engine (issue 32): an EAGLE-2 tree that
keeps one node, or a top-1 chain, is a chain of fixed children — not drawn from q̂ — and must be
walked by the fixed rule on every payload. The first two tokens follow the target (chi-square,
real Philox streams, one worker and two weighted ones, aggregate's ``k: full`` and exact's
payload); the chain shortcut that sent them to the sampled chain's verifier is rejected by the
same test. ``tests/app/test_lossless_matrix.py`` proves the same cells exactly; this test runs
the real random numbers: by default on one cell of each payload and with the control on two
workers; ``SPECGATE_FULL_STATISTICS=1`` runs every cell, with 20,000 samples a cell."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from concurrent.futures import Executor
from contextlib import aclosing

import pytest
import torch

from app.engine import GenerationRequest, SpecOptions
from core.math.sampling import SamplingParams
from core.math.shapes import ChildRule, TreeShape
from core.math.tree import TokenTree
from core.names import Mode, Reconstruction
from tests.app.fakes import make_engine
from tests.app.helpers import FULL_STATISTICS, seed_pool
from tests.app.test_engine import DRAFT, PROMPT, TARGETS, V, _target_joint, pooled_chisquare

# the shortcut's bias gives p < 1e-15 at 1,000
SAMPLES = 20_000 if os.environ.get("SPECGATE_FULL_STATISTICS") else 2_000
SIGNIFICANCE = 1e-3
SHAPES = {
    "nodes 1": TreeShape(ChildRule.FIXED, nodes=1, depth=1, top_k=1),
    "top-1 chain of 3": TreeShape(ChildRule.FIXED, nodes=3, depth=3, top_k=1),
}
WORKERS = {"1 worker": [(TARGETS[0], 1.0)], "2 workers 0.7/0.3": [(TARGETS[0], 0.7), (TARGETS[1], 0.3)]}
PAYLOADS = {"aggregate k: full": Mode.AGGREGATE, "exact, draft top-3": Mode.EXACT}
CELLS = [
    ("nodes 1", "1 worker", "aggregate k: full"),
    pytest.param("nodes 1", "2 workers 0.7/0.3", "aggregate k: full", marks=FULL_STATISTICS),
    pytest.param("nodes 1", "1 worker", "exact, draft top-3", marks=FULL_STATISTICS),
    ("nodes 1", "2 workers 0.7/0.3", "exact, draft top-3"),
    pytest.param("top-1 chain of 3", "2 workers 0.7/0.3", "exact, draft top-3", marks=FULL_STATISTICS),
]


def _spec(shape: str, payload: str) -> SpecOptions:
    mode = PAYLOADS[payload]
    return SpecOptions(
        mode=Mode.TREE,
        num_draft_tokens=1,
        k=None,
        reconstruction=Reconstruction.RENORMALIZE,
        draft_top_k=3 if mode is Mode.EXACT else 0,
        tree=SHAPES[shape],
        tree_payload=mode,
    )


def _counts(shape: str, workers: str, payload: str, seeds: range, shortcut: bool = False) -> torch.Tensor:
    """In a pool process: counts [V, V] of the first two tokens over ``seeds``; with ``shortcut``
    a fixed chain goes to the sampled chain's verifier, as before issue 32 (exact's payload)."""
    if shortcut:
        TokenTree.is_sampled_chain = property(lambda tree: tree.is_chain)  # type: ignore[method-assign, assignment]
    engine, spec = make_engine(DRAFT, WORKERS[workers]), _spec(shape, payload)

    async def run() -> torch.Tensor:
        counts = torch.zeros(V, V)
        for seed in seeds:
            req = GenerationRequest(
                request_id=f"r{seed}",
                prompt=PROMPT,
                max_tokens=3,
                params=SamplingParams(temperature=1.0),
                seed=seed,
                choice=0,
                spec=spec,
            )
            tokens: list[int] = []
            async with aclosing(engine.generate(req)) as rounds:
                async for result in rounds:
                    tokens += result.tokens
                    if len(tokens) >= 2:
                        break
            counts[tokens[0], tokens[1]] += 1
        return counts

    return asyncio.run(run())


@pytest.fixture(scope="module")
def processes() -> Iterator[Executor]:
    with seed_pool() as pool:
        yield pool


def _pvalue(
    pool: Executor, shape: str, workers: str, payload: str, samples: int, shortcut: bool = False
) -> float:
    halves = [range(samples // 2), range(samples // 2, samples)]
    counts = sum(
        pool.map(_counts, [shape] * 2, [workers] * 2, [payload] * 2, halves, [shortcut] * 2),
        torch.zeros(V, V),
    )
    return pooled_chisquare(counts.flatten(), _target_joint(WORKERS[workers]).flatten() * samples)


@pytest.mark.parametrize("shape, workers, payload", CELLS)
def test_a_chain_of_fixed_children_follows_the_target(
    processes: Executor, shape: str, workers: str, payload: str
) -> None:
    assert _pvalue(processes, shape, workers, payload, SAMPLES) > SIGNIFICANCE


@pytest.mark.parametrize(
    "workers", [w if w == "2 workers 0.7/0.3" else pytest.param(w, marks=FULL_STATISTICS) for w in WORKERS]
)
def test_negative_control_the_chain_shortcut_is_rejected(workers: str) -> None:
    """Issue 32's bug put back (in fresh processes, which end with the test): rejected."""
    with seed_pool(fresh=True) as pool:
        assert _pvalue(pool, "nodes 1", workers, "exact, draft top-3", 1_000, shortcut=True) < SIGNIFICANCE
