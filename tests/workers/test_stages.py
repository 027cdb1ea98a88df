"""Pipeline stage workers over real HTTP (docs/design.md §3.7, §4): three stages of the built-in model
on uvicorn, each sending its states to the next; the last answers the whole model's
distributions. Ordering by ``seq``, prunes (``keep``), and the errors a stage answers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import numpy as np
import pytest
import torch

from core.protocol import BINARY_CONTENT_TYPE, StageRequest, StageResponse, decode, encode
from core.runners import load_runner, resolve_model
from core.runners.base import ForwardItem
from core.runners.transformers_runner import TransformersRunner
from core.transform import LogitsTransform, TransformSpec
from tests.app.helpers import assert_error, served
from workers.server import create_app
from workers.settings import WorkerSettings

PROMPT = [504, 3458, 28, 638, 359, 346, 1485, 1834, 47, 378]
TREE = [12, 907, 260, 31, 4000]
TREE_PARENTS = [9, 9, 10, 10, 11]
SPLIT = [(0, 9), (9, 21), (21, 30)]
V = 49152


@pytest.fixture(scope="module")
def whole() -> Iterator[TransformersRunner]:
    runner = load_runner("builtin", "transformers", memory_cap_mb=64)
    assert isinstance(runner, TransformersRunner)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def stages(whole: TransformersRunner) -> Iterator[list[str]]:
    """The three stages' URLs, first first."""
    with ExitStack() as stack:
        urls = []
        for first, end in SPLIT:
            runner = TransformersRunner(
                resolve_model("builtin"),
                whole.tokenizer,
                model=whole.model,
                memory_cap_mb=256,
                layers=(first, end),
            )
            settings = WorkerSettings(
                model="builtin", backend="transformers", layers=f"{first}:{end}", stage_wait_s=2.0
            )
            urls.append(stack.enter_context(served(create_app(settings, runner=runner))))
        yield urls


def _post(url: str, req: StageRequest, path: str = "/v1/stage/forward") -> httpx.Response:
    payload, content_type = encode(req, V)
    return httpx.post(f"{url}{path}", content=payload, headers={"content-type": content_type}, timeout=30)


def _answer(resp: httpx.Response) -> StageResponse:
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == BINARY_CONTENT_TYPE
    return decode(StageResponse, resp.content, resp.headers["content-type"])


def _reference(whole: TransformersRunner, session: str, item: ForwardItem) -> torch.Tensor:
    return torch.softmax(whole.forward([item])[0].double(), dim=-1)


def test_three_stages_answer_the_whole_models_distributions_at_every_node(
    whole: TransformersRunner, stages: list[str]
) -> None:
    tokens, parents = PROMPT + TREE, list(range(-1, len(PROMPT) - 1)) + TREE_PARENTS
    req = StageRequest(
        "a",
        0,
        0,
        np.array(tokens),
        parents=np.array(parents, np.int32),
        hidden_dtype="f32",
        score_from=len(PROMPT) - 1,
        next=stages[1:],
    )
    resp = _answer(_post(stages[0], req))
    expected = _reference(
        whole, "a", ForwardItem("ref-a", 0, tokens, parents, list(range(len(PROMPT) - 1, len(tokens))))
    )
    assert resp.probs is not None and resp.probs.shape == (len(TREE) + 1, V)
    assert float(np.abs(resp.probs - expected.numpy()).max()) <= 1e-4
    assert resp.held == len(tokens)
    assert resp.stage_ms is not None and len(resp.stage_ms) == 3 and (resp.stage_ms > 0).all()
    # f32 states, twice
    assert (
        resp.hop_bytes is not None
        and all(h > len(tokens) * 576 * 4 for h in resp.hop_bytes)
        and len(resp.hop_bytes) == 2
    )
    f32_hops = list(resp.hop_bytes)

    # the verdict took node 10: keep the prompt, it and its subtree, then a segment below them
    kept = list(range(len(PROMPT))) + [10, 12, 13]
    seg = StageRequest(
        "a",
        1,
        len(kept),
        np.array([9, 640]),
        parents=np.array([11, 12], np.int32),
        keep=np.array(kept, np.int32),
        hidden_dtype="f32",
        next=stages[1:],
    )
    resp = _answer(_post(stages[0], seg))
    fresh_tokens = PROMPT + [12, 260, 31, 9, 640]
    fresh_parents = list(range(-1, len(PROMPT) - 1)) + [9, 10, 10, 11, 12]
    expected = _reference(whole, "a", ForwardItem("ref-b", 0, fresh_tokens, fresh_parents, [13, 14]))
    assert resp.probs is not None and float(np.abs(resp.probs - expected.numpy()).max()) <= 1e-4
    assert resp.held == len(fresh_tokens)

    # fp16 frames (the default: 1,152 B a row for the built-in model) move the answer by little
    half = StageRequest(
        "h",
        0,
        0,
        np.array(tokens),
        parents=np.array(parents, np.int32),
        score_from=len(PROMPT) - 1,
        next=stages[1:],
    )
    resp16 = _answer(_post(stages[0], half))
    assert resp16.hop_bytes is not None and all(
        h16 < 0.6 * h32 for h16, h32 in zip(resp16.hop_bytes, f32_hops)
    )
    tv = 0.5 * np.abs(
        resp16.probs
        - _reference(
            whole, "h", ForwardItem("ref-c", 0, tokens, parents, list(range(len(PROMPT) - 1, len(tokens))))
        ).numpy()
    ).sum(-1)
    assert float(tv.max()) < 5e-3
    for url in stages:
        for session in ("a", "h"):
            assert httpx.delete(f"{url}/v1/sessions/{session}").status_code == 204


