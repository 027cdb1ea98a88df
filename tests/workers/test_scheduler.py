"""The worker's VerifyScheduler on tiny-random in-process (httpx.ASGITransport): concurrent
sessions share steps and get what they get one at a time; a bad call fails alone; a step keeps
its token budget; DELETE waits for the step in progress."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import httpx
import numpy as np

from core.protocol import VerifyRequest, VerifyResponse, decode, encode
from core.runners import ModelRunner
from core.runners.model_thread import ModelThread
from tests.workers.gated import GatedRunner
from workers.scheduler import AGE_PASSES, Piece, Timing, VerifyScheduler
from workers.server import create_app
from workers.settings import WorkerSettings

V = 49152
PROMPT = [504, 3458, 28, 638, 359, 346, 1485, 1834, 47, 378, 253, 1097]


def _app(runner: Any, **overrides: Any) -> Any:
    return create_app(
        WorkerSettings(**{"model": "tiny-random", "backend": "transformers", **overrides}), runner=runner
    )


async def _post(client: httpx.AsyncClient, req: VerifyRequest) -> httpx.Response:
    body, content_type = encode(req, V)
    return await client.post(
        "/v1/verify", content=body, headers={"content-type": content_type, "accept": content_type}
    )


def _noting(
    client: httpx.AsyncClient, done: list[str]
) -> Callable[[VerifyRequest], Awaitable[httpx.Response]]:
    """``_post`` that notes each session in ``done`` as its answer arrives (the order calls were answered
    in)."""

    async def post(req: VerifyRequest) -> httpx.Response:
        resp = await _post(client, req)
        done.append(req.session_id)
        return resp

    return post


def _answer(resp: httpx.Response) -> VerifyResponse:
    assert resp.status_code == 200, resp.text
    return decode(VerifyResponse, resp.content, resp.headers["content-type"])


def _calls() -> list[VerifyRequest]:
    """8 sessions of mixed lengths: chains with drafts of 0–4 tokens, and two trees."""
    calls = []
    for i in range(8):
        prompt = PROMPT[: 4 + i]
        if i in (3, 6):
            calls.append(
                VerifyRequest.after(
                    f"s{i}",
                    [],
                    prompt,
                    [7, 9, 11],
                    parents=np.array([-1, -1, 0], dtype=np.int64),
                    temperature=1.0,
                )
            )
        else:
            calls.append(
                VerifyRequest.after(f"s{i}", [], prompt, list(range(20, 20 + i % 5)), temperature=1.0)
            )
    return calls


async def _until(event: threading.Event) -> None:
    for _ in range(500):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the step never reached the model")


async def _batched(
    runner: ModelRunner, calls: list[VerifyRequest], **overrides: Any
) -> tuple[list[httpx.Response], Any]:
    """``calls`` sent while a first step (session ``warm``) is held at the gate."""
    gated = GatedRunner(runner)
    app = _app(gated, **overrides)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        first = asyncio.create_task(_post(client, VerifyRequest.after("warm", [], PROMPT, [1])))
        await _until(gated.entered)
        pending = [asyncio.create_task(_post(client, req)) for req in calls]
        await asyncio.sleep(0.2)  # every call queued behind the held step
        gated.gate.set()
        answers = await asyncio.gather(*pending)
        assert (await first).status_code == 200
    return list(answers), app.state.worker.scheduler.steps


async def _alone_and_batched(runner: ModelRunner) -> list[tuple[VerifyResponse, VerifyResponse]]:
    calls = _calls()
    alone = []
    for req in calls:
        app = _app(runner)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://worker"
        ) as client:
            alone.append(_answer(await _post(client, req)))
        runner.free_all()
    answers, steps = await _batched(runner, calls)
    assert steps.sizes == [1, 8]  # the held step, then every waiting session in one
    pairs = []
    for one, shared, req in zip(alone, answers, calls):
        got = _answer(shared)
        assert got.batch_sessions == 8 and one.batch_sessions == 1
        assert got.held == one.held == len(req.tokens) + len(req.draft)
        pairs.append((one, got))
    return pairs


async def test_concurrent_sessions_share_steps_and_get_their_own_distributions(
    tiny_runner: ModelRunner,
) -> None:
    for one, got in await _alone_and_batched(tiny_runner):
        np.testing.assert_allclose(got.probs, one.probs, atol=1e-4, rtol=0)


async def test_on_the_builtin_model_a_shared_step_is_bit_for_bit_one_at_a_time(
    builtin_llama: ModelRunner,
) -> None:
    """llama.cpp: the six chain sessions share decodes (streams of one context), the two trees
    decode in their own contexts; every distribution is the one it gets alone, bit for bit."""
    for one, got in await _alone_and_batched(builtin_llama):
        np.testing.assert_array_equal(got.probs, one.probs)


async def test_a_failing_call_fails_alone_in_its_step(tiny_runner: ModelRunner) -> None:
    calls = _calls()[:4]
    # a prefix the worker does not hold: 409
    calls[1] = VerifyRequest.after("s1", PROMPT[:3], [5], [6], temperature=1.0)
    # a malformed tree: 400
    calls[2] = VerifyRequest.after("s2", [], PROMPT[:5], [7, 8], parents=np.array([-1, 5], dtype=np.int64))
    answers, steps = await _batched(tiny_runner, calls)
    assert steps.sizes == [1, 4]
    assert [a.status_code for a in answers] == [200, 409, 400, 200]
    assert answers[1].json()["error"]["code"] == "session_short"
    # the two that reached the forward
    assert _answer(answers[0]).batch_sessions == _answer(answers[3]).batch_sessions == 2


async def test_a_step_keeps_its_token_budget_and_one_call_per_session(tiny_runner: ModelRunner) -> None:
    calls = _calls()
    # s0's next call: a later step
    calls.append(VerifyRequest.after("s0", PROMPT[:4], [30], [31], temperature=1.0))
    answers, steps = await _batched(tiny_runner, calls, max_batch_tokens=20)
    assert all(a.status_code == 200 for a in answers[:-1])
    sizes = [len(r.tokens) + len(r.draft) for r in calls]
    assert sum(steps.sizes) == 1 + len(calls)
    assert all(tokens <= 20 or size == 1 for tokens, size in zip(steps.tokens, steps.sizes))
    assert max(steps.sizes[1:]) > 1 and len(steps.sizes) >= 1 + -(-sum(sizes) // 20)
    # s0's second call went after its first (it holds the first's prefix then): answered
    assert answers[-1].status_code == 200


async def test_delete_during_a_step_frees_the_session_after_it(tiny_runner: ModelRunner) -> None:
    gated = GatedRunner(tiny_runner)
    app = _app(gated)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        call = asyncio.create_task(_post(client, VerifyRequest.after("doomed", [], PROMPT, [1, 2])))
        await _until(gated.entered)
        deleted = asyncio.create_task(client.delete("/v1/sessions/doomed"))
        await asyncio.sleep(0.2)
        assert not deleted.done()  # ordered after the step in progress
        gated.gate.set()
        assert _answer(await call).held == len(PROMPT) + 2
        assert (await deleted).status_code == 204
    assert tiny_runner.length("doomed") == 0


async def test_a_new_session_gets_503_while_live_sessions_hold_every_stream(
    builtin_llama: ModelRunner,
) -> None:
    """The built-in model at 512 MB has 8 KV streams: 8 live chain sessions hold them, a 9th
    gets 503 worker_full with Retry-After (none of the 8 is rebuilt); a DELETE, or a session
    idle for session_live_s, makes room; tree sessions hold no stream."""
    streams = builtin_llama.num_streams  # type: ignore[attr-defined]
    assert streams == 8
    app = create_app(
        WorkerSettings(model="builtin", memory_cap_mb=512, session_live_s=1.0), runner=builtin_llama
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        tree = VerifyRequest.after(
            "tree", [], PROMPT[:5], [7, 9], parents=np.array([-1, -1], dtype=np.int64), temperature=1.0
        )
        _answer(await _post(client, tree))
        for i in range(streams):
            _answer(
                await _post(client, VerifyRequest.after(f"s{i}", [], PROMPT[: 3 + i], [20], temperature=1.0))
            )
        # issue 59: the autoscaler's signal is 1 here, where new sessions are refused (it was 8 of
        # --max-sessions 64)
        metrics = (await client.get("/metrics")).text
        assert (
            "specgate:sessions_ratio 1.0" in metrics
            and "specgate:session_slots 8.0" in metrics
            and "specgate:sessions_live 9.0" in metrics
        )
        full = await _post(client, VerifyRequest.after("late", [], PROMPT, [20], temperature=1.0))
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        error = full.json()["error"]
        assert (
            error["code"] == "worker_full"
            and "one of the 9 sessions used in the last 1 s" in error["message"]
        ), error
        # the 8 sessions were not displaced: each continues from its prefix
        for i in range(streams):
            sequence = PROMPT[: 3 + i] + [20]
            _answer(await _post(client, VerifyRequest.after(f"s{i}", sequence, [21], [], temperature=1.0)))
        assert (await client.delete("/v1/sessions/s0")).status_code == 204
        _answer(await _post(client, VerifyRequest.after("late", [], PROMPT, [20], temperature=1.0)))
        assert (
            await _post(client, VerifyRequest.after("later", [], PROMPT, [20], temperature=1.0))
        ).status_code == 503
        await asyncio.sleep(1.1)  # every session is idle past session_live_s now
        # 9 held of --max-sessions 64, none live
        assert "specgate:sessions_ratio 0.140625" in (await client.get("/metrics")).text
        _answer(await _post(client, VerifyRequest.after("later", [], PROMPT, [20], temperature=1.0)))
        metrics = (await client.get("/metrics")).text
        assert 'specgate:verify_errors_total{code="worker_full"} 2.0' in metrics


async def test_a_long_prompt_goes_in_pieces_beside_the_other_calls(builtin_llama: ModelRunner) -> None:
    """Chunked prefill: a 300-token first call goes ``prefill_chunk`` (64 here) tokens a step; the four short
    calls queued behind it go first, in one step, and are answered then, not after the whole prefill; the long
    call's answer is bit for bit the one it gets in one piece (llama.cpp decodes ≤ 32 tokens either way)."""
    # in no prompt cache
    long = VerifyRequest.after(
        "long", [], [(i * 7919) % 40000 + 100 for i in range(300)], [7, 9], temperature=1.0
    )
    short = [VerifyRequest.after(f"s{i}", [], PROMPT[: 4 + i], [20, 21], temperature=1.0) for i in range(4)]
    builtin_llama.free_all()
    gated = GatedRunner(builtin_llama)
    app = _app(gated, backend="llama.cpp", prefill_chunk=64)
    done: list[str] = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        post = _noting(client, done)
        first = asyncio.create_task(_post(client, VerifyRequest.after("warm", [], PROMPT, [1])))
        await _until(gated.entered)
        pending = [asyncio.create_task(post(req)) for req in [long, *short]]
        await asyncio.sleep(0.2)
        gated.gate.set()
        answers = await asyncio.gather(*pending)
        assert (await first).status_code == 200
    steps = app.state.worker.scheduler.steps
    assert steps.sizes == [1, 4, 1, 1, 1, 1, 1] and steps.tokens[1:] == [
        4 * 2 + sum(range(4, 8)),
        64,
        64,
        64,
        64,
        44 + 2,
    ]
    assert done[-1] == "long"  # the short calls did not wait for the whole prefill
    pieced = _answer(answers[0])
    builtin_llama.free_all()
    app = _app(builtin_llama, backend="llama.cpp", prefill_chunk=512)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        whole = _answer(await _post(client, replace(long, session_id="whole")))
    np.testing.assert_array_equal(pieced.probs, whole.probs)
    assert pieced.held == whole.held == 302 and all(a.status_code == 200 for a in answers)


