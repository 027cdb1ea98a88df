"""End to end: a real uvicorn gateway (draft builtin-draft) and two real uvicorn workers
(builtin, builtin-alt) on 127.0.0.1, spoken to by the official ``openai`` client and curl."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from app.server import create_app
from core.config import parse_config
from core.protocol import VerifyRequest, VerifyResponse, decode, encode
from tests.app.helpers import FULL_RUN, served
from tests.integration.gateways import SharedDraft, gateway_in_process

pytestmark = pytest.mark.integration

MODEL = "specgate-e2e"
MESSAGES = [{"role": "user", "content": "Write two sentences about the sea."}]


@pytest.fixture(scope="module")
def worker_urls(builtin_workers: list[str]) -> list[str]:
    # one core each, as `specgate serve` splits them: oversubscribed llama.cpp threads crawl
    return builtin_workers


def _gateway(
    stack: ExitStack,
    urls: list[str],
    weights: list[float] | None = None,
    draft: dict[str, object] | None = None,
    shared: SharedDraft | None = None,
) -> str:
    """A gateway in this process under a real uvicorn: on the ``shared`` draft, else with its own (``draft``:
    none loads no weights)."""
    config = parse_config(
        {
            "model": MODEL,
            "draft": draft or {"model": "builtin-draft", "threads": 1, "background_prefill_from": LATE_FROM},
            "workers": [{"url": url, "weight": w} for url, w in zip(urls, weights or [1.0] * len(urls))],
            "speculative": {"mode": "aggregate", "num_draft_tokens": 4, "k": "full"},
        }
    )
    return (
        gateway_in_process(stack, config, shared)
        if shared is not None
        else stack.enter_context(served(create_app(config)))
    )


WEIGHTS = [0.7, 0.3]  # the module's gateway: two weighted workers
# every prompt here is long enough for a late draft (app.engine.late): the first round carries none
LATE_FROM = 8


@pytest.fixture(scope="module")
def base_url(worker_urls: list[str], shared_draft: SharedDraft) -> Iterator[str]:
    with ExitStack() as stack:
        yield _gateway(stack, worker_urls, WEIGHTS, shared=shared_draft)


@pytest.fixture(scope="module")
def one_worker_url(worker_urls: list[str], shared_draft: SharedDraft) -> Iterator[str]:
    """A gateway on the first worker alone (split takes one worker)."""
    with ExitStack() as stack:
        yield _gateway(stack, worker_urls[:1], shared=shared_draft)


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_sync_chat_and_completion(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, seed=1)  # type: ignore[arg-type]
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage is not None and chat.usage.completion_tokens <= 24
    spec = chat.usage.model_extra["speculative"]  # type: ignore[index]
    assert spec["mode"] == "aggregate" and spec["rounds"] >= 1 and spec["bytes_from_workers"] > 0
    completion = client.completions.create(
        model=MODEL, prompt="The three primary colours are", max_tokens=16, temperature=0
    )
    assert completion.choices[0].text and completion.usage is not None


def test_streaming_chat_arrives_over_several_chunks(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, stream=True
    )  # type: ignore[arg-type]
    arrivals, text, roles, finishes = [], "", 0, []
    for chunk in stream:
        choice = chunk.choices[0]
        roles += choice.delta.role == "assistant"
        if choice.delta.content:
            arrivals.append(time.monotonic())
            text += choice.delta.content
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
    assert roles == 1 and len(finishes) == 1 and text
    assert len(arrivals) >= 5
    assert arrivals[-1] - arrivals[0] > 0.1  # tokens reached the client round by round, not at the end


def test_async_streaming_completion(base_url: str) -> None:
    async def run() -> str:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = await client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            usage = chunk.usage or usage
        await client.close()
        assert usage is not None and usage.completion_tokens >= 1
        return text

    assert asyncio.run(run())


def test_greedy_aggregate_and_tree_equal_autoregressive(client: openai.OpenAI) -> None:
    """Two workers; tree at T = 0 is an EAGLE-2 tree of 14 nodes by default."""
    specs = {
        "autoregressive": {"mode": "autoregressive"},
        "aggregate": {"mode": "aggregate", "k": "full"},
        "tree": {"mode": "tree"},
        "tree exact": {"mode": "tree", "tree": {"payload": "exact"}},
    }
    texts = {}
    for mode, spec in specs.items():
        chat = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=32,
            temperature=0,
            extra_body={"speculative": spec},  # type: ignore[arg-type]
        )
        texts[mode] = chat.choices[0].message.content
    assert texts["aggregate"] == texts["autoregressive"] == texts["tree"] == texts["tree exact"], texts


def test_a_sampled_tree_streams_through_the_api(client: openai.OpenAI) -> None:
    spec = {"mode": "tree", "tree": {"rule": "sampled", "widths": [2, 2, 1]}, "k": 32}
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, seed=4, extra_body={"speculative": spec}
    )  # type: ignore[arg-type]
    block = chat.usage.model_extra["speculative"]  # type: ignore[union-attr, index]
    assert block["mode"] == "tree" and block["tree"] == {
        "rule": "sampled",
        "widths": [2, 2, 1],
        "nodes": 10,
        "payload": "aggregate",
    }
    # top-32: lossy, bounded
    assert block["nodes_per_round"] > 1 and block["rounds"] >= 1 and block["bias_bound_mean"] is not None
    # the default tree at T > 0, exact's sparse payload: lossless
    exact = {"mode": "tree", "tree": {"payload": "exact"}}
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, seed=4, extra_body={"speculative": exact}
    )  # type: ignore[arg-type]
    block = chat.usage.model_extra["speculative"]  # type: ignore[union-attr, index]
    assert block["tree"]["payload"] == "exact" and block["lossless"] is True and block["draft_top_k"] == 32
    # sparse: no [n+1, V] rows (those are ~0.2 MB per node)
    assert block["bytes_from_workers"] < 24 * 64 * 1000
    with pytest.raises(openai.BadRequestError, match="sends no top-k"):
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, extra_body={"speculative": {**exact, "k": 8}}
        )  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="speculative.tree"):
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            extra_body={"speculative": {"mode": "tree", "tree": {"widths": [0]}}},
        )  # type: ignore[arg-type]


def test_greedy_text_is_the_same_in_every_mode(one_worker_url: str) -> None:
    """split, exact, aggregate k full and autoregressive on one worker; all but split on two."""

    def greedy(url: str, spec: dict[str, object]) -> str | None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        chat = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=32, temperature=0, extra_body={"speculative": spec}
        )  # type: ignore[arg-type]
        return chat.choices[0].message.content

    modes = [
        {"mode": "autoregressive"},
        {"mode": "aggregate", "k": "full"},
        {"mode": "exact"},
        {"mode": "split"},
        {"mode": "exact", "drafter": "model+lookup"},
        {"mode": "split", "drafter": "lookup"},
        {"mode": "tree", "drafter": "model+lookup"},
    ]
    texts = {json.dumps(m): greedy(one_worker_url, m) for m in modes}
    assert len(set(texts.values())) == 1, texts


def test_a_gateway_without_a_draft_model_drafts_by_lookup(worker_urls: list[str]) -> None:
    """``draft: {model: none}`` (docs/design.md §3.10): no draft weights are loaded; chains are drafted by
    lookup, and greedy text is autoregressive's; a mode or drafter that needs the model is a 400."""
    prompt = "Count with me: one two three four, one two three four, one two three four, one two three four,"
    with ExitStack() as stack:
        url = _gateway(stack, worker_urls, draft={"model": "none"})
        assert httpx.get(f"{url}/health/ready", timeout=30).json()["draft"] == "none"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        texts, blocks = {}, {}
        for mode in ("autoregressive", "aggregate", "exact", "tree"):
            out = client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=24,
                temperature=0,
                extra_body={"speculative": {"mode": mode}},
            )
            texts[mode], blocks[mode] = out.choices[0].text, out.usage.model_extra["speculative"]  # type: ignore[union-attr, index]
        assert len(set(texts.values())) == 1, texts
        for mode in ("aggregate", "exact", "tree"):
            assert blocks[mode]["drafter"] == "lookup" and blocks[mode]["accepted_tokens"] > 0, blocks[mode]
            assert blocks[mode]["rounds"] < 24 - 4  # the repeats came several tokens a round
        sampled = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, seed=2, extra_body={"speculative": {"mode": "exact"}}
        )
        assert sampled.usage.model_extra["speculative"]["lossless"] is True  # type: ignore[union-attr, index]
        with pytest.raises(openai.BadRequestError, match=r"drafter 'model\+lookup' needs a draft model"):
            client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=4,
                extra_body={"speculative": {"mode": "tree", "drafter": "model+lookup"}},
            )
        with pytest.raises(openai.BadRequestError, match=r"drafter 'model\+lookup' needs a draft model"):
            client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=4,
                extra_body={"speculative": {"drafter": "model+lookup"}},
            )


