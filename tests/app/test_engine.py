"""The engine end to end over small vocabularies: the output law of `autoregressive` and
`aggregate` (chi-square on the first two tokens, N = 1 and N = 3 weighted workers), acceptance,
greedy, seeds, EOS and limits. Draft and workers are Markov chains behind the real DraftModel,
worker state and scoring code. The exact law of every mode × option is proven in the default run
by tests/app/test_lossless_matrix.py; the chi-squares here run the real random streams, a few
cases by default and every case (and their negative controls) with SPECGATE_FULL_STATISTICS=1."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import replace

import pytest
import torch
from scipy import stats

from app.engine import Engine, GenerationRequest, SpecOptions
from core.math import walk as tree
from core.math.relaxed import Relaxation
from core.math.sampling import SamplingParams, truncate
from core.names import Mode, Reconstruction
from core.transform import TransformSpec
from tests.app.fakes import MarkovRunner, make_engine, random_table
from tests.app.helpers import FULL_STATISTICS, seed_pool

V = 6
PROMPT = [3, 1]
# a broken residual gives p ≈ 1e-52 at 4,000, 3e-28 at 2,500: power to spare
SAMPLES = 10_000 if os.environ.get("SPECGATE_FULL_STATISTICS") else 2_500
SIGNIFICANCE = 1e-3  # chi-square rejects below this p-value; seeds are fixed

DRAFT = MarkovRunner(random_table(V, 100), name="draft")
TARGETS = [MarkovRunner(random_table(V, 200 + i), name=f"t{i}") for i in range(3)]
WEIGHTS_3 = [0.5, 0.3, 0.2]


def _spec(
    mode: Mode, gamma: int = 3, k: int | None = None, draft_top_k: int = 0, draft_top_p: float = 1.0
) -> SpecOptions:
    if mode is Mode.EXACT and not draft_top_k and draft_top_p == 1:
        draft_top_k = 3
    return SpecOptions(
        mode=mode,
        num_draft_tokens=gamma,
        k=k,
        reconstruction=Reconstruction.RENORMALIZE,
        draft_top_k=draft_top_k,
        draft_top_p=draft_top_p,
    )


def _request(
    seed: int, spec: SpecOptions, max_tokens: int = 2, temperature: float = 1.0, choice: int = 0
) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"r{seed}",
        prompt=PROMPT,
        max_tokens=max_tokens,
        params=SamplingParams(temperature=temperature),
        seed=seed,
        choice=choice,
        spec=spec,
    )


async def _tokens(engine: Engine, req: GenerationRequest) -> tuple[list[int], int, int]:
    tokens, drafted, first_accepted = [], 0, -1
    async for result in engine.generate(req):
        if first_accepted < 0 and result.drafted:
            first_accepted = int(result.accepted > 0)
        tokens += result.tokens
        drafted += result.drafted
    return tokens, drafted, first_accepted


def _target_joint(workers: list[tuple[MarkovRunner, float]], temperature: float = 1.0) -> torch.Tensor:
    """p(a, b) = p(a | prompt) p(b | a) with p = Σ w_n T(p_n) at each position."""
    w = torch.tensor([x for _, x in workers], dtype=torch.float64)
    w /= w.sum()

    def mix(last: int) -> torch.Tensor:
        return sum(wn * r.next_probs(last, temperature) for (r, _), wn in zip(workers, w))  # type: ignore[return-value]

    first = mix(PROMPT[-1])
    return torch.stack([first[a] * mix(a) for a in range(V)])  # [V, V]


def pooled_chisquare(observed: torch.Tensor, expected: torch.Tensor, min_expected: float = 5.0) -> float:
    """Chi-square p-value with the cells expected fewer than 5 times pooled into one: a cell
    expected 0.06 times that is hit once adds 15 to the statistic, which the chi-square law
    does not allow for (at 4,000 draws the rare first token here made p ≈ 1e-4 by chance)."""
    if bool((observed[expected == 0] > 0).any()):
        return 0.0  # an outcome the target rules out
    observed, expected = observed[expected > 0], expected[expected > 0]
    small = expected < min_expected
    obs = torch.cat([observed[~small], observed[small].sum()[None]]) if small.any() else observed
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    return float(
        stats.chisquare(obs.double().numpy(), exp.double().numpy() * float(obs.sum() / exp.sum())).pvalue
    )


CASES = {
    "split, full p": (Mode.SPLIT, [(TARGETS[0], 1.0)]),
    "exact, 3 weighted workers, draft top-3": (Mode.EXACT, list(zip(TARGETS, WEIGHTS_3))),
    "autoregressive, 1 worker": (Mode.AUTOREGRESSIVE, [(TARGETS[0], 1.0)]),
    "autoregressive, 3 weighted workers": (Mode.AUTOREGRESSIVE, list(zip(TARGETS, WEIGHTS_3))),
    "aggregate k full, 1 worker": (Mode.AGGREGATE, [(TARGETS[0], 1.0)]),
    "aggregate k full, 3 weighted workers": (Mode.AGGREGATE, list(zip(TARGETS, WEIGHTS_3))),
}


def _case_counts(case: str, seeds: range) -> tuple[torch.Tensor, int, int]:
    """One process's share of a case's run: counts [V, V] of the first two tokens, and how many
    first draft tokens were accepted out of how many rounds drafted."""
    mode, workers = CASES[case]
    engine, spec = make_engine(DRAFT, workers), _spec(mode)

    async def run() -> list[tuple[list[int], int, int]]:
        return [await _tokens(engine, _request(seed, spec)) for seed in seeds]

    counts = torch.zeros(V, V)
    draws = asyncio.run(run())
    for tokens, _, _ in draws:
        counts[tokens[0], tokens[1]] += 1
    firsts = [f for _, _, f in draws if f >= 0]
    return counts, sum(firsts), len(firsts)


@pytest.fixture(scope="module")
def processes() -> Iterator[Executor]:
    """Two processes: a run's seeds split between the machine's two cores (every draw is keyed
    by its seed, so the counts are those of one process)."""
    with seed_pool() as pool:
        yield pool


def _halves(samples: int) -> list[range]:
    """A run's seeds, one half per pool process."""
    return [range(samples // 2), range(samples // 2, samples)]


# the rest: SPECGATE_FULL_STATISTICS=1
DEFAULT_RUN = {"split, full p", "exact, 3 weighted workers, draft top-3"}


@pytest.mark.parametrize(
    "case", [c if c in DEFAULT_RUN else pytest.param(c, marks=FULL_STATISTICS) for c in CASES]
)
def test_first_two_tokens_follow_the_target(case: str, processes: Executor) -> None:
    mode, workers = CASES[case]
    half = SAMPLES // 2
    parts = list(processes.map(_case_counts, [case, case], [range(half), range(half, SAMPLES)]))
    counts = sum((c for c, _, _ in parts), torch.zeros(V, V))
    first_accept = sum(a for _, a, _ in parts) / max(sum(n for _, _, n in parts), 1)
    assert pooled_chisquare(counts.flatten(), _target_joint(workers).flatten() * SAMPLES) > SIGNIFICANCE
    if mode is not Mode.AUTOREGRESSIVE:
        # the first draft token is accepted at rate β = Σ min(p, q̂): a verifier that ignored
        # the draft would pass the chi-square test but not this
        p = _target_joint(workers).sum(dim=1)
        q = DRAFT.next_probs(PROMPT[-1])
        if mode is Mode.EXACT:
            q = truncate(q, 3)
        beta = float(torch.minimum(p, q).sum())
        assert first_accept == pytest.approx(beta, abs=4 * (0.25 / SAMPLES) ** 0.5)


def _without_residual_counts(seeds: range) -> torch.Tensor:
    """The classic bug (resample from p, not norm(max(0, p − q)), at a rejection), in a pool
    process: counts of the first two tokens, aggregate through one worker."""
    tree.residual = lambda p, q: p.double() / p.double().sum()  # type: ignore[assignment]  # aggregate verifies by the tree walk
    engine, spec = make_engine(DRAFT, [(TARGETS[0], 1.0)]), _spec(Mode.AGGREGATE)

    async def run() -> list[tuple[list[int], int, int]]:
        return [await _tokens(engine, _request(seed, spec)) for seed in seeds]

    counts = torch.zeros(V, V)
    for tokens, _, _ in asyncio.run(run()):
        counts[tokens[0], tokens[1]] += 1
    return counts


@FULL_STATISTICS
def test_negative_control_a_verifier_without_the_residual_is_rejected() -> None:
    """The same test as above, on a verifier without the residual: rejected (the patch lives in
    fresh pool processes, which end with the test)."""
    with seed_pool(fresh=True) as pool:
        counts = sum(pool.map(_without_residual_counts, _halves(SAMPLES)), torch.zeros(V, V))
    assert (
        pooled_chisquare(counts.flatten(), _target_joint([(TARGETS[0], 1.0)]).flatten() * SAMPLES)
        < SIGNIFICANCE
    )


def _greedy_chain(workers: list[tuple[MarkovRunner, float]], length: int) -> list[int]:
    w = torch.tensor([x for _, x in workers], dtype=torch.float64)
    w /= w.sum()
    seq = list(PROMPT)
    for _ in range(length):
        mix = sum(wn * torch.softmax(r.table[seq[-1]].float(), -1).double() for (r, _), wn in zip(workers, w))
        seq.append(int(torch.argmax(mix)))  # type: ignore[call-overload]
    return seq[len(PROMPT) :]


@pytest.mark.parametrize("num_workers", [1, 3])
def test_greedy_is_the_mixture_argmax_in_both_modes(num_workers: int) -> None:
    workers = list(zip(TARGETS, WEIGHTS_3))[:num_workers]
    expected = _greedy_chain(workers, 12)

    async def run(mode: Mode) -> list[int]:
        engine = make_engine(DRAFT, workers)
        tokens, _, _ = await _tokens(engine, _request(0, _spec(mode), max_tokens=12, temperature=0))
        return tokens

    for mode in (Mode.AUTOREGRESSIVE, Mode.AGGREGATE, Mode.EXACT) + (
        (Mode.SPLIT,) if num_workers == 1 else ()
    ):
        assert asyncio.run(run(mode)) == expected, mode


def test_greedy_follows_the_mixture_not_the_vote() -> None:
    # after token 0: workers 0 and 1 prefer token 1 by a hair, worker 2 is sure of token 2
    tables = [torch.full((V, V), -5.0, dtype=torch.float64) for _ in range(3)]
    for table in tables[:2]:
        table[:, 1], table[:, 2] = 2.0, 1.9
    tables[2][:, 2] = 9.0
    workers = [(MarkovRunner(t), 1.0) for t in tables]

    async def run(mode: Mode) -> list[int]:
        tokens, _, _ = await _tokens(
            make_engine(DRAFT, workers), _request(0, _spec(mode), max_tokens=3, temperature=0)
        )
        return tokens

    assert asyncio.run(run(Mode.AUTOREGRESSIVE)) == [2, 2, 2]
    assert asyncio.run(run(Mode.AGGREGATE)) == [2, 2, 2]


def test_a_seed_reproduces_and_choices_differ() -> None:
    workers = list(zip(TARGETS, WEIGHTS_3))

    async def run(seed: int, choice: int) -> list[int]:
        tokens, _, _ = await _tokens(
            make_engine(DRAFT, workers), _request(seed, _spec(Mode.AGGREGATE), 30, choice=choice)
        )
        return tokens

    assert asyncio.run(run(7, 0)) == asyncio.run(run(7, 0))
    assert asyncio.run(run(7, 0)) != asyncio.run(run(7, 1))


def test_eos_ends_the_round_and_max_tokens_the_request() -> None:
    table = random_table(V, 5)
    table[:, 4] += 3.0  # token 4 (EOS here) is likely everywhere
    workers = [(MarkovRunner(table, eos_ids=[4]), 1.0)]
    engine = make_engine(DRAFT, workers, eos_ids=[4])

    async def run() -> None:
        for seed in range(30):
            results = [
                r async for r in engine.generate(_request(seed, _spec(Mode.AGGREGATE, 4), max_tokens=9))
            ]
            tokens = list(itertools.chain.from_iterable(r.tokens for r in results))
            assert len(tokens) <= 9
            if 4 in tokens:
                assert tokens.index(4) == len(tokens) - 1 and results[-1].finish_reason == "stop"
            else:
                assert len(tokens) == 9 and results[-1].finish_reason == "length"

    asyncio.run(run())


@pytest.mark.parametrize("mode", [Mode.AUTOREGRESSIVE, Mode.AGGREGATE, Mode.SPLIT, Mode.EXACT])
def test_ignore_eos_generates_past_a_sampled_eos(mode: Mode) -> None:
    """vLLM's ignore_eos: EOS is still drawn as the target says (same tokens as without it, up to
    the first EOS), it only does not end the answer; max_tokens does."""
    table = random_table(V, 5)
    table[:, 4] += 3.0  # token 4 (EOS here) is likely everywhere
    workers = [(MarkovRunner(table, eos_ids=[4]), 1.0)]

    async def run(seed: int, ignore_eos: bool) -> tuple[list[int], str | None]:
        engine = make_engine(DRAFT, workers, eos_ids=[4])
        base = _request(seed, _spec(mode, 3), max_tokens=12)
        req = GenerationRequest(
            request_id=base.request_id,
            prompt=base.prompt,
            max_tokens=base.max_tokens,
            params=base.params,
            seed=seed,
            choice=0,
            spec=base.spec,
            ignore_eos=ignore_eos,
        )
        results = [r async for r in engine.generate(req)]
        return list(itertools.chain.from_iterable(r.tokens for r in results)), results[-1].finish_reason

    past = 0
    for seed in range(10):
        stopped, reason = asyncio.run(run(seed, False))
        ignoring, ignoring_reason = asyncio.run(run(seed, True))
        assert len(ignoring) == 12 and ignoring_reason == "length" and ignoring[: len(stopped)] == stopped
        past += reason == "stop" and ignoring.count(4) >= 1
    assert past >= 5  # EOS was sampled and generation went on past it


# ----------------------------------------------------------------------------- min_tokens

EOS = 4
# EOS takes very different mass from each worker: the mixture without it must re-weigh them
EOS_TABLES = [random_table(V, 300 + i) for i in range(3)]
for _table, _boost in zip(EOS_TABLES, [3.0, 0.0, -2.0]):
    _table[:, EOS] += _boost
EOS_TARGETS = [MarkovRunner(t, eos_ids=[EOS], name=f"e{i}") for i, t in enumerate(EOS_TABLES)]
EOS_DRAFT = MarkovRunner(random_table(V, 100), eos_ids=[EOS], name="draft")
# workers without min_tokens: p = 0.0 (underflow) at 2,000
MIN_TOKENS_SAMPLES = 4_000 if os.environ.get("SPECGATE_FULL_STATISTICS") else 2_000


def _min_tokens_request(
    seed: int,
    spec: SpecOptions,
    min_tokens: int,
    max_tokens: int = 2,
    temperature: float = 1.0,
    ignore_eos: bool = False,
) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"r{seed}",
        prompt=PROMPT,
        max_tokens=max_tokens,
        params=SamplingParams(temperature=temperature),
        seed=seed,
        choice=0,
        spec=spec,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
    )


def _joint_without_eos_first(workers: list[tuple[MarkovRunner, float]]) -> torch.Tensor:
    """p(a, b) under min_tokens 1 in vLLM's order (issue 46): the first token from Σ w_n T(p_n)
    with EOS removed from each worker's logits before anything else — each p_n(· | not EOS)
    normalised alone, the federation mixing them with its weights —, then the target."""
    w = torch.tensor([x for _, x in workers], dtype=torch.float64)
    w /= w.sum()
    masked = [
        r.table[PROMPT[-1]].double().index_fill(0, torch.tensor([EOS]), float("-inf")) for r, _ in workers
    ]
    first = sum(
        (wn * torch.softmax(m, dim=-1) for m, wn in zip(masked, w)), torch.zeros(V, dtype=torch.float64)
    )
    then = _target_joint(workers) / _target_joint(workers).sum(dim=1, keepdim=True)  # p(b | a)
    return first[:, None] * then


MIN_TOKENS_CASES = {
    "autoregressive, 3 weighted workers": (Mode.AUTOREGRESSIVE, list(zip(EOS_TARGETS, WEIGHTS_3))),
    "aggregate k full, 3 weighted workers": (Mode.AGGREGATE, list(zip(EOS_TARGETS, WEIGHTS_3))),
    "split, 1 worker": (Mode.SPLIT, [(EOS_TARGETS[0], 1.0)]),
    "exact, 3 weighted workers, draft top-3": (Mode.EXACT, list(zip(EOS_TARGETS, WEIGHTS_3))),
}


def _min_tokens_counts(case: str, seeds: range, broken: bool = False) -> torch.Tensor:
    """One pool process's share: min_tokens 1 with γ = 3 (the round's first position is
    suppressed, the next ones not). ``broken``: the transform reaches the workers without
    min_tokens — the draft keeps EOS out, the targets do not (the negative control)."""
    if broken:
        real = TransformSpec.to_wire
        TransformSpec.to_wire = lambda self: real(replace(self, min_tokens=0))  # type: ignore[method-assign]
    mode, workers = MIN_TOKENS_CASES[case]
    engine = make_engine(EOS_DRAFT, workers, eos_ids=[EOS])

    async def run() -> list[list[int]]:
        return [(await _tokens(engine, _min_tokens_request(seed, _spec(mode), 1)))[0] for seed in seeds]

    counts = torch.zeros(V, V)
    for tokens in asyncio.run(run()):
        # an answer that ended at once (EOS first: what the target rules out)
        counts[tokens[0], tokens[1] if len(tokens) > 1 else EOS] += 1
    return counts


def _min_tokens_chi_square(pool: Executor, case: str, broken: bool = False) -> float:
    counts = sum(
        pool.map(_min_tokens_counts, [case, case], _halves(MIN_TOKENS_SAMPLES), [broken, broken]),
        torch.zeros(V, V),
    )
    return pooled_chisquare(
        counts.flatten(), _joint_without_eos_first(MIN_TOKENS_CASES[case][1]).flatten() * MIN_TOKENS_SAMPLES
    )


@pytest.mark.parametrize(
    "case", [c if c.startswith("exact") else pytest.param(c, marks=FULL_STATISTICS) for c in MIN_TOKENS_CASES]
)
def test_min_tokens_follows_the_target_without_eos(case: str, processes: Executor) -> None:
    """vLLM's min_tokens, lossless: before it the target is each worker's distribution with EOS
    removed from its logits first, mixed — Σ w_n p_n(· | not EOS) — and after it the mixture itself."""
    assert _min_tokens_chi_square(processes, case) > SIGNIFICANCE


@FULL_STATISTICS
def test_negative_control_min_tokens_the_workers_do_not_apply_is_rejected() -> None:
    """Workers that score without min_tokens (the transform sent without it) emit EOS where the
    target cannot: the same test rejects it."""
    with seed_pool(fresh=True) as pool:
        assert (
            _min_tokens_chi_square(pool, "exact, 3 weighted workers, draft top-3", broken=True) < SIGNIFICANCE
        )


@pytest.mark.parametrize("mode", [Mode.AUTOREGRESSIVE, Mode.AGGREGATE, Mode.SPLIT, Mode.EXACT, Mode.TREE])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_min_tokens_never_ends_before_its_count(mode: Mode, temperature: float) -> None:
    """EOS is likely everywhere here; no answer ends before min_tokens, and after it EOS may end it.
    With ignore_eos nothing is suppressed (as in vLLM): the tokens are those of ignore_eos alone."""
    table = random_table(V, 5)
    table[:, EOS] += 3.0
    workers = (
        [(MarkovRunner(table, eos_ids=[EOS]), 1.0)]
        if mode is Mode.SPLIT
        else list(zip([MarkovRunner(table, eos_ids=[EOS]), *EOS_TARGETS[1:]], WEIGHTS_3))
    )

    async def run(seed: int, min_tokens: int, ignore_eos: bool = False) -> tuple[list[int], str | None]:
        engine = make_engine(EOS_DRAFT, workers, eos_ids=[EOS])
        results = [
            r
            async for r in engine.generate(
                _min_tokens_request(seed, _spec(mode), min_tokens, 12, temperature, ignore_eos)
            )
        ]
        return list(itertools.chain.from_iterable(r.tokens for r in results)), results[-1].finish_reason

    stopped_after = 0
    for seed in range(8 if temperature else 1):
        tokens, reason = asyncio.run(run(seed, 5))
        assert len(tokens) >= 5 and EOS not in tokens[:5]
        assert reason == "length" or (reason == "stop" and tokens.index(EOS) == len(tokens) - 1)
        stopped_after += reason == "stop"
        assert asyncio.run(run(seed, 5, ignore_eos=True)) == asyncio.run(run(seed, 0, ignore_eos=True))
    assert stopped_after >= (4 if temperature else 1)  # EOS still ends answers once allowed


def test_greedy_min_tokens_is_the_argmax_without_eos() -> None:
    """T = 0: argmax Σ w_n softmax(l_n with EOS at −∞) (docs/design.md §3.9), each worker's row
    renormalised without EOS before the mixture."""
    table = random_table(V, 5)
    table[:, EOS] += 9.0  # EOS is every position's argmax
    workers = list(zip([MarkovRunner(table, eos_ids=[EOS]), *EOS_TARGETS[1:]], WEIGHTS_3))
    w = torch.tensor(WEIGHTS_3, dtype=torch.float64)
    w /= w.sum()
    seq = list(PROMPT)
    for _ in range(3):
        mix = sum(
            wn
            * torch.softmax(
                r.table[seq[-1]].float().index_fill(0, torch.tensor([EOS]), float("-inf")), -1
            ).double()
            for (r, _), wn in zip(workers, w)
        )
        seq.append(int(torch.argmax(mix)))  # type: ignore[call-overload]
    expected = seq[len(PROMPT) :] + [EOS]

    for mode in (Mode.AUTOREGRESSIVE, Mode.AGGREGATE, Mode.EXACT):
        engine = make_engine(EOS_DRAFT, workers, eos_ids=[EOS])
        tokens, _, _ = asyncio.run(_tokens(engine, _min_tokens_request(0, _spec(mode), 3, 12, temperature=0)))
        assert tokens == expected, mode


def test_sessions_are_freed_when_the_caller_stops_early() -> None:
    workers = list(zip(TARGETS, WEIGHTS_3))
    engine = make_engine(DRAFT, workers)

    async def run() -> None:
        generator = engine.generate(_request(1, _spec(Mode.AGGREGATE), max_tokens=50))
        await anext(generator)
        await generator.aclose()

    asyncio.run(run())
    assert all(len(w.state.sessions) == 0 for w in engine.pool.workers)
    assert DRAFT.session_ids() == []


def test_workers_receive_only_what_they_lack() -> None:
    workers = [(TARGETS[0], 1.0)]
    engine = make_engine(DRAFT, workers)

    async def run() -> list[int]:
        tokens, _, _ = await _tokens(engine, _request(3, _spec(Mode.AGGREGATE, 3), max_tokens=20))
        return tokens

    tokens = asyncio.run(run())
    calls = engine.pool.workers[0].calls
    assert calls[0].prefix_len == 0 and calls[0].tokens.tolist() == PROMPT
    for call in calls[1:]:
        assert len(call.tokens) == 1  # the recovered / bonus token of the round before
    full = PROMPT + tokens
    for call in calls:
        assert full[call.prefix_len : call.prefix_len + len(call.tokens)] == call.tokens.tolist()
    # no seed from the client: the worker may batch its calls as it likes
    assert not any(call.seeded for call in calls)


def test_a_seeded_requests_calls_say_so() -> None:
    """A request whose client gave the seed marks every worker call ``seeded``: a GPU worker then forwards it
    in buckets of its own."""
    engine = make_engine(DRAFT, [(TARGETS[0], 1.0)])
    request = replace(_request(3, _spec(Mode.AGGREGATE, 3), max_tokens=6), seeded=True)
    asyncio.run(_tokens(engine, request))
    calls = engine.pool.workers[0].calls
    assert calls and all(call.seeded for call in calls)


def test_top_k_reports_a_bound_that_covers_the_error() -> None:
    workers = list(zip(TARGETS, WEIGHTS_3))
    engine = make_engine(DRAFT, workers)

    async def run() -> list[tuple[list[float], list[float]]]:
        return [
            (r.lossy.bound, r.lossy.error)
            async for r in engine.generate(_request(2, _spec(Mode.AGGREGATE, 3, k=2), max_tokens=20))
        ]

    for bound, error in asyncio.run(run()):
        assert bound and len(bound) == len(error)
        assert all(0 <= e <= b + 1e-6 for b, e in zip(bound, error))


def test_greedy_asks_again_with_a_larger_k_when_top_k_cannot_certify() -> None:
    vocab = 50
    sharp = torch.zeros(vocab, vocab, dtype=torch.float64)
    sharp[:, 10], sharp[:, 11] = 3.0, 2.99  # 10 beats 11 by a hair
    flat = torch.zeros(vocab, vocab, dtype=torch.float64)  # its top-8 are ids 0..7
    workers = [(MarkovRunner(sharp), 1.0), (MarkovRunner(flat), 1.0)]
    engine = make_engine(MarkovRunner(random_table(vocab, 1)), workers)

    async def run() -> list[int]:
        tokens, _, _ = await _tokens(
            engine, _request(0, _spec(Mode.AUTOREGRESSIVE), max_tokens=2, temperature=0)
        )
        return tokens

    assert asyncio.run(run()) == [10, 10]
    ks = [call.k for call in engine.pool.workers[0].calls]
    assert ks == [8, None, 8, None]  # top-8 bounds overlap: asked again for everything
    again = engine.pool.workers[0].calls[1]
    assert len(again.tokens) == 0 and len(again.draft) == 0 and again.prefix_len == len(PROMPT)


# ----------------------------------------------------------------------------- overlapped drafting (DSD)

OVERLAP_CASES = {
    "split, 1 worker": (Mode.SPLIT, [(TARGETS[0], 1.0)]),
    "exact, 1 worker": (Mode.EXACT, [(TARGETS[0], 1.0)]),
    "exact, 3 weighted workers": (Mode.EXACT, list(zip(TARGETS, WEIGHTS_3))),
    "aggregate k full, 3 weighted workers": (Mode.AGGREGATE, list(zip(TARGETS, WEIGHTS_3))),
}


def _overlapped(spec: SpecOptions) -> SpecOptions:
    return SpecOptions(
        mode=spec.mode,
        num_draft_tokens=spec.num_draft_tokens,
        k=spec.k,
        reconstruction=spec.reconstruction,
        draft_top_k=spec.draft_top_k,
        draft_top_p=spec.draft_top_p,
        overlap=True,
    )


async def _rounds(engine: Engine, req: GenerationRequest) -> tuple[list[int], int, int]:
    tokens, prepared, used = [], 0, 0
    async for result in engine.generate(req):
        tokens += result.tokens
        prepared += result.drafting.prepared
        used += result.drafting.prepared_used
    return tokens, prepared, used


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("case", OVERLAP_CASES)
def test_overlap_gives_the_same_tokens_for_every_seed(case: str, temperature: float) -> None:
    """A prepared draft is used only when its assumption held, and is then exactly the draft the
    next round would have made (the draft's draws are keyed by position): same tokens, seed by seed."""
    mode, workers = OVERLAP_CASES[case]
    engine = make_engine(DRAFT, workers)
    spec = _spec(mode, gamma=2)

    async def run() -> tuple[int, int]:
        prepared = used = 0
        for seed in range(40):
            req = GenerationRequest(
                request_id=f"r{seed}",
                prompt=PROMPT,
                max_tokens=12,
                params=SamplingParams(temperature=temperature),
                seed=seed,
                choice=0,
                spec=spec,
            )
            plain, _, _ = await _rounds(engine, req)
            overlapped, p, u = await _rounds(
                engine,
                GenerationRequest(
                    request_id=f"o{seed}",
                    prompt=PROMPT,
                    max_tokens=12,
                    params=req.params,
                    seed=seed,
                    choice=0,
                    spec=_overlapped(spec),
                ),
            )
            assert overlapped == plain, seed
            prepared, used = prepared + p, used + u
        return prepared, used

    prepared, used = asyncio.run(run())
    assert prepared > 25
    if temperature > 0:  # (greedy follows one path, on which these chains' assumption never holds)
        assert 0 < used < prepared  # some assumptions held, some failed


def _joint_at(workers: list[tuple[MarkovRunner, float]], first: int) -> torch.Tensor:
    """p(t_first, t_first+1) (1-based) under p = Σ w_n p_n: the chain's marginal, then one step."""
    w = torch.tensor([x for _, x in workers], dtype=torch.float64)
    w /= w.sum()

    def mix(last: int) -> torch.Tensor:
        return sum(wn * r.next_probs(last) for (r, _), wn in zip(workers, w))  # type: ignore[return-value]

    marginal = mix(PROMPT[-1])
    for _ in range(first - 1):
        marginal = sum(marginal[a] * mix(a) for a in range(V))  # type: ignore[assignment]
    return torch.stack([marginal[a] * mix(a) for a in range(V)])


OVERLAP_SAMPLES = 2_500


def _overlapped_counts(case: str, seeds: range) -> tuple[torch.Tensor, int]:
    """One pool process's share: counts of the 3rd and 4th tokens with γ = 1 and overlap, and
    how many prepared drafts were used."""
    mode, workers = OVERLAP_CASES[case]
    engine = make_engine(DRAFT, workers)
    spec = _overlapped(_spec(mode, gamma=1))

    async def run() -> tuple[torch.Tensor, int]:
        counts, used = torch.zeros(V, V), 0
        for seed in seeds:
            tokens, _, u = await _rounds(
                engine,
                GenerationRequest(
                    request_id=f"r{seed}",
                    prompt=PROMPT,
                    max_tokens=4,
                    params=SamplingParams(),
                    seed=seed,
                    choice=0,
                    spec=spec,
                ),
            )
            counts[tokens[2], tokens[3]] += 1
            used += u
        return counts, used

    return asyncio.run(run())


@FULL_STATISTICS
@pytest.mark.parametrize("case", ["split, 1 worker", "exact, 1 worker", "exact, 3 weighted workers"])
def test_overlapped_rounds_follow_the_target(case: str, processes: Executor) -> None:
    """γ = 1, 4 tokens: the 3rd and 4th come from rounds that may use a draft prepared during the
    previous round's flight; their joint law is the target's (chi-square; fewer samples than
    above: the test before this one shows the tokens equal those without overlap, seed by seed)."""
    parts = list(processes.map(_overlapped_counts, [case, case], _halves(OVERLAP_SAMPLES)))
    counts = sum((c for c, _ in parts), torch.zeros(V, V))
    used = sum(u for _, u in parts)
    assert used > OVERLAP_SAMPLES // 20
    assert (
        pooled_chisquare(counts.flatten(), _joint_at(OVERLAP_CASES[case][1], 3).flatten() * OVERLAP_SAMPLES)
        > SIGNIFICANCE
    )


# ----------------------------------------------------------------------------- relaxed verification (DSD)


def _relaxed(tau_max: float, mode: Mode = Mode.AGGREGATE) -> SpecOptions:
    # exact: a wide draft support, so that p's top token can be certified on it (τ needs that)
    return SpecOptions(
        mode=mode,
        num_draft_tokens=3,
        k=None,
        reconstruction=Reconstruction.RENORMALIZE,
        draft_top_k=5 if mode is Mode.EXACT else 0,
        relaxation=Relaxation(tau_max=tau_max, kl_scale=2.0),
    )


@pytest.mark.parametrize("mode", [Mode.AGGREGATE, Mode.EXACT])
def test_relaxation_with_tau_zero_is_strict_and_above_it_accepts_more(mode: Mode) -> None:
    workers = list(zip(TARGETS, WEIGHTS_3)) if mode is Mode.EXACT else [(TARGETS[0], 1.0)]
    engine = make_engine(DRAFT, workers)

    async def run(spec: SpecOptions) -> tuple[list[list[int]], int, int, list[float], list[float]]:
        texts, drafted, accepted, tvs, taus = [], 0, 0, [], []
        for seed in range(120):
            tokens = []
            async for r in engine.generate(
                GenerationRequest(
                    request_id=f"r{seed}",
                    prompt=PROMPT,
                    max_tokens=8,
                    params=SamplingParams(),
                    seed=seed,
                    choice=0,
                    spec=spec,
                )
            ):
                tokens += r.tokens
                drafted, accepted, tvs, taus = (
                    drafted + r.drafted,
                    accepted + r.accepted,
                    tvs + r.lossy.relaxed_tv,
                    taus + r.lossy.taus,
                )
            texts.append(tokens)
        return texts, drafted, accepted, tvs, taus

    strict, s_drafted, s_accepted, _, _ = asyncio.run(
        run(_spec(mode, draft_top_k=5 if mode is Mode.EXACT else 0))
    )
    zero, _, _, zero_tv, _ = asyncio.run(run(_relaxed(0.0, mode)))
    assert zero == strict and zero_tv == []
    loose, l_drafted, l_accepted, tvs, taus = asyncio.run(run(_relaxed(0.9, mode)))
    assert loose != strict
    assert l_accepted / l_drafted > s_accepted / s_drafted
    assert tvs and max(tvs) > 0 and all(0 <= tv <= 0.9 for tv in tvs) and max(taus) < 0.9
    assert not _relaxed(0.9).is_lossless and _relaxed(0.0).is_lossless