async def test_a_trees_long_first_call_goes_in_pieces_and_health_tells_busy_from_stuck(
    builtin_llama: ModelRunner,
) -> None:
    """Issue 76: a tree's first call carried its long prompt whole, in one step, so a worker busy with four of
    them was silent past the gateway's read timeout. Its agreed tokens now go in pieces, the last with the
    tree, answered bit for bit as in one piece. ``/health``'s ``stalled_s`` (how long the model finished no
    step while work waits) stays 0 while idle and grows while a step is held: what the gateway reads to tell a
    busy worker from a stuck one."""
    tokens = [(i * 7919) % 40000 + 100 for i in range(150)]
    tree = VerifyRequest.after(
        "tree", [], tokens, [7, 9, 11], parents=np.array([-1, -1, 0], dtype=np.int64), temperature=1.0
    )
    builtin_llama.free_all()
    # rows each llama.cpp decode takes: the pieces go where the tree will be, decoded once
    decoded: list[int] = []
    decode = builtin_llama._decode  # type: ignore[attr-defined]
    builtin_llama._decode = lambda ctx, entries, *a, **k: (
        decoded.append(len(entries)),
        decode(ctx, entries, *a, **k),
    )[1]  # type: ignore[attr-defined]
    gated = GatedRunner(builtin_llama)
    app = _app(gated, backend="llama.cpp", prefill_chunk=48)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        assert (await client.get("/health")).json()["stalled_s"] == 0
        pending = asyncio.create_task(_post(client, tree))
        await _until(gated.entered)
        await asyncio.sleep(0.3)
        stalled = (await client.get("/health")).json()["stalled_s"]
        live = await client.get("/health/live")
        gated.gate.set()
        pieced = _answer(await pending)
        assert (await client.get("/health")).json()["stalled_s"] == 0
    del builtin_llama._decode  # type: ignore[attr-defined]
    assert stalled >= 0.25 and live.status_code == 200
    assert app.state.worker.scheduler.steps.tokens == [48, 48, 48, 6 + 3]
    assert sum(decoded) == 153 and not any(s.session_id == "tree" for s in builtin_llama._streams)  # type: ignore[attr-defined]  # no chain's stream taken
    builtin_llama.free_all()
    app = _app(builtin_llama, backend="llama.cpp", prefill_chunk=512)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        whole = _answer(await _post(client, replace(tree, session_id="whole")))
    assert app.state.worker.scheduler.steps.tokens == [153]
    np.testing.assert_array_equal(pieced.probs, whole.probs)
    assert pieced.held == whole.held == 153