def test_sampled_split_and_exact_run_through_the_api(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=16,
        seed=3,
        extra_body={"speculative": {"mode": "exact", "draft_top_k": 16}},
    )  # type: ignore[arg-type]
    spec = chat.usage.model_extra["speculative"]  # type: ignore[union-attr, index]
    assert spec["mode"] == "exact" and spec["lossless"] is True and spec["draft_top_k"] == 16
    assert spec["bytes_from_workers"] < spec["rounds"] * 2 * (4 * 16 * 8 + 600)  # sparse both ways


def test_min_tokens_goes_past_the_natural_end(client: openai.OpenAI) -> None:
    """vLLM's min_tokens on the real pair: a short greedy answer that ends in EOS goes on to
    min_tokens, the same text up to where EOS was, in aggregate and exact (two workers)."""
    short = [{"role": "user", "content": "Answer with one word: is water wet?"}]
    for spec in ({"mode": "aggregate", "k": "full"}, {"mode": "exact"}):
        plain = client.chat.completions.create(
            model=MODEL, messages=short, max_tokens=24, temperature=0, extra_body={"speculative": spec}
        )  # type: ignore[arg-type]
        assert plain.choices[0].finish_reason == "stop" and plain.usage is not None
        natural = plain.usage.completion_tokens
        longer = client.chat.completions.create(
            model=MODEL,
            messages=short,
            max_tokens=natural + 12,
            temperature=0,
            extra_body={"speculative": spec, "min_tokens": natural + 6},  # type: ignore[arg-type]
        )
        assert longer.usage is not None and longer.usage.completion_tokens >= natural + 6, spec
        assert (longer.choices[0].message.content or "").startswith(plain.choices[0].message.content or ""), (
            spec
        )


