"""Mode ``tree`` through the real engine, draft and worker code over Markov fakes (docs/design.md §3.6):
the first two emitted tokens follow the target for each child rule, with one and three weighted
workers; TSLT's Algorithm 5 applied to fixed children is rejected by the same test; greedy
follows the mixture's argmax. The chi-squares run with SPECGATE_FULL_STATISTICS=1: the default
run proves the same law exactly, cell by cell (tests/app/test_lossless_matrix.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import Executor

import pytest
import torch

from app.engine import Engine, GenerationRequest, SpecOptions
from core.math import walk as tree_math
from core.math.sampling import SamplingParams
from core.math.shapes import ChildRule, TreeShape
from core.names import Mode, Reconstruction
from tests.app.fakes import MarkovRunner, make_engine
from tests.app.helpers import FULL_STATISTICS, seed_pool
from tests.app.test_engine import DRAFT, PROMPT, TARGETS, WEIGHTS_3, V, _target_joint, pooled_chisquare

SAMPLES = 20_000
SIGNIFICANCE = 1e-3  # chi-square rejects below this p-value; seeds are fixed

SHAPES = {
    "sampled ⟨2,2⟩": TreeShape(ChildRule.SAMPLED, widths=(2, 2)),
    "sampled without replacement ⟨3,2⟩": TreeShape(ChildRule.SAMPLED_DISTINCT, widths=(3, 2)),
    "fixed (EAGLE-2, 5 nodes)": TreeShape(ChildRule.FIXED, nodes=5, depth=2, top_k=2),
}
WORKERS = {"1 worker": [(TARGETS[0], 1.0)], "3 weighted workers": list(zip(TARGETS, WEIGHTS_3))}


# exact: q̂ truncated, mass off S_v
PAYLOADS = {"aggregate k: full": Mode.AGGREGATE, "exact, draft top-3": Mode.EXACT}


def _spec(shape: TreeShape, payload: Mode = Mode.AGGREGATE) -> SpecOptions:
    top_k = 3 if payload is Mode.EXACT else 0
    return SpecOptions(
        mode=Mode.TREE,
        num_draft_tokens=1,
        k=None,
        reconstruction=Reconstruction.RENORMALIZE,
        draft_top_k=top_k,
        tree=shape,
        tree_payload=payload,
    )


def _first_two(
    engine: Engine,
    shape: TreeShape,
    num: int | range,
    temperature: float = 1.0,
    payload: Mode = Mode.AGGREGATE,
) -> torch.Tensor:
    """Counts [V, V] of the first two tokens over ``num`` seeds (max_tokens 3: a depth-2 tree)."""
    spec = _spec(shape, payload)
    seeds = range(num) if isinstance(num, int) else num

    async def run() -> torch.Tensor:
        counts = torch.zeros(V, V)
        for seed in seeds:
            req = GenerationRequest(
                request_id=f"r{seed}",
                prompt=PROMPT,
                max_tokens=3,
                params=SamplingParams(temperature=temperature),
                seed=seed,
                choice=0,
                spec=spec,
            )
            tokens: list[int] = []
            rounds = engine.generate(req)
            async for result in rounds:
                tokens += result.tokens
                if len(tokens) >= 2:
                    break
            await rounds.aclose()  # frees the sessions, as a client that stops reading
            counts[tokens[0], tokens[1]] += 1
        return counts

    return asyncio.run(run())


def _counts(shape: str, workers: str, seeds: range, payload: str) -> torch.Tensor:
    """One process's share of a chi-square run: a fresh engine over the seeds given."""
    return _first_two(make_engine(DRAFT, WORKERS[workers]), SHAPES[shape], seeds, payload=PAYLOADS[payload])


@pytest.fixture(scope="module")
def processes() -> Iterator[Executor]:
    """Two processes: the seeds of a run split between the machine's two cores (the counts
    are the same as in one process: every draw is keyed by its seed)."""
    with seed_pool() as pool:
        yield pool


# Every shape through one and three weighted workers, and exact's payload with the default tree
# at T > 0 (children without replacement): the real random streams, with
# SPECGATE_FULL_STATISTICS=1. The default run proves every rule, shape and payload exactly
# (tests/app/test_lossless_matrix.py) and runs fixed chains this way (tests/app/test_fixed_chains.py).
RUNS = [(shape, workers, "aggregate k: full") for shape in SHAPES for workers in WORKERS] + [
    ("sampled without replacement ⟨3,2⟩", "3 weighted workers", "exact, draft top-3")
]


@FULL_STATISTICS
@pytest.mark.parametrize("shape, workers, payload", RUNS)
def test_first_two_tokens_follow_the_target(
    shape: str, workers: str, payload: str, processes: Executor
) -> None:
    half = SAMPLES // 2
    parts = processes.map(
        _counts, [shape, shape], [workers, workers], [range(half), range(half, SAMPLES)], [payload, payload]
    )
    counts = sum(parts, torch.zeros(V, V))
    assert (
        pooled_chisquare(counts.flatten(), _target_joint(WORKERS[workers]).flatten() * SAMPLES) > SIGNIFICANCE
    )