async def test_a_delete_and_the_calls_behind_it_do_not_wait_for_a_long_prefill(
    tiny_runner: ModelRunner,
) -> None:
    """A ``DELETE`` runs between two steps: behind a long call in pieces, between two of its pieces, and the
    calls after it go on (before, a session's ``DELETE`` behind a 2,000-token prefill held every stream for
    the whole of it)."""
    gated = GatedRunner(tiny_runner)
    app = _app(gated, prefill_chunk=4)
    done: list[str] = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        post = _noting(client, done)

        async def delete(session_id: str) -> httpx.Response:
            resp = await client.delete(f"/v1/sessions/{session_id}")
            done.append(f"DELETE {session_id}")
            return resp

        gated.gate.set()  # the session to delete, answered at once (the gate closes behind it)
        _answer(await _post(client, VerifyRequest.after("gone", [], PROMPT[:4], [1])))
        gated.gate.clear()
        gated.entered.clear()
        first = asyncio.create_task(_post(client, VerifyRequest.after("warm", [], PROMPT, [1])))
        await _until(gated.entered)
        long = asyncio.create_task(post(VerifyRequest.after("long", [], (PROMPT * 10)[:120], [1])))
        await asyncio.sleep(0.1)
        tasks = [
            asyncio.create_task(delete("gone")),
            asyncio.create_task(post(VerifyRequest.after("again", [], PROMPT[:10], [2]))),
        ]
        await asyncio.sleep(0.1)
        gated.gate.set()
        assert (await tasks[0]).status_code == 204 and _answer(await tasks[1]).held == 11
        assert _answer(await long).held == 121 and (await first).status_code == 200
    assert done == ["DELETE gone", "again", "long"]