def test_a_seed_makes_a_sampled_answer_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str | None:
        chat = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=24, temperature=1.0, seed=seed
        )  # type: ignore[arg-type]
        return chat.choices[0].message.content

    assert sample(42) == sample(42)


def test_errors_reach_the_sdk_as_its_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", suffix="y")
    assert "suffix" in str(info.value)


def test_curl_as_the_readme_shows(base_url: str) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = next(
        line
        for line in readme.splitlines()
        if line.startswith("curl -s http://127.0.0.1:8000/v1/chat/completions")
    )
    command = line.replace("http://127.0.0.1:8000", base_url).replace(
        '"model": "specgate"', f'"model": "{MODEL}"'
    )
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    body = json.loads(out.stdout)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]


def test_eight_concurrent_streams_all_finish_side_by_side(base_url: str) -> None:
    """Eight seeded sampled streams at once, each with a late draft (its prefill beside seven others' steps):
    every stream produces before any ends, and each text is the one its request gives alone."""

    def messages(i: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"Count from {i} upwards."}]

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[float, float, str]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages(i), max_tokens=24, stream=True, seed=i
        )  # type: ignore[arg-type]
        first, text = 0.0, ""
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.monotonic()
                text += chunk.choices[0].delta.content
        return first, time.monotonic(), text

    async def run() -> list[tuple[float, float, str]]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        results = await asyncio.gather(*(one(client, i) for i in range(8)))
        await client.close()
        return results

    results = asyncio.run(run())
    assert all(text for _, _, text in results)
    first_tokens, ends = [r[0] for r in results], [r[1] for r in results]
    assert max(first_tokens) < min(ends)  # every stream was producing before any of them ended
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    for i in (0, 5):  # alone: the same text (the rounds without a draft are the request's, not the load's)
        chat = client.chat.completions.create(model=MODEL, messages=messages(i), max_tokens=24, seed=i)  # type: ignore[arg-type]
        assert chat.choices[0].message.content == results[i][2]
        assert chat.usage is not None and chat.usage.model_extra["speculative"]["rounds_without_draft"] == 1  # type: ignore[index]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_overlap_gives_the_same_text_on_the_built_in_model(client: openai.OpenAI, temperature: float) -> None:
    """DSD's overlapped drafting changes when the draft is computed, not what it is: greedy and
    seeded sampling give the same text with it on or off."""
    texts, blocks = [], []
    for overlap in (False, True):
        resp = client.completions.create(
            model=MODEL,
            prompt="The sea is",
            max_tokens=24,
            temperature=temperature,
            seed=4,
            extra_body={"speculative": {"mode": "aggregate", "overlap": overlap}},
        )
        texts.append(resp.choices[0].text)
        blocks.append(resp.usage.model_extra["speculative"])  # type: ignore[union-attr]
    assert texts[0] == texts[1] and texts[0]
    assert blocks[0]["overlap"] is False and blocks[1]["overlap"] is True
    assert (
        blocks[1]["prepared_drafts"] > 0
        and 0 <= blocks[1]["prepared_drafts_used"] <= blocks[1]["prepared_drafts"]
    )
    assert blocks[0]["rounds"] == blocks[1]["rounds"]


