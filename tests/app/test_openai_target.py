"""openai-logprobs targets (docs/design.md §8) against fake engines scored by a real tiny model:
what a round gets from an engine equals what one of our workers sends at the same top-k; the
gateway federates, reports the bound, refuses the modes engines cannot take, and fails loudly
(never guesses) when an engine read other tokens than the gateway's."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from app.targets.channel import Expected
from app.targets.engine_listing import TokenTable, parse_listing, token_id
from app.targets.failures import ReplicaFailure
from app.targets.openai_logprobs import EngineDialect
from app.targets.pool import TargetSet
from core.config import parse_config
from core.errors import ConfigError
from core.protocol import VerifyRequest
from core.runners import ModelRunner, load_runner
from core.transform import LogitsTransform, TransformSpec
from tests.app.conftest import Gateway
from tests.app.fake_engine import FakeEngine, Listing, Router
from tests.app.helpers import assert_error
from workers.scoring import score
from workers.server import create_app as create_worker
from workers.settings import WorkerSettings

ENGINE = {"type": "openai-logprobs", "url": "http://engine:1", "model": "tiny", "logprobs": 8}
WORKER = {"url": "http://w0:1"}
PROMPT = "The sea is"


@pytest.fixture(scope="module")
def engine_runner() -> ModelRunner:
    return load_runner("tiny-random", "transformers")  # its own: the draft's sessions stay apart


@pytest.fixture(scope="module")
def worker_runner() -> ModelRunner:
    return load_runner("tiny-random", "transformers")


def _router(engine: FakeEngine, worker_runner: ModelRunner) -> Router:
    worker = create_worker(WorkerSettings(model="tiny-random", backend="transformers"), runner=worker_runner)
    return Router({"engine": engine.transport(), "w0": httpx.ASGITransport(app=worker)})


@pytest.fixture(params=["vllm", "llama-cpp"])
def engine(request: pytest.FixtureRequest, engine_runner: ModelRunner) -> Iterator[FakeEngine]:
    yield FakeEngine(engine_runner, request.param)


async def _complete(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    resp = await client.post(
        "/v1/completions", json={"model": "test-model", "prompt": PROMPT, "max_tokens": 10, "seed": 5, **body}
    )
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


# ----------------------------------------------------------------------------- one round


async def _verify_both(
    engine: FakeEngine,
    worker_runner: ModelRunner,
    draft_runner: ModelRunner,
    req: VerifyRequest,
    agreed: list[int],
) -> tuple[Any, Any]:
    config = parse_config({"workers": [ENGINE]})
    pool = TargetSet.from_config(
        config,
        Expected(draft_runner.fingerprint, draft_runner.info.vocab_size, draft_runner.tokenizer),
        engine.transport(),
    )
    target = pool.workers[0]
    assert isinstance(target.dialect, EngineDialect)
    got, _ = await target.verify(req, agreed)
    await pool.close()
    sequence = [*agreed, *req.draft.tolist()]
    logits = worker_runner.forward_full(sequence, len(req.draft) + 1)
    if req.transform is not None:  # as a worker applies it: each row by its prefix
        draft = req.draft.tolist()
        logits = LogitsTransform.build(TransformSpec.from_wire(req.transform), logits.shape[-1], None).rows(
            logits, agreed, [draft[:j] for j in range(len(draft) + 1)]
        )
    return got, score(logits, req, held=len(sequence), model_ms=0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_a_round_from_an_engine_is_a_workers_top_k(
    engine: FakeEngine, worker_runner: ModelRunner, tiny_runner: ModelRunner, temperature: float
) -> None:
    """T(p) on the engine's top-k, renormalised, equals the worker's top-k of T(p) renormalised;
    σ is the worker's at T = 1 and bounds it otherwise. Ids the llama-cpp dialect cannot name
    (special tokens print as "") may be missing, never misplaced."""
    agreed = list(tiny_runner.tokenizer.encode(PROMPT))
    draft = [int(t) for t in tiny_runner.tokenizer.encode(" wide and deep")]
    req = VerifyRequest.after("s", [], agreed, draft, temperature=temperature, k=8)
    got, want = await _verify_both(engine, worker_runner, tiny_runner, req, agreed)
    assert got.ids.shape == (len(draft) + 1, 8) == want.ids.shape
    for j in range(len(draft) + 1):
        mine = dict(zip(got.ids[j].tolist(), got.probs[j].tolist()))
        theirs = dict(zip(want.ids[j].tolist(), want.probs[j].tolist()))
        if engine.dialect == "vllm":
            assert list(mine) == list(theirs)
        shared = [t for t in mine if t in theirs]
        assert len(shared) >= 7
        head = np.array([mine[t] for t in shared]) / sum(mine[t] for t in shared)
        np.testing.assert_allclose(
            head, np.array([theirs[t] for t in shared]) / sum(theirs[t] for t in shared), rtol=2e-4
        )
        assert got.tail_mass[j] >= want.tail_mass[j] - 1e-5
        if temperature == 1.0 and list(mine) == list(theirs):
            assert got.tail_mass[j] == pytest.approx(want.tail_mass[j], abs=1e-5)


async def test_min_tokens_removes_the_suppressed_ids_from_an_engines_rows(
    engine: FakeEngine, worker_runner: ModelRunner, tiny_runner: ModelRunner
) -> None:
    """The rows before min_tokens lose the ids the transform keeps out (here the likeliest token,
    so that the listing holds it) and keep the worker's law on the rest — the worker masks their
    logits first (vLLM's order), the engine target the listing before its temperature —; the
    rows after are as without min_tokens."""
    agreed = list(tiny_runner.tokenizer.encode(PROMPT))
    draft = [int(t) for t in tiny_runner.tokenizer.encode(" wide and deep")]
    plain = VerifyRequest.after("s", [], agreed, draft, k=8)
    _, full = await _verify_both(engine, worker_runner, tiny_runner, plain, agreed)
    banned = (int(full.ids[0, 0]), int(full.ids[1, 0]))
    # the first row only
    spec = TransformSpec(prompt_len=len(agreed), min_tokens=1, eos_ids=tuple(sorted(set(banned))))
    req = replace(plain, transform=spec.to_wire())
    got, want = await _verify_both(engine, worker_runner, tiny_runner, req, agreed)
    assert not set(banned) & set(got.ids[0].tolist()) and not set(banned) & set(want.ids[0].tolist())
    mine, theirs = (
        dict(zip(got.ids[0].tolist(), got.probs[0].tolist())),
        dict(zip(want.ids[0].tolist(), want.probs[0].tolist())),
    )
    shared = [t for t in mine if t in theirs]
    assert len(shared) >= 6
    head = np.array([mine[t] for t in shared]) / sum(mine[t] for t in shared)
    np.testing.assert_allclose(
        head, np.array([theirs[t] for t in shared]) / sum(theirs[t] for t in shared), rtol=2e-4
    )
    assert banned[1] in got.ids[1].tolist()


async def test_the_probe_learns_each_dialect(
    engine: FakeEngine, worker_runner: ModelRunner, tiny_runner: ModelRunner
) -> None:
    config = parse_config({"workers": [ENGINE]})
    pool = TargetSet.from_config(
        config,
        Expected(tiny_runner.fingerprint, tiny_runner.info.vocab_size, tiny_runner.tokenizer),
        engine.transport(),
    )
    report = await pool.check_all()
    await pool.close()
    assert report[0]["ready"], report
    fmt = pool.workers[0].dialect.formats["http://engine:1"]  # type: ignore[attr-defined]
    if engine.dialect == "vllm":
        assert (fmt.ids_prompt, fmt.ids_tokens, fmt.unlisted, fmt.shifts) == (
            True,
            True,
            frozenset(),
            ((False, 0),),
        )
        assert report[0]["max_context"] == 1024
    else:  # llama-cpp-python: BOS left out; aligned only after a leading BOS
        bos = tiny_runner.tokenizer.bos_token_id
        assert (fmt.ids_prompt, fmt.ids_tokens, fmt.unlisted, fmt.shifts) == (
            False,
            False,
            frozenset({bos}),
            ((False, 1), (True, 0)),
        )


# ----------------------------------------------------------------------------- through the gateway


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
async def test_an_engine_gives_the_same_text_as_a_worker_at_the_same_k(
    gateway: Gateway,
    engine_runner: ModelRunner,
    worker_runner: ModelRunner,
    temperature: float,
) -> None:
    """Seeded, aggregate at k = 8: an engine that returns token ids (vLLM) and our worker lead
    the gateway to the same text, and the same bound at T = 1."""
    engine = FakeEngine(engine_runner, "vllm")
    texts, bounds = [], []
    for target in (ENGINE, WORKER):
        async with gateway(
            transport=_router(engine, worker_runner),
            workers=[target],
            speculative={"mode": "aggregate", "k": 8},
        ) as client:
            body = await _complete(client, temperature=temperature)
        texts.append(body["choices"][0]["text"])
        bounds.append(body["usage"]["speculative"]["bias_bound_mean"])
        assert body["usage"]["speculative"]["lossless"] is False
    assert texts[0] == texts[1] and texts[0]
    assert bounds[0] >= bounds[1] - 1e-5
    if temperature == 1.0:
        assert bounds[0] == pytest.approx(bounds[1], abs=1e-5)


async def test_an_engine_federates_with_a_worker(
    gateway: Gateway, engine: FakeEngine, worker_runner: ModelRunner, tiny_runner: ModelRunner
) -> None:
    """Weights 0.5 / 0.5, aggregate with full distributions from the worker: the response is
    lossy only through the engine (bound = half its σ), and a text engine got text that
    tokenises to the gateway's ids, ending in the pad token."""
    workers = [{**ENGINE, "weight": 0.5}, {**WORKER, "weight": 0.5}]
    async with gateway(
        transport=_router(engine, worker_runner),
        workers=workers,
        speculative={"mode": "aggregate", "k": "full"},
    ) as client:
        body = await _complete(client, temperature=1.0, max_tokens=12)
    spec = body["usage"]["speculative"]
    assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] == 12
    assert spec["lossless"] is False and spec["logprobs_source"] == "reconstruction"
    assert 0 < spec["bias_bound_mean"] <= 0.5
    for prompt in engine.prompts[2:]:  # after the probes
        ids = (
            prompt
            if isinstance(prompt, list)
            else tiny_runner.tokenizer.encode(prompt, add_special_tokens=False)
        )
        assert ids[-1] == tiny_runner.tokenizer.eos_token_id
        assert isinstance(prompt, list) == (engine.dialect == "vllm")