class _Recorder:
    """A step host that records each step's work and answers at once (the scheduler's order, no model)."""

    def __init__(self) -> None:
        self.thread = ModelThread()
        self.steps: list[list[tuple[str, bool]]] = []

    def verify_batch(self, reqs: list[Any], timings: list[Timing]) -> list[Any]:
        self.steps.append([(r.session_id, isinstance(r, Piece) and r.end is not None) for r in reqs])
        return ["answer"] * len(reqs)


async def test_a_long_calls_pieces_go_in_free_steps_and_one_in_four_beside_the_others() -> None:
    """Twelve short calls queued behind a long one, two to a step (``max_batch_tokens`` 8): the long call's
    pieces wait three steps, then go beside them one step in four, then alone once they are answered; its
    answer comes last."""
    host = _Recorder()
    scheduler = VerifyScheduler(host, max_batch_tokens=8, prefill_chunk=4)
    long = asyncio.create_task(
        scheduler.verify(VerifyRequest.after("long", [], list(range(1, 25)), [1]), Timing())
    )
    short = [
        asyncio.create_task(scheduler.verify(VerifyRequest.after(f"s{i}", [], [1, 2], [3]), Timing()))
        for i in range(12)
    ]
    assert await asyncio.gather(long, *short) == ["answer"] * 13
    await scheduler.close()
    host.thread.close()
    shape = [
        "".join("p" if piece else "l" if s == "long" else "s" for s, piece in step) for step in host.steps
    ]
    # 20 of its 24 tokens in pieces of 4, then the call
    assert shape == ["ss", "ss", "ss", "ssp", "ss", "ss", "p", "p", "p", "p", "l"]