# "The three primary colours are red, yellow and"
PROMPT_IDS = [504, 1296, 3003, 14797, 359, 2382, 28, 5724, 284]


def _target_rows(
    urls: list[str], weights: list[float], context: list[int], scored: list[int], temperature: float
) -> np.ndarray:
    """log Σ_n w_n T(p_n) at the positions predicting each of ``scored`` after ``context``, from
    each worker's whole distributions (an aggregate call, k full), independent of logprobs."""
    rows = []
    for n, url in enumerate(urls):
        req = VerifyRequest.after(
            f"reference-{n}-{time.monotonic_ns()}",
            [],
            context,
            scored[:-1],
            temperature=temperature,
            mode="aggregate",
        )
        body, content_type = encode(req, 49152)
        resp = httpx.post(
            f"{url}/v1/verify", content=body, headers={"content-type": content_type}, timeout=120
        )
        rows.append(decode(VerifyResponse, resp.content, resp.headers["content-type"]).probs)
        httpx.delete(f"{url}/v1/sessions/{req.session_id}", timeout=10)
    w = np.array(weights) / sum(weights)
    return np.log(np.einsum("n,nmv->mv", w, np.stack(rows)).astype(np.float64))  # type: ignore[no-any-return]


# each mode at one temperature by default: the matrix and tests/app/test_logprobs.py prove both
@pytest.mark.parametrize(
    "temperature, mode",
    [
        (1.0, "split"),
        (0.0, "exact"),
        pytest.param(0.0, "split", marks=FULL_RUN),
        pytest.param(1.0, "exact", marks=FULL_RUN),
    ],
)
def test_logprobs_in_split_and_exact_are_the_targets(
    worker_urls: list[str], one_worker_url: str, mode: str, temperature: float
) -> None:
    """logprobs with top alternatives in split and exact (the default mode): each token's logprob
    is the target's, recomputed from a worker's whole distribution at the same positions."""
    client = openai.OpenAI(base_url=f"{one_worker_url}/v1", api_key="unused", max_retries=0, timeout=120)
    extra = {"speculative": {"mode": mode}, "return_tokens_as_token_ids": True}
    done = client.completions.create(
        model=MODEL,
        prompt=PROMPT_IDS,
        max_tokens=16,
        temperature=temperature,
        seed=4,
        logprobs=3,
        extra_body=extra,
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=temperature,
        logprobs=True,
        top_logprobs=3,
        extra_body=extra,
    )  # type: ignore[arg-type]
    lp = done.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    tokens = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    rows = _target_rows(worker_urls[:1], [1.0], PROMPT_IDS, tokens, temperature)
    assert np.abs(np.array(lp.token_logprobs) - rows[np.arange(len(tokens)), tokens]).max() <= 1e-4
    for row, top in zip(rows, lp.top_logprobs):
        assert sorted(int(t.removeprefix("token_id:")) for t in top) == sorted(np.argsort(-row)[:3].tolist())
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    assert all(len(entry.top_logprobs) == 3 for entry in chat.choices[0].logprobs.content)


# two weighted workers by default: one is the weights' special case
@pytest.mark.parametrize("weights", [WEIGHTS, pytest.param([1.0], marks=FULL_RUN)])
def test_echoed_prompt_logprobs_are_the_targets(
    worker_urls: list[str], base_url: str, one_worker_url: str, weights: list[float]
) -> None:
    """lm-eval's loglikelihood request: echo, logprobs 2, max_tokens 0 and 1; the prompt's logprobs
    are the target's (the first token has none, as in vLLM), with one and two weighted workers."""
    urls = worker_urls[: len(weights)]
    expected = _target_rows(urls, weights, PROMPT_IDS[:1], PROMPT_IDS[1:], 1.0)[
        np.arange(len(PROMPT_IDS) - 1), PROMPT_IDS[1:]
    ]
    url = base_url if len(weights) > 1 else one_worker_url
    for max_tokens in (0, 1):
        body = {
            "model": MODEL,
            "prompt": PROMPT_IDS,
            "echo": True,
            "logprobs": 2,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "return_tokens_as_token_ids": True,
        }
        choice = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
        lp = choice["logprobs"]
        assert [int(t.removeprefix("token_id:")) for t in lp["tokens"][: len(PROMPT_IDS)]] == PROMPT_IDS
        assert (
            len(lp["tokens"]) == len(PROMPT_IDS) + max_tokens
            and lp["token_logprobs"][0] is None
            and lp["top_logprobs"][0] is None
        )
        assert np.abs(np.array(lp["token_logprobs"][1 : len(PROMPT_IDS)]) - expected).max() <= 1e-4
        assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