def test_the_last_stage_transforms_each_row_by_its_ancestors(
    whole: TransformersRunner, stages: list[str]
) -> None:
    """docs/design.md §3.9 at the last stage: the transform rides on the message that starts the session
    and is kept; each scored row is transformed by its own prefix (its ancestors' tokens), on
    the later messages too. A bad transform or min_p is a 400 naming it; the stages serve on."""
    spec = TransformSpec(
        logit_bias=((12, 12.0), (260, -2.0)),
        presence_penalty=0.8,
        frequency_penalty=1.1,
        prompt_len=len(PROMPT),
    )
    transformer = LogitsTransform.build(spec, V, None)
    tokens, parents = PROMPT + TREE, list(range(-1, len(PROMPT) - 1)) + TREE_PARENTS
    req = StageRequest(
        "t",
        0,
        0,
        np.array(tokens),
        parents=np.array(parents, np.int32),
        hidden_dtype="f32",
        score_from=len(PROMPT) - 1,
        next=stages[1:],
        transform=spec.to_wire(),
    )
    resp = _answer(_post(stages[0], req))
    logits = whole.forward(
        [ForwardItem("ref-t", 0, tokens, parents, list(range(len(PROMPT) - 1, len(tokens))))]
    )[0]
    paths = [[], [12], [907], [12, 260], [12, 31], [907, 4000]]
    expected = torch.softmax(transformer.rows(logits, PROMPT, paths).double(), dim=-1)
    assert resp.probs is not None and float(np.abs(resp.probs - expected.numpy()).max()) <= 1e-4
    # it did change them
    assert float(np.abs(resp.probs - torch.softmax(logits.double(), -1).numpy()).max()) > 0.01

    kept = list(range(len(PROMPT))) + [10, 12, 13]  # node 12 (…, 12, 260) and 13 (…, 12, 31) get a child each
    seg = StageRequest(
        "t",
        1,
        len(kept),
        np.array([9, 640]),
        parents=np.array([11, 12], np.int32),
        keep=np.array(kept, np.int32),
        hidden_dtype="f32",
        next=stages[1:],
    )
    resp = _answer(_post(stages[0], seg))
    fresh_tokens, fresh_parents = (
        PROMPT + [12, 260, 31, 9, 640],
        list(range(-1, len(PROMPT) - 1)) + [9, 10, 10, 11, 12],
    )
    logits = whole.forward([ForwardItem("ref-t2", 0, fresh_tokens, fresh_parents, [13, 14])])[0]
    expected = torch.softmax(transformer.rows(logits, [*PROMPT, 12], [[260, 9], [31, 640]]).double(), dim=-1)
    assert resp.probs is not None and float(np.abs(resp.probs - expected.numpy()).max()) <= 1e-4

    bad = StageRequest(
        "t-bad", 0, 0, np.array(PROMPT), next=stages[1:], transform={"logit_bias": [[V + 5, 1.0]]}
    )
    assert_error(_post(stages[0], bad), 400, param="transform")
    assert_error(
        _post(stages[0], StageRequest("t-bad2", 0, 0, np.array(PROMPT), next=stages[1:], min_p=1.5)),
        400,
        param="min_p",
    )
    assert _answer(
        _post(stages[0], StageRequest("t-ok", 0, 0, np.array(PROMPT), next=stages[1:]))
    ).held == len(PROMPT)
    for url in stages:
        for session in ("t", "t-bad", "t-bad2", "t-ok"):
            httpx.delete(f"{url}/v1/sessions/{session}")


def test_a_sessions_messages_are_taken_in_seq_order(stages: list[str]) -> None:
    first = StageRequest("o", 0, 0, np.array(PROMPT), next=stages[1:])
    second = StageRequest("o", 1, len(PROMPT), np.array([12]), next=stages[1:])

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:

            async def post(req: StageRequest, delay: float) -> httpx.Response:
                await asyncio.sleep(delay)
                payload, content_type = encode(req, V)
                return await client.post(
                    f"{stages[0]}/v1/stage/forward", content=payload, headers={"content-type": content_type}
                )

            return await asyncio.gather(post(second, 0.0), post(first, 0.3))  # the second arrives first

    answers = asyncio.run(both())
    assert [_answer(a).held for a in answers] == [len(PROMPT) + 1, len(PROMPT)]
    assert_error(_post(stages[0], first), 409, code="session_short")  # seq 0 again: taken already
    late = StageRequest("o", 5, len(PROMPT) + 1, np.array([3]), next=stages[1:])
    assert_error(_post(stages[0], late), 409, code="session_short", contains="waited")  # 2..4 never come
    # a prune alone, at every stage (the gateway's broadcast): message 2, the one the stages wait for
    for url in stages:
        keep = StageRequest(
            "o", 2, len(PROMPT), np.zeros(0, np.int64), keep=np.arange(len(PROMPT), dtype=np.int32)
        )
        resp = _answer(_post(url, keep, "/v1/stage/keep"))
        assert resp.held == len(PROMPT)
        httpx.delete(f"{url}/v1/sessions/o")


