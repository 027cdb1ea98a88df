"""Mode ``pipeline`` through the real engine, draft, PipelineTarget bookkeeping and stage worker
code over Markov fakes split into stages (docs/design.md §3.7): the first two emitted tokens follow the
target (lossless) while segments are in flight, pruned and expanded; a walk that draws the
recovered token from p instead of p' (the rejected children not zeroed) is rejected by the same
test; greedy follows the target's argmax; a stage that loses the session makes it start again
with the same output; the stages free the session at the end. The chi-square and its negative
control run with SPECGATE_FULL_STATISTICS=1: the default run proves the same law exactly
(tests/app/test_lossless_matrix.py, with the same negative control)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from app.engine import Engine, GenerationRequest, SpecOptions
from app.engine.strategies import pipeline as pipeline_strategy
from core.math.sampling import SamplingParams
from core.math.shapes import ChildRule, SegmentSchedule, TreeShape
from core.names import Mode, Reconstruction
from tests.app.fakes import FakePipeline, pipeline_engine, split_pipeline
from tests.app.helpers import FULL_STATISTICS, seed_pool
from tests.app.test_engine import DRAFT, PROMPT, TARGETS, V, _target_joint, pooled_chisquare

SAMPLES = 20_000
SIGNIFICANCE = 1e-3
TARGET = TARGETS[0]
# small enough that the first two tokens cross segments, prunes and expansions: 3 nodes a
# round, segments of 2, two in flight, expansion below the best live leaf
SCHEDULE = SegmentSchedule(TreeShape(ChildRule.FIXED, nodes=3, depth=2, top_k=2), segment=2, in_flight=2)


def _spec(schedule: SegmentSchedule = SCHEDULE) -> SpecOptions:
    return SpecOptions(
        mode=Mode.PIPELINE,
        num_draft_tokens=1,
        k=None,
        reconstruction=Reconstruction.RENORMALIZE,
        pipeline=schedule,
    )


async def _tokens(
    engine: Engine, seed: int, max_tokens: int, temperature: float = 1.0, schedule: SegmentSchedule = SCHEDULE
) -> list[int]:
    req = GenerationRequest(
        request_id=f"r{seed}",
        prompt=PROMPT,
        max_tokens=max_tokens,
        params=SamplingParams(temperature=temperature),
        seed=seed,
        choice=0,
        spec=_spec(schedule),
    )
    return [t async for result in engine.generate(req) for t in result.tokens]


def _first_two(seeds: range) -> torch.Tensor:
    """Counts [V, V] of the first two tokens over ``seeds``, through three stages."""
    engine = pipeline_engine(DRAFT, split_pipeline(TARGET.table, [1, 2], 3))

    async def run() -> torch.Tensor:
        counts = torch.zeros(V, V)
        for seed in seeds:
            tokens = await _tokens(engine, seed, 3)
            counts[tokens[0], tokens[1]] += 1
        return counts

    return asyncio.run(run())


def _without_zeroing(seeds: range) -> torch.Tensor:
    """In a pool process: the walk draws the recovered token from p, not from p' (the children
    it rejected keep their mass)."""
    original = pipeline_strategy.try_children

    def broken(
        p: torch.Tensor, q: torch.Tensor, candidates: list[int], rule: ChildRule, u: torch.Tensor
    ) -> tuple[int | None, torch.Tensor]:
        rank, _ = original(p, q, candidates, rule, u)
        return rank, p.double()

    pipeline_strategy.try_children = broken  # type: ignore[assignment]
    return _first_two(seeds)


def _pooled(function: object, num: int) -> torch.Tensor:
    """``function`` over ``num`` seeds split between two fresh processes (a break dies with them)."""
    with seed_pool(fresh=True) as pool:
        return sum(pool.map(function, [range(num // 2), range(num // 2, num)]), torch.zeros(V, V))  # type: ignore[arg-type]


@FULL_STATISTICS
def test_first_two_tokens_follow_the_target() -> None:
    counts = _pooled(_first_two, SAMPLES)
    assert (
        pooled_chisquare(counts.flatten(), _target_joint([(TARGET, 1.0)]).flatten() * SAMPLES) > SIGNIFICANCE
    )


@FULL_STATISTICS
def test_negative_control_residual_without_zeroing_is_rejected() -> None:
    num = SAMPLES // 4
    counts = _pooled(_without_zeroing, num)
    assert pooled_chisquare(counts.flatten(), _target_joint([(TARGET, 1.0)]).flatten() * num) < SIGNIFICANCE


def _argmax_chain(n: int) -> list[int]:
    out, last = [], PROMPT[-1]
    for _ in range(n):
        last = int(torch.argmax(TARGET.table[last]))
        out.append(last)
    return out


def test_greedy_follows_the_target_argmax_with_two_and_three_stages() -> None:
    for cuts in ([2], [1, 2]):
        engine = pipeline_engine(DRAFT, split_pipeline(TARGET.table, cuts, 3))
        assert asyncio.run(_tokens(engine, 0, 12, temperature=0.0)) == _argmax_chain(12)


def test_greedy_asks_the_last_stage_for_the_top_k_only_and_reports_the_full_rows_logprobs() -> None:
    """T = 0 decides by the argmax and reports n alternatives: the last stage sends the top
    max(1, n) of each row, not the whole vocabulary, and the tokens and logprobs are those of the
    full rows. Sampling (T > 0) needs the whole row (the residual) and asks for it."""
    pipe = split_pipeline(TARGET.table, [1, 2], 3)
    req = GenerationRequest(
        request_id="g",
        prompt=PROMPT,
        max_tokens=8,
        params=SamplingParams(temperature=0.0),
        seed=0,
        choice=0,
        spec=_spec(),
        top_logprobs=2,
    )

    async def run() -> list[Any]:
        return [
            lp async for result in pipeline_engine(DRAFT, pipe).generate(req) for lp in result.logprobs or []
        ]

    logprobs = asyncio.run(run())
    assert [lp.token for lp in logprobs] == _argmax_chain(8)
    assert set(pipe.asked_k) == {2}
    last = PROMPT[-1]
    for lp in logprobs:
        # T(p) at T = 0: the softmax of the "logits"
        full = torch.log_softmax(TARGET.table[last].double(), dim=-1)
        assert lp.logprob == pytest.approx(float(full[lp.token]), abs=1e-6)
        top = torch.topk(full, 2)
        assert lp.top is not None and [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-6)
        last = lp.token
    sampled = split_pipeline(TARGET.table, [1, 2], 3)
    asyncio.run(_tokens(pipeline_engine(DRAFT, sampled), 0, 4))
    assert set(sampled.asked_k) == {None}


def test_segments_are_pruned_and_expanded_and_the_stages_free_the_session() -> None:
    pipe = split_pipeline(TARGET.table, [1, 2], 3)
    tokens = asyncio.run(_tokens(pipeline_engine(DRAFT, pipe), 7, 16))
    assert len(tokens) == 16
    assert any(s.keep is not None for s in pipe.segments), "no segment pruned the stages' rows"
    # a segment: its nodes (+ a new round's token)
    assert max(len(s.tokens) for s in pipe.segments[1:]) <= SCHEDULE.segment + 1
    assert len(pipe.segments) > 16 // 3, "the tree was not expanded or the rounds were not pipelined"
    assert pipe.freed == ["r7-0"]
    assert all(s.runner.length("r7-0") == 0 for s in pipe.states)


def test_a_stage_that_loses_the_session_gives_the_same_output() -> None:
    """409 at the third segment: the session starts again under a new id, every live row is
    resent, and the tokens are those of the run without the loss (the seed decides them)."""
    clean = asyncio.run(_tokens(pipeline_engine(DRAFT, split_pipeline(TARGET.table, [1, 2], 3)), 3, 14))
    lossy: FakePipeline = split_pipeline(TARGET.table, [1, 2], 3)
    lossy.short_at = {2}
    assert asyncio.run(_tokens(pipeline_engine(DRAFT, lossy), 3, 14)) == clean
    assert lossy.restarts == 1 and any(s.prefix_len == 0 for s in lossy.segments[3:])  # resent from zero


def test_the_same_seed_gives_the_same_tokens() -> None:
    engine = pipeline_engine(DRAFT, split_pipeline(TARGET.table, [1, 2], 3))
    assert asyncio.run(_tokens(engine, 11, 20)) == asyncio.run(_tokens(engine, 11, 20))


def test_the_fake_pipeline_is_built_as_a_real_one() -> None:
    """Issue 63: FakePipeline gave PipelineTarget a URL per stage where it takes each stage's replicas (a list
    per stage): each URL's characters became replicas. One replica per stage, at its own URL."""
    pipe = split_pipeline(TARGET.table, [1, 2], 3)
    assert [[replica.url for replica in stage] for stage in pipe.members] == [
        ["http://stage0:1"],
        ["http://stage1:1"],
        ["http://stage2:1"],
    ]