async def test_autoregressive_samples_from_the_engines_top_k(
    gateway: Gateway, engine: FakeEngine, worker_runner: ModelRunner
) -> None:
    """Seeded autoregressive through an engine is deterministic, lossy with its bound; greedy
    through an engine that returns token ids gives the worker's text."""
    router = _router(engine, worker_runner)
    runs = []
    for _ in range(2):
        async with gateway(
            transport=router, workers=[ENGINE], speculative={"mode": "autoregressive"}
        ) as client:
            runs.append(await _complete(client, temperature=0.9))
    assert runs[0]["choices"][0]["text"] == runs[1]["choices"][0]["text"]
    spec = runs[0]["usage"]["speculative"]
    assert spec["lossless"] is False and 0 < spec["bias_bound_mean"] < 1 and spec["rounds"] == 10
    greedy = []
    for target in (ENGINE, WORKER):
        async with gateway(
            transport=router, workers=[target], speculative={"mode": "autoregressive"}
        ) as client:
            greedy.append((await _complete(client, temperature=0))["choices"][0]["text"])
    if engine.dialect == "vllm":  # token strings cannot name every argmax (several ids print alike)
        assert greedy[0] == greedy[1]


async def test_min_tokens_through_an_engine(
    gateway: Gateway, engine_runner: ModelRunner, worker_runner: ModelRunner
) -> None:
    """An engine serves min_tokens alone and beside a worker (issue 46: each target transformed
    as it would be alone, the federation mixing them — no mass of EOS to weigh them by)."""
    engine = FakeEngine(engine_runner, "vllm")
    async with gateway(
        transport=_router(engine, worker_runner), workers=[ENGINE], speculative={"mode": "aggregate", "k": 8}
    ) as client:
        body = await _complete(client, temperature=1.0, min_tokens=6, max_tokens=8)
        assert body["usage"]["completion_tokens"] >= 6
    async with gateway(transport=_router(engine, worker_runner), workers=[ENGINE, WORKER]) as client:
        body = await _complete(client, temperature=1.0, min_tokens=3, max_tokens=4)
        assert body["usage"]["completion_tokens"] >= 3
        await _complete(client, ignore_eos=True, min_tokens=2)  # nothing to suppress with ignore_eos


