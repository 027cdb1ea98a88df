"""logprobs in every mode, over Markov fakes behind the real worker scoring: each emitted token's
logprob is log Σ_n w_n T(p_n)(token) at its position (what the target gave it), in `split` and
`exact` too — from what only the workers know (their samples, the draft tokens) and, with several
workers in `exact`, one short scoring call; echo's prompt logprobs likewise. Without logprobs no
worker message carries any of it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from app.engine import Engine, GenerationRequest, SpecOptions, TokenLogprob
from core.math.sampling import SamplingParams
from core.names import Mode, Reconstruction
from core.protocol import VerifyRequest, VerifyResponse, encode_binary
from tests.app.fakes import MarkovRunner, make_engine, random_table

V = 40
PROMPT = [3, 1, 7, 7, 2]
DRAFT = MarkovRunner(random_table(V, 100, sharpness=1.0), name="draft")
TARGETS = [MarkovRunner(random_table(V, 300 + i, sharpness=1.0), name=f"t{i}") for i in range(2)]
CASES = [  # mode, number of workers
    (Mode.AUTOREGRESSIVE, 2),
    (Mode.AGGREGATE, 2),
    (Mode.SPLIT, 1),
    (Mode.EXACT, 1),
    (Mode.EXACT, 2),
]


def _target(workers: list[tuple[MarkovRunner, float]], last: int, temperature: float) -> torch.Tensor:  # [V]
    w = torch.tensor([x for _, x in workers], dtype=torch.float64)
    w /= w.sum()
    t = temperature or 1.0  # T = 0: softmax(l), whose argmax is the token
    return sum(wn * torch.softmax(r.table[last].double() / t, -1) for (r, _), wn in zip(workers, w))  # type: ignore[return-value]


def _engine(num_workers: int) -> tuple[Engine, list[tuple[MarkovRunner, float]]]:
    workers = list(zip(TARGETS, [0.7, 0.3]))[:num_workers]
    return make_engine(DRAFT, workers), workers


def _request(
    mode: Mode,
    temperature: float,
    seed: int,
    top: int | None,
    prompt_logprobs: int | None = None,
    max_tokens: int = 24,
) -> GenerationRequest:
    spec = SpecOptions(
        mode=mode,
        num_draft_tokens=3,
        k=None,
        reconstruction=Reconstruction.RENORMALIZE,
        draft_top_k=6 if mode is Mode.EXACT else 0,
    )
    return GenerationRequest(
        request_id=f"r{seed}",
        prompt=PROMPT,
        max_tokens=max_tokens,
        params=SamplingParams(temperature=temperature),
        seed=seed,
        choice=0,
        spec=spec,
        top_logprobs=top,
        seeded=True,
        prompt_logprobs=prompt_logprobs,
    )


async def _run(
    engine: Engine, req: GenerationRequest
) -> tuple[list[int], list[TokenLogprob], list[TokenLogprob] | None]:
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    prompt = None
    async for result in engine.generate(req):
        if result.prompt_logprobs is not None:
            prompt = result.prompt_logprobs
        tokens += result.tokens
        logprobs += result.logprobs or []
    return tokens, logprobs, prompt


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("mode, num_workers", CASES)
def test_each_tokens_logprob_is_the_targets(mode: Mode, num_workers: int, temperature: float) -> None:
    engine, workers = _engine(num_workers)
    for seed in range(4):
        tokens, logprobs, _ = asyncio.run(_run(engine, _request(mode, temperature, seed, top=3)))
        if mode is Mode.EXACT and num_workers == 2 and temperature > 0:
            # a worker's sample ended some rounds: scored by all
            assert any(c.score_ids is not None for c in engine.pool.workers[1].calls)  # type: ignore[attr-defined]
        assert [lp.token for lp in logprobs] == tokens and len(tokens) == 24
        for last, lp in zip([PROMPT[-1], *tokens], logprobs):
            target = _target(workers, last, temperature)
            assert lp.logprob == pytest.approx(float(torch.log(target[lp.token])), abs=1e-4)
            assert lp.top is not None and len(lp.top) == 3
            if num_workers == 1 or mode in (Mode.AUTOREGRESSIVE, Mode.AGGREGATE) or temperature == 0:
                expected = torch.topk(target, 3)
                assert [t for t, _ in lp.top] == expected.indices.tolist()
                assert [v for _, v in lp.top] == pytest.approx(torch.log(expected.values).tolist(), abs=1e-4)
            else:  # several workers' top-n lists: a lower bound of the mixture, exact where all listed it
                assert all(v <= float(torch.log(target[t])) + 1e-4 for t, v in lp.top)


@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echoed_prompt_logprobs_are_the_targets(num_workers: int, max_tokens: int) -> None:
    engine, workers = _engine(num_workers)
    tokens, _, prompt = asyncio.run(
        _run(engine, _request(Mode.EXACT, 1.0, 1, top=2, prompt_logprobs=2, max_tokens=max_tokens))
    )
    assert len(tokens) == max_tokens and prompt is not None and [lp.token for lp in prompt] == PROMPT
    # nothing predicts the first token (vLLM: null)
    assert prompt[0].logprob is None and prompt[0].top is None
    for last, lp in zip(PROMPT, prompt[1:]):
        target = _target(workers, last, 1.0)
        assert lp.logprob == pytest.approx(float(torch.log(target[lp.token])), abs=1e-4)
        assert lp.top is not None and len(lp.top) == 2
        if num_workers == 1:
            assert [t for t, _ in lp.top] == torch.topk(target, 2).indices.tolist()


@pytest.mark.parametrize("mode, num_workers", CASES)
def test_without_logprobs_no_message_grows(mode: Mode, num_workers: int) -> None:
    """The extension fields leave no trace on the wire unless asked: the frames are byte for byte
    what they are with those fields absent, and the tokens are the same with logprobs on."""
    engine, _ = _engine(num_workers)
    plain, _, _ = asyncio.run(_run(engine, _request(mode, 1.0, 5, top=None)))
    calls = [c for w in engine.pool.workers for c in w.calls]  # type: ignore[attr-defined]
    assert calls and all(c.logprobs is None and not c.score_tokens and c.score_ids is None for c in calls)
    for call in calls:
        frame = encode_binary(call, V)
        assert b"logprobs" not in frame and b"score" not in frame
    with_logprobs, _, _ = asyncio.run(_run(_engine(num_workers)[0], _request(mode, 1.0, 5, top=2)))
    assert with_logprobs == plain  # asking for logprobs changes no token


def test_a_response_without_logprobs_has_none_of_their_arrays() -> None:
    worker_req = VerifyRequest.after(
        "s",
        [],
        PROMPT,
        [4, 5],
        mode=Mode.EXACT.value,
        support_ids=np.array([4, 9, 5]),
        support_sizes=np.array([2, 1], dtype=np.int32),
    )
    engine, _ = _engine(1)
    state = engine.pool.workers[0].state  # type: ignore[attr-defined]
    plain: VerifyResponse = state.steps.verify(worker_req)
    asked: VerifyResponse = state.steps.verify(
        VerifyRequest.after(
            "t",
            [],
            PROMPT,
            [4, 5],
            mode=Mode.EXACT.value,
            support_ids=np.array([4, 9, 5]),
            support_sizes=np.array([2, 1], dtype=np.int32),
            logprobs=2,
        )
    )
    extra = (
        "draft_logprobs",
        "sample_logprobs",
        "top_ids",
        "top_logprobs",
        "prompt_logprobs",
        "prompt_top_ids",
        "prompt_top_logprobs",
        "score_logprobs",
    )
    assert all(getattr(plain, name) is None for name in extra)
    assert asked.sample_logprobs is not None and asked.top_ids is not None and asked.top_ids.shape == (3, 2)
    assert len(encode_binary(asked, V)) > len(encode_binary(plain, V))
