"""The worker app in-process (httpx.ASGITransport) on tiny-random: protocol v1 end to end."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import torch

from core.math.aggregation import reconstruct, tv_distance
from core.math.compression import compress_top_k
from core.math.random import Purpose, sample_index, uniform
from core.names import Reconstruction
from core.protocol import (
    BINARY_CONTENT_TYPE,
    JSON_CONTENT_TYPE,
    InfoResponse,
    VerifyRequest,
    VerifyResponse,
    decode,
    encode,
)
from core.runners import ModelRunner
from tests.workers.gated import GatedRunner
from workers.server import create_app
from workers.settings import WorkerSettings

V = 49152
PROMPT = [504, 3458, 28, 638, 359, 346, 1485, 1834, 47, 378, 253, 1097]


def _settings(**overrides: Any) -> WorkerSettings:
    return WorkerSettings(model="tiny-random", backend="transformers", **overrides)


async def _client(runner: ModelRunner, **overrides: Any) -> httpx.AsyncClient:
    app = create_app(_settings(**overrides), runner=runner)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker")


@pytest.fixture
async def client(tiny_runner: ModelRunner) -> AsyncIterator[httpx.AsyncClient]:
    async with await _client(tiny_runner) as c:
        yield c


_request = VerifyRequest.after


async def _verify(client: httpx.AsyncClient, req: VerifyRequest, as_json: bool = False) -> httpx.Response:
    body, content_type = encode(req, V, as_json=as_json)
    headers = {"content-type": content_type, "accept": content_type}
    return await client.post("/v1/verify", content=body, headers=headers)


async def _scores(client: httpx.AsyncClient, req: VerifyRequest) -> VerifyResponse:
    resp = await _verify(client, req)
    assert resp.status_code == 200, resp.text
    return decode(VerifyResponse, resp.content, resp.headers["content-type"])


def _reference(runner: ModelRunner, tokens: list[int], m: int) -> torch.Tensor:
    return torch.softmax(runner.forward_full(tokens, m), dim=-1)


async def test_info_describes_the_model(client: httpx.AsyncClient, tiny_runner: ModelRunner) -> None:
    resp = await client.get("/v1/info")
    info = decode(InfoResponse, resp.content, resp.headers["content-type"])
    assert (info.protocol_version, info.vocab_size, info.backend) == (1, V, "transformers")
    assert info.tokenizer_fingerprint == tiny_runner.fingerprint and len(info.tokenizer_fingerprint) == 64
    # core.modes, in its order
    assert 2 in info.eos_ids and info.modes == ["autoregressive", "aggregate", "split", "exact", "tree"]
    health = (await client.get("/health")).json()
    assert health["status"] == "ok" and health["instance_id"]


async def test_scores_equal_a_direct_forward_pass(
    client: httpx.AsyncClient, tiny_runner: ModelRunner
) -> None:
    draft = [11, 22, 33]
    resp = await _scores(client, _request("a", [], PROMPT, draft))
    assert resp.held == len(PROMPT) + 3 and resp.ids is None
    expected = _reference(tiny_runner, PROMPT + draft, 4)
    np.testing.assert_allclose(resp.probs, expected.numpy(), atol=1e-5)
    assert np.all(resp.tail_mass == 0)


async def test_top_k_and_sampling_params_are_applied(
    client: httpx.AsyncClient, tiny_runner: ModelRunner
) -> None:
    resp = await _scores(client, _request("a", [], PROMPT, [7], k=8, temperature=0.7, probs_dtype="fp16"))
    logits = tiny_runner.forward_full(PROMPT + [7], 2) / 0.7
    top = compress_top_k(torch.softmax(logits, -1), 8)
    assert resp.ids is not None and resp.ids.tolist() == top.ids.tolist()
    np.testing.assert_allclose(resp.probs, top.probs.numpy(), atol=1e-3)  # fp16 on the wire
    np.testing.assert_allclose(resp.tail_mass, top.tail_mass.numpy(), atol=1e-6)


async def test_recon_error_is_tv_of_the_asked_reconstruction(
    client: httpx.AsyncClient, tiny_runner: ModelRunner
) -> None:
    probs = _reference(tiny_runner, PROMPT + [7], 2)
    for method in ("renormalize", "residual"):
        resp = await _scores(client, _request(f"r-{method}", [], PROMPT, [7], k=16, reconstruction=method))
        assert resp.ids is not None and resp.recon_error is not None and resp.tail_mass is not None
        rebuilt = reconstruct(
            torch.tensor(resp.ids),
            torch.tensor(resp.probs),
            V,
            Reconstruction(method),
            torch.tensor(resp.tail_mass),
        )
        np.testing.assert_allclose(resp.recon_error, tv_distance(rebuilt, probs).numpy(), atol=1e-5)
    assert np.all(resp.recon_error <= resp.tail_mass + 1e-6)


async def test_autoregressive_sample_follows_its_stream(
    client: httpx.AsyncClient, tiny_runner: ModelRunner
) -> None:
    params = dict(mode="autoregressive", temperature=0.8, seed=1234, choice=1, worker=2, return_probs=False)
    resp = await _scores(client, _request("ar", [], PROMPT, [], **params))
    assert resp.probs is None and resp.samples is not None and resp.samples.shape == (1,)
    probs = torch.softmax(tiny_runner.forward_full(PROMPT, 1)[0] / 0.8, -1)
    u = uniform(1234, 1, len(PROMPT), Purpose.WORKER_SAMPLE, 2)
    assert int(resp.samples[0]) == sample_index(probs, u)
    again = await _scores(client, _request("ar", PROMPT[:-2], PROMPT[-2:], [], **params))
    # a retried round draws the same
    assert again.samples is not None and int(again.samples[0]) == int(resp.samples[0])
    body, _ = encode(_request("ar2", [], PROMPT, [], **params), V)
    assert len((await _verify(client, _request("ar2", [], PROMPT, [], **params))).content) < 150


async def test_json_encoding_both_ways(client: httpx.AsyncClient, tiny_runner: ModelRunner) -> None:
    resp = await _verify(client, _request("j", [], PROMPT, [5, 6], k=4), as_json=True)
    assert resp.headers["content-type"].startswith(JSON_CONTENT_TYPE)
    body = orjson.loads(resp.content)
    assert len(body["ids"]) == 3 and len(body["probs"][0]) == 4


async def test_a_verify_answer_tells_where_its_milliseconds_went(client: httpx.AsyncClient) -> None:
    """``Server-Timing``: the step's model and score, the route's codec, queue and total, in that order."""
    timing = (await _verify(client, _request("t", [], PROMPT, [5]))).headers["server-timing"]
    parts = ("model", "score", "codec", "queue", "total")
    assert re.fullmatch(", ".join(rf"{name};dur=\d+\.\d{{3}}" for name in parts), timing), timing


async def test_crop_and_append_equal_a_fresh_prefill(
    client: httpx.AsyncClient, tiny_runner: ModelRunner
) -> None:
    await _scores(client, _request("s", [], PROMPT, [100, 101, 102]))
    # the draft was rejected after one token: keep PROMPT + [100], append a recovered token
    agreed = PROMPT + [100]
    resp = await _scores(client, _request("s", agreed, [555], [9, 8]))
    assert resp.held == len(agreed) + 3
    expected = _reference(tiny_runner, agreed + [555, 9, 8], 3)
    np.testing.assert_allclose(resp.probs, expected.numpy(), atol=1e-5)


async def test_empty_tokens_rescore_the_last_agreed_position(
    client: httpx.AsyncClient, tiny_runner: ModelRunner
) -> None:
    await _scores(client, _request("e", [], PROMPT, [1, 2]))
    resp = await _scores(client, _request("e", PROMPT, [], [3]))
    np.testing.assert_allclose(resp.probs, _reference(tiny_runner, PROMPT + [3], 2).numpy(), atol=1e-5)


async def test_nothing_new_rescores_the_last_position(
    client: httpx.AsyncClient, tiny_runner: ModelRunner
) -> None:
    """What a greedy autoregressive step asks again with a larger k."""
    first = await _scores(client, _request("again", [], PROMPT, [], k=4))
    again = await _scores(client, _request("again", PROMPT, [], [], k=64))
    assert again.ids is not None and first.ids is not None and again.held == len(PROMPT)
    assert again.ids[0, :4].tolist() == first.ids[0].tolist()
    np.testing.assert_allclose(again.probs[0, :4], first.probs[0], atol=1e-6)


async def test_session_short_when_the_worker_holds_less_or_other(client: httpx.AsyncClient) -> None:
    resp = await _verify(client, _request("lost", PROMPT, [1], [2]))
    assert resp.status_code == 409
    assert resp.json()["error"]["code"] == "session_short" and resp.json()["held"] == 0

    await _scores(client, _request("s", [], PROMPT, [4]))  # holds PROMPT + [4]
    resp = await _verify(client, _request("s", PROMPT + [4, 5], [6], [7]))
    assert resp.status_code == 409 and resp.json()["held"] == len(PROMPT) + 1

    other = PROMPT[:-1] + [999]
    resp = await _verify(client, _request("s", other, [6], [7]))
    assert resp.status_code == 409 and resp.json()["held"] == 0
    # the gateway resends from what the worker holds, and carries on
    await _scores(client, _request("s", PROMPT + [4], [6], [7]))


# a tree under the root, as (token, parent): two children of the root, then a chain under each
TREE = [(504, -1), (3458, -1), (28, 0), (638, 1), (359, 2)]


async def _tree(client: httpx.AsyncClient, session: str) -> None:
    parents = np.array([p for _, p in TREE], dtype=np.int32)
    await _scores(client, _request(session, [], PROMPT, [t for t, _ in TREE], parents=parents))


async def test_a_path_keeps_the_accepted_nodes_of_the_last_tree(
    client: httpx.AsyncClient, tiny_runner: ModelRunner
) -> None:
    """Protocol v1.1: ``path`` names the accepted nodes; they end the agreed prefix and the
    call goes on from them as from a plain sequence (no resend of their tokens)."""
    await _tree(client, "p")
    agreed = PROMPT + [504, 28, 359]
    resp = await _scores(client, _request("p", agreed, [7], [42], path=np.array([0, 2, 4], dtype=np.int32)))
    assert resp.held == len(agreed) + 2 and tiny_runner.tokens("p") == agreed + [7, 42]
    np.testing.assert_allclose(resp.probs, _reference(tiny_runner, agreed + [7, 42], 2).numpy(), atol=1e-5)
    await _tree(client, "q")  # the second root child: its cells are not the first after the prompt
    agreed = PROMPT + [3458, 638]
    resp = await _scores(client, _request("q", agreed, [9], [], path=np.array([1, 3], dtype=np.int32)))
    np.testing.assert_allclose(resp.probs, _reference(tiny_runner, agreed + [9], 1).numpy(), atol=1e-5)


@pytest.mark.parametrize(
    "path",
    [[2], [0, 3], [1, 4], [0, 2, 9]],
    ids=["not-the-roots-child", "not-a-child", "another-branch", "no-such-node"],
)
async def test_a_path_that_is_no_root_to_node_path_gets_a_400_and_the_tree_stays(
    client: httpx.AsyncClient, path: list[int]
) -> None:
    await _tree(client, "bad")
    agreed = PROMPT + [TREE[n][0] if n < len(TREE) else 5 for n in path]
    resp = await _verify(client, _request("bad", agreed, [7], [], path=np.array(path, dtype=np.int32)))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "path", resp.text
    # the tree is still there
    await _scores(client, _request("bad", PROMPT + [504], [7], [], path=np.array([0], dtype=np.int32)))


async def test_a_path_without_its_tree_gets_a_409_then_the_resend_serves(client: httpx.AsyncClient) -> None:
    resp = await _verify(client, _request("never", PROMPT + [5], [7], [], path=np.array([0], dtype=np.int32)))
    assert resp.status_code == 409 and resp.json()["held"] == 0
    await _scores(client, _request("lost", [], PROMPT, []))  # no draft rows: no tree to take a path from
    resp = await _verify(client, _request("lost", PROMPT + [5], [7], [], path=np.array([0], dtype=np.int32)))
    assert resp.status_code == 409 and resp.json()["held"] == len(PROMPT)
    await _tree(client, "other")
    # node 0 is 504
    resp = await _verify(
        client, _request("other", PROMPT + [3458], [7], [], path=np.array([0], dtype=np.int32))
    )
    assert resp.status_code == 409 and resp.json()["held"] == len(PROMPT)
    # the gateway's resend: the path's tokens as tokens
    await _scores(client, _request("other", PROMPT, [3458, 7], []))


async def test_delete_frees_the_session(client: httpx.AsyncClient, tiny_runner: ModelRunner) -> None:
    await _scores(client, _request("d", [], PROMPT, [4]))
    assert (await client.delete("/v1/sessions/d")).status_code == 204
    assert not tiny_runner.has_session("d")
    assert (await _verify(client, _request("d", PROMPT, [1], [2]))).status_code == 409
    assert (await client.delete("/v1/sessions/never-was")).status_code == 204


async def test_lru_eviction_beyond_the_session_cap(tiny_runner: ModelRunner) -> None:
    async with await _client(tiny_runner, max_sessions=2) as client:
        for name in ("a", "b", "c"):
            await _scores(client, _request(name, [], PROMPT, [1]))
        assert (await _verify(client, _request("a", PROMPT, [2], [3]))).status_code == 409
        await _scores(client, _request("c", PROMPT, [2], [3]))
        metrics = (await client.get("/metrics")).text
        assert "specgate:sessions_evicted_total 1.0" in metrics


async def test_idle_sessions_expire(tiny_runner: ModelRunner) -> None:
    async with await _client(tiny_runner, session_ttl_s=0.2) as client:
        await _scores(client, _request("old", [], PROMPT, [1]))
        await asyncio.sleep(0.3)
        await _scores(client, _request("new", [], PROMPT, [1]))
        assert (await _verify(client, _request("old", PROMPT, [2], [3]))).status_code == 409


async def test_memory_cap_evicts_the_least_recent(tiny_runner: ModelRunner) -> None:
    per_token = tiny_runner.kv_bytes_per_token()
    long_prompt = (PROMPT * 200)[: int(2**20 * 0.6) // per_token]  # 60 % of a 1 MiB cap each
    async with await _client(tiny_runner, memory_cap_mb=1) as client:
        await _scores(client, _request("m1", [], long_prompt, [1]))
        await _scores(client, _request("m2", [], long_prompt, [1]))
        assert not tiny_runner.has_session("m1") and tiny_runner.has_session("m2")


def _raw(body: bytes, content_type: str = BINARY_CONTENT_TYPE) -> dict[str, str]:
    return {"content": body, "headers": {"content-type": content_type}}  # type: ignore[dict-item]


@pytest.mark.parametrize(
    "mutate, status, param",
    [
        (lambda b: b[:-3], 400, None),  # truncated binary
        (lambda b: b"SGv1garbage", 400, None),
        (lambda b: b"", 400, None),
    ],
)
async def test_malformed_bodies_get_400(
    client: httpx.AsyncClient, mutate: Any, status: int, param: str | None
) -> None:
    body, _ = encode(_request("x", [], PROMPT, [1]), V)
    resp = await client.post("/v1/verify", **_raw(mutate(body)))
    assert resp.status_code == status
    assert resp.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tokens": [V + 5], "draft": [1]}, "tokens"),
        ({"tokens": [1], "draft": [-3]}, "draft"),
        ({"tokens": [1], "draft": [1], "prefix_len": -2}, "prefix_len"),
        ({"tokens": [1], "draft": [1], "k": 0}, "k"),
        ({"tokens": [1], "draft": [1], "k": V + 1}, "k"),
        ({"tokens": [1], "draft": list(range(65))}, "draft"),
        ({"tokens": [], "draft": [1]}, "tokens"),
    ],
)
async def test_bad_values_get_400_naming_the_field(
    client: httpx.AsyncClient, fields: dict[str, Any], param: str
) -> None:
    body = {"session_id": "x", "prefix_len": 0, "prefix_hash": "", **fields}
    resp = await client.post("/v1/verify", **_raw(orjson.dumps(body), JSON_CONTENT_TYPE))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


async def test_a_draft_beyond_the_context_is_refused(tiny_runner: ModelRunner) -> None:
    async with await _client(tiny_runner, max_context=64) as client:
        await _scores(client, _request("c", [], PROMPT * 4, [1]))  # holds 49 of 64
        resp = await _verify(client, _request("c", PROMPT * 4, [2], list(range(20))))
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
        await _scores(client, _request("c", PROMPT * 4, [2], [3, 4]))  # the session still works


async def test_oversize_bodies_get_413(tiny_runner: ModelRunner) -> None:
    async with await _client(tiny_runner, max_body_bytes=512) as client:
        resp = await _verify(client, _request("big", [], PROMPT * 20, [1]))
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "payload_too_large"
        await _scores(client, _request("small", [], PROMPT[:4], [1]))


async def test_every_bad_input_leaves_other_sessions_served(
    client: httpx.AsyncClient, tiny_runner: ModelRunner
) -> None:
    await _scores(client, _request("keep", [], PROMPT, [1]))
    for body in (b"junk", orjson.dumps({"session_id": "keep", "prefix_len": 0})):
        await client.post("/v1/verify", **_raw(body, JSON_CONTENT_TYPE))
    resp = await _scores(client, _request("keep", PROMPT + [1], [2], [3]))
    np.testing.assert_allclose(resp.probs, _reference(tiny_runner, PROMPT + [1, 2, 3], 2).numpy(), atol=1e-5)


async def test_health_answers_while_a_verify_runs(tiny_runner: ModelRunner) -> None:
    blocking = GatedRunner(tiny_runner)
    async with await _client(blocking) as client:  # type: ignore[arg-type]
        pending = asyncio.create_task(_scores(client, _request("slow", [], PROMPT, [1])))
        for _ in range(500):
            if blocking.entered.is_set():
                break
            await asyncio.sleep(0.01)
        assert blocking.entered.is_set(), "the verify never reached the model"
        started = time.monotonic()
        assert (await client.get("/health")).status_code == 200
        assert time.monotonic() - started < 1.0
        blocking.gate.set()
        assert (await pending).held == len(PROMPT) + 1


async def test_exact_answers_on_the_supports_within_the_payload_bound(
    client: httpx.AsyncClient, tiny_runner: ModelRunner
) -> None:
    draft, size = [11, 22, 33, 44], 32
    supports = [np.array([x] + [t for t in range(100, 100 + size) if t != x][: size - 1]) for x in draft]
    req = _request(
        "x",
        [],
        PROMPT,
        draft,
        mode="exact",
        temperature=0.9,
        seed=5,
        support_ids=np.concatenate(supports),
        support_sizes=np.full(4, size, np.int32),
    )
    body, content_type = encode(req, V)
    raw = await client.post("/v1/verify", content=body, headers={"content-type": content_type})
    assert raw.status_code == 200, raw.text
    header_len = int.from_bytes(raw.content[4:8], "little")
    assert len(raw.content) - 8 - header_len <= len(draft) * size * 8  # ≤ γ·|S|·8 plus its header
    resp = decode(VerifyResponse, raw.content, raw.headers["content-type"])
    probs = torch.softmax(tiny_runner.forward_full(PROMPT + draft, 5) / 0.9, -1)
    assert (
        resp.support_probs is not None and resp.complement is not None and resp.complement_samples is not None
    )
    for j, support in enumerate(supports):
        np.testing.assert_allclose(
            resp.support_probs[j * size : (j + 1) * size], probs[j, support].numpy(), atol=1e-6
        )
        assert resp.complement[j] == pytest.approx(1 - float(probs[j, support].sum()), abs=1e-5)
        assert int(resp.complement_samples[j]) not in support.tolist()
    assert 0 <= resp.bonus < V


async def test_a_worker_token_is_required_when_set(
    tiny_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECGATE_WORKER_TOKEN", "wt-secret")  # how serve and compose hand it over
    app = create_app(WorkerSettings(model="tiny-random", backend="transformers"), runner=tiny_runner)
    req = _request("s-token", [], PROMPT, [5, 6])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        refused = await _verify(client, req)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert (await client.get("/v1/info", headers={"authorization": "Bearer wt-wrong"})).status_code == 401
        assert (await client.delete("/v1/sessions/s-token")).status_code == 401
        assert (await client.get("/health")).status_code == 200  # liveness stays open
        client.headers["authorization"] = "Bearer wt-secret"
        assert (await _verify(client, req)).status_code == 200
        assert (await client.get("/v1/info")).status_code == 200


async def test_a_draining_worker_serves_its_sessions_and_refuses_new_ones(
    client: httpx.AsyncClient, tiny_runner: ModelRunner
) -> None:
    """SIGTERM (issue 48): a session it holds goes on, a new one gets 503 worker_draining with Retry-After
    (the gateway takes another replica), /health answers 503 (readiness fails), /v1/info and freeing still
    answer."""
    app = create_app(_settings(), runner=tiny_runner)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://worker"
    ) as draining:
        assert (await _verify(draining, _request("s-held", [], PROMPT, [5]))).status_code == 200
        app.state.start_drain()
        held = await _verify(draining, _request("s-held", PROMPT + [5], [6], [7]))
        assert held.status_code == 200, held.text
        resp = await _verify(draining, _request("s-new", [], PROMPT, [5]))
        assert (
            resp.status_code == 503
            and resp.json()["error"]["code"] == "worker_draining"
            and int(resp.headers["retry-after"]) > 0
        )
        health = await draining.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert (await draining.get("/v1/info")).status_code == 200
        assert (await draining.delete("/v1/sessions/s-held")).status_code == 204
        assert (
            'specgate:verify_errors_total{code="worker_draining"} 1.0'
            in (await draining.get("/metrics")).text
        )


async def test_a_draining_worker_is_idle_only_with_no_call_in_flight_and_no_session(
    tiny_runner: ModelRunner,
) -> None:
    """A session's first call that arrived before SIGTERM is held in the model before its session exists: the
    worker is not idle until that call is answered and the session freed (else it would leave mid-round)."""
    blocking = GatedRunner(tiny_runner)
    app = create_app(_settings(), runner=blocking)  # type: ignore[arg-type]
    state = app.state.worker
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        assert state.is_idle()
        pending = asyncio.create_task(_scores(client, _request("first", [], PROMPT, [1])))
        for _ in range(500):
            if blocking.entered.is_set():
                break
            await asyncio.sleep(0.01)
        app.state.start_drain()
        assert not state.is_idle() and state.in_flight == 1
        blocking.gate.set()
        await pending
        assert not state.is_idle()  # its session is held: the gateway's next round may come
        assert (await client.delete("/v1/sessions/first")).status_code == 204
        assert state.is_idle()


async def test_metrics_count_what_was_served(client: httpx.AsyncClient) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    req = _request("m", [], PROMPT, [5, 6, 7])
    body = encode(req, V)[0]
    answer = await _verify(client, req)
    await client.post("/v1/verify", content=b"junk", headers={"content-type": BINARY_CONTENT_TYPE})
    text = (await client.get("/metrics")).text
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert values[("specgate:verify_requests_total", ())] == 1
    assert values[("specgate:verify_positions_scored_total", ())] == 4  # γ + 1
    assert values[("specgate:verify_bytes_in_total", ())] == len(body)
    assert values[("specgate:verify_bytes_out_total", ())] == len(answer.content)
    assert values[("specgate:verify_errors_total", (("code", "invalid_request"),))] == 1
    assert values[("specgate:sessions", ())] == 1
    slots = values[("specgate:session_slots", ())]  # the autoscaling signals (issue 48)
    assert (
        slots >= 1
        and values[("specgate:sessions_ratio", ())] == 1 / slots
        and values[("specgate:queue_length", ())] == 0
    )


async def test_grammars_compile_off_the_model_thread_once_per_content(
    tiny_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 46: a grammar compiled on the model thread stalled every session batched with it.
    It compiles on another thread, once per content; the worker's limit is its setting, and
    /v1/info reports it with the grammar engine (what the gateway checks)."""
    from core.grammar import Grammars, GrammarSpec, engine_version

    threads: list[str] = []
    build = Grammars._build

    def recording(self: Grammars, spec: GrammarSpec) -> Any:
        threads.append(threading.current_thread().name)
        return build(self, spec)

    monkeypatch.setattr(Grammars, "_build", recording)
    async with await _client(tiny_runner, max_grammar_bytes=200) as client:
        info = decode(InfoResponse, (await client.get("/v1/info")).content, JSON_CONTENT_TYPE)
        assert (info.grammar_engine, info.max_grammar_bytes) == (engine_version(), 200)
        transform = {
            "prompt_len": len(PROMPT),
            "grammar": GrammarSpec.json_schema(
                {"type": "object", "properties": {"a": {"type": "integer"}}}
            ).to_wire(),
        }
        for session in ("s1", "s2"):
            await _scores(client, _request(session, [], PROMPT, [], transform=transform))
        # once for both sessions, not on the model thread
        assert len(threads) == 1 and not threads[0].startswith("model")
        too_long = {
            "prompt_len": len(PROMPT),
            "grammar": GrammarSpec.json_schema({"enum": ["x" * 300]}).to_wire(),
        }
        resp = await _verify(client, _request("s3", [], PROMPT, [], transform=too_long))
        assert resp.status_code == 400 and "limit is 200" in resp.text