async def test_of_two_long_calls_the_one_with_fewer_tokens_left_goes_first() -> None:
    """Shortest first among long calls: a session sent again from zero (a few hundred tokens) does not wait
    behind a 2,000-token prompt; the longer one goes on once it is done."""
    host = _Recorder()
    scheduler = VerifyScheduler(host, max_batch_tokens=8, prefill_chunk=4)
    calls = [
        scheduler.verify(VerifyRequest.after(name, [], list(range(1, n + 1)), [1]), Timing())
        for name, n in (("long", 40), ("again", 20))
    ]
    assert await asyncio.gather(*calls) == ["answer", "answer"]
    await scheduler.close()
    host.thread.close()
    order = [s for step in host.steps for s, _ in step]
    assert order == ["again"] * 5 + ["long"] * 10  # 4 pieces and the call, then 9 and the call


async def test_shorter_long_calls_arriving_all_the_time_do_not_starve_a_long_one() -> None:
    """Issue 76: shortest first let a stream of shorter long prompts hold a long one back for ever, while the
    worker's /health showed it progressing (so the gateway waited on). A long call passed over ``AGE_PASSES``
    times goes next."""
    host = _Recorder()
    scheduler = VerifyScheduler(host, max_batch_tokens=8, prefill_chunk=4)
    calls = [scheduler.verify(VerifyRequest.after("long", [], list(range(1, 101)), [1]), Timing())]
    calls += [
        scheduler.verify(VerifyRequest.after(f"again{i}", [], list(range(1, 13)), [1]), Timing())
        for i in range(20)
    ]
    assert await asyncio.gather(*calls) == ["answer"] * 21
    await scheduler.close()
    host.thread.close()
    pieces = [s for step in host.steps for s, piece in step if piece]
    turns = [i for i, s in enumerate(pieces) if s == "long"]
    assert turns[0] == AGE_PASSES and all(b - a <= AGE_PASSES + 1 for a, b in zip(turns, turns[1:]))