async def test_modes_an_engine_cannot_take_are_refused(
    gateway: Gateway, engine_runner: ModelRunner, worker_runner: ModelRunner
) -> None:
    engine = FakeEngine(engine_runner, "vllm")
    async with gateway(transport=_router(engine, worker_runner), workers=[ENGINE]) as client:
        for mode in ("split", "exact"):
            resp = await client.post(
                "/v1/completions",
                json={
                    "model": "test-model",
                    "prompt": PROMPT,
                    "max_tokens": 4,
                    "speculative": {"mode": mode},
                },
            )
            assert_error(resp, 400, "speculative.mode", "openai-logprobs")
        await _complete(client)  # and it serves the others after
    with pytest.raises(ConfigError, match="needs specgate workers"):
        parse_config({"workers": [ENGINE], "speculative": {"mode": "exact"}})
    with pytest.raises(ConfigError, match="url .* and model"):
        parse_config({"workers": [{"type": "openai-logprobs", "url": "http://engine:1"}]})


async def test_an_engine_that_refuses_echo_is_not_ready(
    gateway: Gateway, engine_runner: ModelRunner, worker_runner: ModelRunner
) -> None:
    engine = FakeEngine(engine_runner, "llama-cpp", refuse_echo=True)
    async with gateway(transport=_router(engine, worker_runner), workers=[ENGINE]) as client:
        ready = await client.get("/health/ready")
        assert ready.status_code == 503 and "llama-server does not" in ready.text
        resp = await client.post(
            "/v1/completions", json={"model": "test-model", "prompt": PROMPT, "max_tokens": 4}
        )
        assert_error(resp, 503, contains="echo")


