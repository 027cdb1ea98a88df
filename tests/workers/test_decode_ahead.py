"""Decoding ahead (``WorkerSettings.decode_ahead``): while idle, a CPU worker decodes an autoregressive
answer's token before its session's next call carries it. The answers are the ones it gives without (greedy
and seeded, the guessed token taken, another token sent instead, a call sent again, a call with a draft
after), and the head start is taken."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import httpx
import numpy as np

from core.protocol import VerifyRequest, VerifyResponse, decode, encode
from core.runners import ModelRunner
from workers.scheduler import Timing
from workers.server import create_app
from workers.settings import WorkerSettings

PROMPT = [504, 3458, 28, 638, 359, 346, 1485, 1834, 47, 378, 253, 1097]


async def _verify(client: httpx.AsyncClient, req: VerifyRequest) -> VerifyResponse:
    body, content_type = encode(req, 49152)
    resp = await client.post(
        "/v1/verify", content=body, headers={"content-type": content_type, "accept": content_type}
    )
    assert resp.status_code == 200, resp.text
    return decode(VerifyResponse, resp.content, resp.headers["content-type"])


def _token(answer: VerifyResponse) -> int:
    return int(answer.samples[0]) if answer.samples is not None else int(answer.ids[0, 0])


async def _conversation(
    runner: ModelRunner, ahead: bool, **params: Any
) -> tuple[list[VerifyResponse], dict[str, float]]:
    """A session's calls: four autoregressive rounds each carrying the token before, then one carrying another
    token (as when the gateway takes another worker's sample), the same call again, and a chain call with a
    draft."""
    runner.free_all()
    app = create_app(WorkerSettings(model="builtin", decode_ahead=ahead), runner=runner)
    answers: list[VerifyResponse] = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as client:
        agreed, new = [], list(PROMPT)
        for _ in range(4):
            answers.append(
                await _verify(
                    client,
                    VerifyRequest.after("s", agreed, new, [], mode="autoregressive", ahead=True, **params),
                )
            )
            agreed, new = agreed + new, [_token(answers[-1])]
        other = [(new[0] + 1) % 49152]  # not the worker's token
        for _ in range(2):
            answers.append(
                await _verify(
                    client,
                    VerifyRequest.after("s", agreed, other, [], mode="autoregressive", ahead=True, **params),
                )
            )
        answers.append(
            await _verify(
                client,
                VerifyRequest.after(
                    "s", agreed + other, [_token(answers[-1])], [11, 22], mode="exact", temperature=0.0
                ),
            )
        )
        counters = dict(app.state.worker.counters)
    return [replace(a, model_ms=0.0) for a in answers], counters


async def test_answers_with_and_without_decoding_ahead_are_one(builtin_llama: ModelRunner) -> None:
    for params in ({"temperature": 0.0, "k": 1}, {"temperature": 0.8, "seed": 1234, "return_probs": False}):
        with_ahead, counters = await _conversation(builtin_llama, True, **params)
        without, plain = await _conversation(builtin_llama, False, **params)
        assert with_ahead == without, params
        # the three guessed, not the other
        assert counters["taken_ahead"] == 3 and counters["decoded_ahead"] >= 4, (params, counters)
        assert plain.get("decoded_ahead", 0) == 0 and plain.get("taken_ahead", 0) == 0


async def test_a_session_freed_after_its_head_start_leaves_nothing_behind(builtin_llama: ModelRunner) -> None:
    app = create_app(WorkerSettings(model="builtin", decode_ahead=True), runner=builtin_llama)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as client:
        await _verify(
            client,
            VerifyRequest.after(
                "gone", [], PROMPT, [], mode="autoregressive", temperature=0.0, k=1, ahead=True
            ),
        )
        assert (await client.delete("/v1/sessions/gone")).status_code == 204
        # not ahead
        await _verify(
            client, VerifyRequest.after("next", [], PROMPT, [], mode="autoregressive", temperature=0.0, k=1)
        )
        steps = app.state.worker.steps
        assert app.state.worker.counters["decoded_ahead"] == 1  # the first only: the second call did not ask
        assert (
            "gone" not in steps._ahead
            and "gone" not in steps._wanted
            and np.isfinite(app.state.worker.counters["decoded_ahead"])
        )


def test_the_gateway_sends_ahead_only_to_a_worker_that_says_it_decodes_ahead() -> None:
    """``ahead`` is a field an older worker does not know (it refuses the frame): the gateway sends it only
    where the replica's ``/v1/info`` says ``step.decode_ahead``."""
    from app.targets.specgate import decodes_ahead
    from core.protocol import InfoResponse

    def info(step: dict[str, Any] | None) -> InfoResponse:
        return InfoResponse(
            protocol_version=1,
            modes=["autoregressive"],
            model_id="m",
            vocab_size=8,
            tokenizer_fingerprint="f",
            eos_ids=[2],
            max_context=64,
            backend="llama.cpp",
            step=step,
        )

    assert decodes_ahead(info({"scoring": "host", "decode_ahead": True}))
    assert not decodes_ahead(info({"scoring": "host", "decode_ahead": False})) and not decodes_ahead(
        info({"scoring": "host"})
    )
    assert not decodes_ahead(info(None)) and not decodes_ahead(None)


def test_a_session_answered_from_its_head_start_is_not_the_one_evicted(builtin_llama: ModelRunner) -> None:
    """A step that takes one call's decode done ahead and evicts (``max_sessions`` 2, a new session arriving)
    evicts another session, as it would without decoding ahead: the session keeps its rows and its transform
    (a logit bias that makes every token 504 here), and its next calls are answered without a resend."""
    builtin_llama.free_all()
    app = create_app(WorkerSettings(model="builtin", max_sessions=2, decode_ahead=True), runner=builtin_llama)
    steps = app.state.worker.steps
    bias = {"logit_bias": [[504, 100.0]]}
    params: dict[str, Any] = {"mode": "autoregressive", "temperature": 0.0, "k": 1, "ahead": True}
    first = steps.verify(VerifyRequest.after("A", [], PROMPT, [], transform=bias, **params))
    steps.verify(VerifyRequest.after("B", [], PROMPT[::-1], [], **params))
    # one session a hop
    assert steps.look_ahead() == 1 and steps.look_ahead() == 1 and steps.look_ahead() == 0
    agreed = [*PROMPT, _token(first)]
    out = steps.verify_batch(
        [
            VerifyRequest.after("A", PROMPT, agreed[-1:], [], **params),
            VerifyRequest.after("C", [], PROMPT[:6], [], **params),
        ],
        [Timing(), Timing()],
    )
    assert (
        isinstance(out[0], VerifyResponse)
        and out[0].held == len(agreed)
        and app.state.worker.counters["taken_ahead"] == 1
    )
    assert (
        "A" in app.state.worker.sessions
        and "B" not in app.state.worker.sessions
        and "A" in app.state.worker.sessions.transforms
    )
    for _ in range(2):
        agreed.append(_token(out[0]))
        steps.look_ahead()
        out = [steps.verify(VerifyRequest.after("A", agreed[:-1], agreed[-1:], [], **params))]
    assert agreed[len(PROMPT) :] == [504, 504, 504]