async def test_a_long_prompt_seen_before_takes_the_prompt_cache_not_its_pieces(
    builtin_llama: ModelRunner,
) -> None:
    """A long call's first piece takes what the prompt cache holds of it (as a whole call would): the second
    session with the same 300 tokens decodes only its last token and its draft, and gets the first one's
    answer bit for bit."""
    builtin_llama.free_all()
    app = _app(builtin_llama, backend="llama.cpp", prefill_chunk=64)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        prompt = (PROMPT * 25)[:300]
        first = _answer(await _post(client, VerifyRequest.after("one", [], prompt, [7, 9], temperature=1.0)))
        assert (await client.delete("/v1/sessions/one")).status_code == 204
        steps = len(app.state.worker.scheduler.steps.sizes)
        again = _answer(await _post(client, VerifyRequest.after("two", [], prompt, [7, 9], temperature=1.0)))
        tokens = app.state.worker.scheduler.steps.tokens[steps:]
    # what the prompt cache holds (299 rows) not fed again: a first piece with no decode, then the last token
    # with the draft
    assert len(tokens) == 2 and tokens[-1] == 3
    np.testing.assert_array_equal(again.probs, first.probs)


async def test_on_two_threads_a_long_prompt_scores_alike_in_pieces_whole_and_from_the_prompt_cache(
    builtin_llama_two_threads: ModelRunner,
) -> None:
    """Issue 58 on two threads (llama.cpp's one-token kernel sums a cache of more than 256 cells in one part
    per thread): two long first calls — one with no draft, whose last piece decodes its last token alone
    (autoregressive), one with a draft — fed in pieces of 16 beside short calls, then sent again by new
    sessions (the prompt cache: one token and the draft decoded), then whole on a fresh runner: bit for bit
    one answer each, and no decode reached 64 tokens."""
    from core.runners import load_runner
    from core.runners.llama_cpp_runner import DECODE_TOKENS, LlamaCppRunner

    runner = builtin_llama_two_threads
    assert isinstance(runner, LlamaCppRunner)
    rng = np.random.default_rng(5858)
    prompts = [[int(t) for t in rng.integers(100, 40000, n)] for n in (270, 262)]  # in no prompt cache
    longs = [
        VerifyRequest.after("a", [], prompts[0], [], temperature=1.0),
        VerifyRequest.after("b", [], prompts[1], [7, 9], temperature=1.0),
    ]
    short = [VerifyRequest.after(f"s{i}", [], PROMPT[: 4 + i], [20], temperature=1.0) for i in range(3)]
    answers, steps = await _batched(runner, [*longs, *short], backend="llama.cpp", prefill_chunk=16)
    pieced = [_answer(a) for a in answers[:2]]
    assert len(steps.sizes) > 20 and max(steps.tokens) <= 16 + 3 * 5  # in pieces, beside the short calls
    for req in longs:
        runner.free(req.session_id)  # their cells stay, idle: a prompt cache
    one_thread, runner.max_decode_tokens = runner.one_thread_decodes, 0
    app = _app(runner, backend="llama.cpp", prefill_chunk=512)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        cached = [
            _answer(await _post(client, replace(req, session_id=f"again {req.session_id}"))) for req in longs
        ]
    assert runner.one_thread_decodes > one_thread and runner.max_decode_tokens <= DECODE_TOKENS
    fresh = load_runner("builtin", "llama.cpp", threads=2, memory_cap_mb=256)
    try:
        app = _app(fresh, backend="llama.cpp", prefill_chunk=512)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://worker"
        ) as client:
            whole = [_answer(await _post(client, req)) for req in longs]
    finally:
        fresh.close()
    for one, two, three in zip(pieced, cached, whole):
        np.testing.assert_array_equal(one.probs, three.probs)
        np.testing.assert_array_equal(two.probs, three.probs)


