"""A late draft (issue 49, app.engine.late): while the draft prefills a long prompt the rounds carry no draft
and the targets sample their token; a seeded request takes exactly ``draft_after`` such rounds whatever the
timing, an unseeded one goes on without the draft until it is ready. Its law, with a draft ready after k
rounds, is proven exactly by the lossless matrix; here the timing-driven path (unseeded) by a chi-square with
its control, and the rules by a draft whose prefill is held."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import Executor
from contextlib import aclosing

import pytest
import torch

from app.engine import Engine, GenerationRequest, RoundResult, SpecOptions
from app.engine import loop as loop_module
from app.engine.round import Round
from app.engine.spec import DraftTally
from app.engine.strategies import STRATEGIES, RoundStrategy
from app.targets.channel import Traffic
from app.usage import Usage
from core.math.random import Purpose, sample_index, uniform
from core.math.sampling import SamplingParams
from core.names import Mode, Reconstruction
from tests.app.fakes import MarkovRunner, make_engine, random_table
from tests.app.helpers import FULL_STATISTICS, seed_pool
from tests.app.test_engine import pooled_chisquare

V = 6
PROMPT = [3, 1]
SAMPLES = 4_000  # the control: p ≈ 1e-200 at 4,000
SIGNIFICANCE = 1e-3
DRAFT = MarkovRunner(random_table(V, 100), name="draft")
TARGETS = [MarkovRunner(random_table(V, 200 + i), name=f"t{i}") for i in range(3)]
WORKERS = list(zip(TARGETS, [0.5, 0.3, 0.2]))
SPEC = SpecOptions(
    mode=Mode.EXACT, num_draft_tokens=3, k=None, reconstruction=Reconstruction.RENORMALIZE, draft_top_k=3
)


def _request(
    seed: int, seeded: bool = False, max_tokens: int = 2, draft_after: int = 1, spec: SpecOptions = SPEC
) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"r{seed}",
        prompt=PROMPT,
        max_tokens=max_tokens,
        params=SamplingParams(temperature=1.0),
        seed=seed,
        choice=0,
        spec=spec,
        seeded=seeded,
        draft_after=draft_after,
    )


async def _results(engine: Engine, req: GenerationRequest) -> list[RoundResult]:
    return [result async for result in engine.generate(req)]


def _target_joint() -> torch.Tensor:
    """p(a, b) of the first two tokens, p = Σ w_n p_n at each position."""

    def mix(last: int) -> torch.Tensor:
        return sum(w * r.next_probs(last) for r, w in WORKERS)  # type: ignore[return-value]

    first = mix(PROMPT[-1])
    return torch.stack([first[a] * mix(a) for a in range(V)])


class _DraftsTheWaitingRound(RoundStrategy):
    """The broken variant: a round without a draft emits the draft's own sample, the targets not asked — the
    shortcut of a first token from the draft while the targets prefill."""

    def __init__(self, inner: RoundStrategy) -> None:
        self.inner = inner

    async def verify(self, rnd: Round) -> RoundResult:
        if len(rnd.draft):
            return await self.inner.verify(rnd)
        q = DRAFT.next_probs(rnd.sequence[-1])
        return RoundResult(
            [sample_index(q, uniform(rnd.req.seed, rnd.req.choice, len(rnd.sequence), Purpose.BONUS))],
            0,
            0,
            Traffic(),
        )


def _counts(seeds: range, broken: bool) -> tuple[torch.Tensor, int]:
    """In a pool process: counts of the first two tokens of unseeded requests whose draft is late, and the
    rounds that carried no draft."""
    if broken:
        STRATEGIES[SPEC.verifier] = _DraftsTheWaitingRound(STRATEGIES[SPEC.verifier])  # type: ignore[arg-type]
        loop_module.STRATEGIES[SPEC.verifier] = STRATEGIES[SPEC.verifier]
    engine = make_engine(DRAFT, WORKERS)

    async def run() -> list[list[RoundResult]]:
        return [await _results(engine, _request(seed)) for seed in seeds]

    counts, waited = torch.zeros(V, V), 0
    for results in asyncio.run(run()):
        tokens = [t for r in results for t in r.tokens]
        counts[tokens[0], tokens[1]] += 1
        waited += sum(r.drafting.without_draft for r in results)
    return counts, waited


@pytest.fixture(scope="module")
def processes() -> Iterator[Executor]:
    with seed_pool() as pool:
        yield pool


def _p_value(pool: Executor, broken: bool) -> float:
    parts = list(pool.map(_counts, [range(SAMPLES // 2), range(SAMPLES // 2, SAMPLES)], [broken, broken]))
    counts = sum((c for c, _ in parts), torch.zeros(V, V))
    assert sum(w for _, w in parts) >= SAMPLES  # every request's first round waited for its draft
    return pooled_chisquare(counts.flatten(), _target_joint().flatten() * SAMPLES)


def test_unseeded_requests_with_a_late_draft_follow_the_target(processes: Executor) -> None:
    assert _p_value(processes, broken=False) > SIGNIFICANCE


@FULL_STATISTICS
def test_negative_control_a_first_token_from_the_draft_is_rejected() -> None:
    with seed_pool(fresh=True) as pool:  # the patch ends with its processes
        assert _p_value(pool, broken=True) < SIGNIFICANCE


class _Held:
    """The draft's prefill waits for ``ready`` (set by the test): a draft that is slow to prefill."""

    def __init__(self, engine: Engine) -> None:
        self.ready = asyncio.Event()
        prefill = engine.draft.prefill

        async def held(session_id: str, sequence: list[int]) -> None:
            await self.ready.wait()
            await prefill(session_id, sequence)

        engine.draft.prefill = held  # type: ignore[method-assign]