def _swap_last_draft_token(listing: Listing) -> Listing:
    listing["tokens"][-3] = "token_id:7" if listing["tokens"][-3].startswith("token_id:") else "zzz"
    return listing


def _no_top(listing: Listing) -> Listing:
    listing["top_logprobs"][-2] = None
    return listing


@pytest.mark.parametrize(
    "mangle, status, message",
    [
        (_swap_last_draft_token, 502, "the engine read token"),
        (lambda listing: {**listing, "tokens": listing["tokens"][:-4]}, 502, "unusable"),
        (lambda listing: {k: v[:-4] for k, v in listing.items()}, 502, "echoed"),
        (_no_top, 502, "no logprobs for position"),
    ],
)
async def test_an_engine_that_read_other_tokens_fails_loudly(
    gateway: Gateway,
    engine: FakeEngine,
    worker_runner: ModelRunner,
    mangle: Any,
    status: int,
    message: str,
) -> None:
    async with gateway(transport=_router(engine, worker_runner), workers=[ENGINE]) as client:
        await client.get("/health/ready")  # probed with honest answers
        engine.mangle = mangle
        resp = await client.post(
            "/v1/completions", json={"model": "test-model", "prompt": PROMPT, "max_tokens": 6, "seed": 1}
        )
        assert_error(resp, status, contains=message)
        assert "worker w0" in resp.json()["error"]["message"]
        engine.mangle = None
        await _complete(client)  # the next request is served


# ----------------------------------------------------------------------------- drafts it can score


async def test_drafts_stop_before_tokens_a_text_engine_cannot_score(
    engine_runner: ModelRunner, tiny_runner: ModelRunner
) -> None:
    tokenizer = tiny_runner.tokenizer
    config = parse_config({"workers": [ENGINE]})
    pool = TargetSet.from_config(
        config,
        Expected(tiny_runner.fingerprint, tiny_runner.info.vocab_size, tokenizer),
        FakeEngine(engine_runner, "llama-cpp").transport(),
    )
    await pool.check_all()
    await pool.close()
    sequence = list(tokenizer.encode("The sea is"))
    word = tokenizer.encode(" hello", add_special_tokens=False)
    assert len(word) == 1
    halves = tokenizer.encode(" hel", add_special_tokens=False) + tokenizer.encode(
        "lo", add_special_tokens=False
    )
    assert pool.scorable(sequence, [*word, *word]) == 2
    assert pool.scorable(sequence, [*word, tokenizer.bos_token_id, *word]) == 1  # left out of the listing
    assert pool.scorable(sequence, [*word, *halves]) == 2  # " hel" + "lo" reads back as " hello"
    newline = tokenizer.encode("\n", add_special_tokens=False)
    # "\n" "\n" reads back as one "\n\n" before EOS, as itself before a letter: the pad is a letter
    assert pool.scorable(sequence, [*newline, *newline]) == 2


def test_token_table_names_only_what_is_unambiguous(tiny_runner: ModelRunner) -> None:
    tokenizer = tiny_runner.tokenizer
    table = TokenTable(tokenizer, tiny_runner.info.vocab_size)
    word = tokenizer.encode(" hello", add_special_tokens=False)[0]
    assert table.id_of(" hello") == word and table.matches(word, " hello")
    eos = tokenizer.eos_token_id
    assert table.matches(eos, "") and table.matches(eos, tokenizer.decode([eos]))
    assert table.id_of("") is None  # every special token prints as "" in llama-cpp-python
    assert table.id_of(tokenizer.decode([eos])) == eos


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"{}",
        b'{"choices": []}',
        b'{"choices": [{"logprobs": null}]}',
        b'{"choices": [{"logprobs": {"tokens": ["a"], "token_logprobs": [], "top_logprobs": []}}]}',
        b'{"choices": [{"logprobs": {"tokens": ["a"], "token_logprobs": ["x"], "top_logprobs": [null]}}]}',
        b'{"choices": [{"logprobs": {"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": '
        b'[{"a": "b"}]}}]}',
    ],
)
def test_unusable_listings_are_garbage(body: bytes) -> None:
    with pytest.raises(ReplicaFailure) as failure:
        parse_listing(body)
    assert failure.value.kind == "garbage"


def test_token_id_strings() -> None:
    assert token_id("token_id:42") == 42
    assert token_id("token_id:-1") is None and token_id("42") is None and token_id("token_id:") is None


def test_the_example_config_parses() -> None:
    from core.config import load_config

    config = load_config(Path(__file__).parents[2] / "config" / "engine.yaml")
    assert [w.is_openai_logprobs for w in config.workers] == [True, False]
    assert [w.is_local for w in config.workers] == [False, True]