def _algorithm_5_counts(seeds: range) -> torch.Tensor:
    """In a pool process: fixed (top-k) children verified with the sampled rule (TSLT's
    Algorithm 5), through one worker."""
    original = tree_math.try_children
    tree_math.try_children = lambda p, q, candidates, rule, *rest: original(
        p, q, candidates, ChildRule.SAMPLED, *rest
    )  # type: ignore[assignment]
    return _first_two(make_engine(DRAFT, WORKERS["1 worker"]), SHAPES["fixed (EAGLE-2, 5 nodes)"], seeds)


@FULL_STATISTICS
def test_negative_control_algorithm_5_on_fixed_children_is_rejected() -> None:
    """Fixed children verified with the sampled rule are biased: rejected. (Fresh processes: the
    break dies with them.)"""
    num = SAMPLES // 4
    with seed_pool(fresh=True) as pool:
        counts = sum(
            pool.map(_algorithm_5_counts, [range(num // 2), range(num // 2, num)]), torch.zeros(V, V)
        )
    assert (
        pooled_chisquare(counts.flatten(), _target_joint(WORKERS["1 worker"]).flatten() * num) < SIGNIFICANCE
    )


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_is_the_mixture_argmax(shape: str, payload: str) -> None:
    workers = WORKERS["3 weighted workers"]
    engine = make_engine(DRAFT, workers)
    w = torch.tensor(WEIGHTS_3, dtype=torch.float64)
    expected, last = [], PROMPT[-1]
    for _ in range(6):
        last = int(torch.argmax(sum(wn * r.next_probs(last) for (r, _), wn in zip(workers, w / w.sum()))))  # type: ignore[arg-type]
        expected.append(last)

    async def run() -> list[int]:
        req = GenerationRequest(
            request_id="g",
            prompt=PROMPT,
            max_tokens=6,
            params=SamplingParams(temperature=0.0),
            seed=0,
            choice=0,
            spec=_spec(SHAPES[shape], PAYLOADS[payload]),
        )
        return [t async for r in engine.generate(req) for t in r.tokens]

    assert asyncio.run(run()) == expected


def test_a_tree_round_tells_workers_the_parents_and_the_next_call_the_path() -> None:
    runner = MarkovRunner(TARGETS[0].table, name="t")
    engine = make_engine(DRAFT, [(runner, 1.0)])

    async def run() -> list[int]:
        req = GenerationRequest(
            request_id="p",
            prompt=PROMPT,
            max_tokens=12,
            params=SamplingParams(temperature=1.0),
            seed=5,
            choice=0,
            spec=_spec(SHAPES["sampled ⟨2,2⟩"]),
        )
        return [t async for r in engine.generate(req) for t in r.tokens]

    text = asyncio.run(run())
    calls = engine.pool.workers[0].calls  # type: ignore[attr-defined]
    assert len(calls) >= 3 and all(
        c.parents is not None and len(c.parents) == len(c.draft) for c in calls[:-1]
    )
    sequence, paths = PROMPT + text, 0
    for before, after in zip(calls, calls[1:]):
        # v1.1: the accepted nodes end the next call's prefix, named by ``path``: only the
        # recovered or bonus token is sent again
        path = [] if after.path is None else after.path.tolist()
        assert len(after.tokens) == 1 and after.prefix_len == before.prefix_len + len(before.tokens) + len(
            path
        )
        assert [before.parents[n] for n in path] == [-1, *path][: len(path)]
        assert [before.draft[n] for n in path] == sequence[
            before.prefix_len + len(before.tokens) : after.prefix_len
        ]
        paths += bool(path)
    assert paths >= 2


def test_a_worker_that_lost_the_tree_gets_the_path_as_tokens_and_the_text_is_the_same() -> None:
    """A 409 on a call with ``path`` resends from what the worker holds, the path's tokens
    among the tokens (``dataclasses.replace`` drops ``path``): the seeded text does not change."""

    def run(engine: Engine, forget: bool) -> list[int]:
        async def go() -> list[int]:
            req = GenerationRequest(
                request_id="lost",
                prompt=PROMPT,
                max_tokens=12,
                params=SamplingParams(temperature=1.0),
                seed=5,
                choice=0,
                spec=_spec(SHAPES["sampled ⟨2,2⟩"]),
            )
            out: list[int] = []
            async for result in engine.generate(req):
                out += result.tokens
                if forget:
                    engine.pool.workers[0].state.sessions.free("lost-0")  # type: ignore[attr-defined]
            return out

        return asyncio.run(go())

    expected = run(make_engine(DRAFT, [(MarkovRunner(TARGETS[0].table, name="t"), 1.0)]), forget=False)
    engine = make_engine(DRAFT, [(MarkovRunner(TARGETS[0].table, name="t"), 1.0)])
    assert run(engine, forget=True) == expected
    sequence, calls = PROMPT + expected, engine.pool.workers[0].calls  # type: ignore[attr-defined]
    lost = [(a, b) for a, b in zip(calls, calls[1:]) if a.path is not None]
    assert len(lost) >= 2
    for refused, resent in lost:  # the resend: from zero, every agreed token (the path's too) as tokens
        assert resent.prefix_len == 0 and resent.path is None and resent.parents is not None
        assert resent.tokens.tolist() == sequence[: refused.prefix_len + len(refused.tokens)]