async def test_on_transformers_a_long_prompt_in_pieces_scores_within_its_promise(
    tiny_runner: ModelRunner,
) -> None:
    """transformers keeps the weaker promise the README gives (its kernels see other shapes in pieces and
    batches): a 300-token first call fed in pieces of 64 beside a short call scores within 1e-4 of the same
    call whole and alone."""
    rng = np.random.default_rng(5859)
    prompt = [int(t) for t in rng.integers(100, 40000, 300)]
    long, short = (
        VerifyRequest.after("long", [], prompt, [7, 9], temperature=1.0),
        VerifyRequest.after("short", [], PROMPT, [20], temperature=1.0),
    )
    answers, steps = await _batched(tiny_runner, [long, short], prefill_chunk=64)
    assert len(steps.sizes) >= 5  # the held step, the short call, the pieces
    tiny_runner.free_all()
    app = _app(tiny_runner, prefill_chunk=512)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        whole = _answer(await _post(client, replace(long, session_id="whole")))
    np.testing.assert_allclose(_answer(answers[0]).probs, whole.probs, atol=1e-4, rtol=0)


class _Pipelined(_Recorder):
    """A step host whose device work runs while the host goes on (``overlaps``): launched steps answer at
    ``finish``."""

    overlaps = True

    def __init__(self) -> None:
        super().__init__()
        self.in_flight: list[set[str]] = []
        self.most = 0
        self.exclusive_beside: list[int] = []

    def launch(self, reqs: list[Any], timings: list[Timing]) -> Any:
        sessions = {r.session_id for r in reqs}
        # a session's next call waits for its answer
        assert not any(sessions & other for other in self.in_flight), (sessions, self.in_flight)
        self.steps.append([(r.session_id, isinstance(r, Piece) and r.end is not None) for r in reqs])
        self.in_flight.append(sessions)
        self.most = max(self.most, len(self.in_flight))
        return sessions, len(reqs)

    def finish(self, pending: Any) -> list[Any]:
        sessions, count = pending
        self.in_flight.remove(sessions)
        return ["answer"] * count

    def free(self, session_id: str) -> None:
        self.exclusive_beside.append(len(self.in_flight))


async def test_on_a_device_that_runs_on_the_next_step_is_launched_before_the_last_answers() -> None:
    """Issue 73: where a step's device work runs while the host goes on, the scheduler launches the next step
    (other sessions only: a session's pieces and calls wait for its answer) before taking the last one's
    answers — two in flight at most; an exclusive entry (a DELETE) runs with none in flight; every call is
    answered."""
    host = _Pipelined()
    scheduler = VerifyScheduler(host, max_batch_tokens=8, prefill_chunk=4)
    long = asyncio.create_task(
        scheduler.verify(VerifyRequest.after("long", [], list(range(1, 25)), [1]), Timing())
    )
    short = [
        asyncio.create_task(scheduler.verify(VerifyRequest.after(f"s{i}", [], [1, 2], [3]), Timing()))
        for i in range(12)
    ]
    await asyncio.sleep(0)
    gone = asyncio.create_task(scheduler.exclusive(host.free, "s0"))
    assert await asyncio.gather(long, *short) == ["answer"] * 13
    await gone
    await scheduler.close()
    host.thread.close()
    assert host.most == 2 and scheduler.overlapped > 0 and host.exclusive_beside == [0]
    assert sum(1 for step in host.steps for s, piece in step if s == "long" and piece) == 5 and host.steps[
        -1
    ] == [("long", False)]