def test_what_a_stage_refuses(stages: list[str]) -> None:
    info = httpx.get(f"{stages[1]}/v1/info").json()
    assert info["layer_range"] == [9, 21]
    verify = httpx.post(
        f"{stages[0]}/v1/verify",
        json={"session_id": "v", "prefix_len": 0, "prefix_hash": "", "tokens": [1], "draft": []},
    )
    assert_error(verify, 400, contains="pipeline stage")
    no_states = StageRequest("x", 0, 0, np.array(PROMPT))
    assert_error(_post(stages[1], no_states), 400, param="hidden")
    no_next = StageRequest("x", 0, 0, np.array(PROMPT))
    assert_error(_post(stages[0], no_next), 400, param="next", contains="not the last")
    dead = StageRequest("y", 0, 0, np.array(PROMPT), next=["http://127.0.0.1:9"])
    assert_error(_post(stages[0], dead), 502, code="stage_unreachable", contains="127.0.0.1:9")
    wrong_prefix = StageRequest("z", 0, 3, np.array(PROMPT), next=stages[1:])
    assert_error(_post(stages[0], wrong_prefix), 409, code="session_short")
    bad_keep = StageRequest("w", 0, 0, np.array(PROMPT), next=stages[1:])
    _answer(_post(stages[0], bad_keep))
    bad = StageRequest("w", 1, 2, np.array([5]), keep=np.array([0, 2], np.int32), next=stages[1:])
    assert_error(_post(stages[0], bad), 400, param="keep")
    # the stage serves on
    ok = StageRequest("w2", 0, 0, np.array(PROMPT), next=stages[1:])
    assert _answer(_post(stages[0], ok)).held == len(PROMPT)
    for url in stages:
        for session in ("x", "y", "z", "w", "w2"):
            httpx.delete(f"{url}/v1/sessions/{session}")


def test_a_draining_first_stage_keeps_its_sessions_and_refuses_new_ones(
    whole: TransformersRunner, stages: list[str]
) -> None:
    """SIGTERM to the first stage (where a session starts): a session it holds goes on through the pipeline, a
    new one gets 503 worker_draining with Retry-After (the later stages only take sessions the first sent
    them)."""
    first, end = SPLIT[0]
    runner = TransformersRunner(
        resolve_model("builtin"), whole.tokenizer, model=whole.model, memory_cap_mb=256, layers=(first, end)
    )
    app = create_app(
        WorkerSettings(model="builtin", backend="transformers", layers=f"{first}:{end}", stage_wait_s=2.0),
        runner=runner,
    )
    with served(app) as url:
        assert _answer(_post(url, StageRequest("held", 0, 0, np.array(PROMPT), next=stages[1:]))).held == len(
            PROMPT
        )
        app.state.start_drain()
        assert (
            _answer(_post(url, StageRequest("held", 1, len(PROMPT), np.array([5]), next=stages[1:]))).held
            == len(PROMPT) + 1
        )
        refused = _post(url, StageRequest("new", 0, 0, np.array(PROMPT), next=stages[1:]))
        assert_error(refused, 503, code="worker_draining")
        assert int(refused.headers["retry-after"]) > 0 and not app.state.worker.is_idle()
        for stage in (url, *stages[1:]):
            httpx.delete(f"{stage}/v1/sessions/held")
        assert app.state.worker.is_idle()


def test_a_whole_model_worker_refuses_stage_calls(whole: TransformersRunner) -> None:
    app = create_app(WorkerSettings(model="builtin", backend="transformers"), runner=whole)
    with served(app) as url:
        assert httpx.get(f"{url}/v1/info").json()["layer_range"] is None
        assert_error(_post(url, StageRequest("s", 0, 0, np.array(PROMPT))), 400, contains="--layers")


def test_worker_settings_take_a_layer_range() -> None:
    assert WorkerSettings(layers="0:15").layer_range == (0, 15)
    assert WorkerSettings().layer_range is None
    with pytest.raises(ValueError):
        WorkerSettings(layers="0-15")


def test_specgate_worker_refuses_a_llama_cpp_stage() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "workers", "--model", "builtin", "--layers", "0:15"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "cannot run a slice" in done.stderr and "--backend transformers" in done.stderr