def test_an_unseeded_request_goes_on_without_the_draft_until_it_is_ready() -> None:
    async def run() -> list[int]:
        engine = make_engine(DRAFT, WORKERS)
        held, flags = _Held(engine), []
        async for result in engine.generate(_request(1, max_tokens=40)):
            flags.append(result.drafting.without_draft)
            if len(flags) == 3:
                held.ready.set()
        return flags

    flags = asyncio.run(run())
    assert flags[:3] == [1, 1, 1]  # the prefill held: no draft
    assert 1 not in flags[5:] and len(flags) > 5  # released: drafts again within a round or two


@pytest.mark.parametrize(("draft_after", "wait"), [(1, False), (2, False), (1, True)])
def test_a_seeded_request_takes_its_rounds_without_a_draft_whatever_the_timing(
    draft_after: int, wait: bool
) -> None:
    async def run(delay: float) -> tuple[list[int], list[int]]:
        engine = make_engine(DRAFT, WORKERS)
        engine.prefill_waits = wait
        held = _Held(engine)
        asyncio.get_running_loop().call_later(delay, held.ready.set)
        results = await _results(engine, _request(7, seeded=True, max_tokens=24, draft_after=draft_after))
        return [t for r in results for t in r.tokens], [r.drafting.without_draft for r in results]

    prompt_ready, late = asyncio.run(run(0.0)), asyncio.run(run(0.2))
    assert prompt_ready == late  # the text, and which rounds drafted
    assert late[1][:draft_after] == [1] * draft_after and 1 not in late[1][draft_after:]
    usage = Usage(SPEC, len(PROMPT))
    for flag in late[1]:
        usage.add(RoundResult([0], 0, 0, Traffic(), drafting=DraftTally(without_draft=flag)))
    assert usage.to_dict()["speculative"]["rounds_without_draft"] == draft_after


def test_a_request_that_stops_early_stops_the_prefill() -> None:
    async def run() -> bool:
        engine = make_engine(DRAFT, WORKERS)
        held = _Held(engine)
        async with aclosing(engine.generate(_request(3, max_tokens=40))) as results:
            async for _ in results:
                break  # the caller went away after the first round, the prefill still held
        held.ready.set()
        await asyncio.sleep(0)
        return engine.draft.runner.has_session("r3-0") or bool(engine.draft.batcher.busy)

    assert not asyncio.run(run())


@pytest.mark.parametrize(
    "spec",
    [
        SpecOptions(
            mode=Mode.AUTOREGRESSIVE, num_draft_tokens=3, k=None, reconstruction=Reconstruction.RENORMALIZE
        ),
        SPEC,
    ],
    ids=["autoregressive", "max_tokens 1"],
)
def test_nothing_waits_where_nothing_drafts(spec: SpecOptions) -> None:
    engine = make_engine(DRAFT, WORKERS)
    max_tokens = 1 if spec.mode is Mode.EXACT else 6
    results = asyncio.run(_results(engine, _request(5, seeded=True, max_tokens=max_tokens, spec=spec)))
    assert all(r.drafting.without_draft == 0 for r in results)


@pytest.mark.parametrize(
    ("wait", "seeded", "started"),
    [(False, False, [0]), (True, False, [1]), (False, True, [0]), (True, True, [])],
)
def test_the_prefill_starts_beside_the_first_round_or_after_it(
    wait: bool, seeded: bool, started: list[int]
) -> None:
    """``prefill_waits`` (``draft.background_prefill_wait``, set where the draft and the workers share cores):
    the draft's prefill starts once the first round is done, not beside it — and not at all where the next
    round drafts anyway (seeded, one round without a draft): that draft prefills in its place."""

    async def run() -> list[int]:
        engine = make_engine(DRAFT, WORKERS)
        engine.prefill_waits = wait
        results: list[RoundResult] = []
        calls: list[int] = []
        prefill = engine.draft.prefill

        async def spy(session_id: str, sequence: list[int]) -> None:
            calls.append(len(results))
            await prefill(session_id, sequence)

        engine.draft.prefill = spy  # type: ignore[method-assign]
        async for result in engine.generate(_request(2, seeded=seeded, max_tokens=12)):
            results.append(result)
        assert results[0].drafting.without_draft == 1 and (
            not seeded or sum(r.drafting.without_draft for r in results) == 1
        )
        return calls

    assert asyncio.run(run()) == started
