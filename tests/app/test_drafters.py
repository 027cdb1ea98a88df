"""Drafters behind one interface (app.drafting.drafters): a drafter a test defines and registers, and nothing
else, is served end to end — named in a request's ``speculative.drafter``, drafting each round, reported in
usage — and keeps the law (at T = 0 its text is autoregressive's); an unknown name, a name taken twice, and a
drafter asked for what it cannot do (overlap, a pipeline's tree) are refused by name (a model drafter on a
gateway without a model: tests/integration/test_gateway_e2e.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from app.drafting.batcher import DraftSeconds
from app.drafting.drafters import DRAFTERS, Drafter, DraftModel, register
from app.drafting.request import DraftRequest, delta_support
from core.math.tree import TokenTree
from tests.app.conftest import Gateway
from tests.app.helpers import assert_error

CHAT = {
    "model": "test-model",
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 12,
    "temperature": 0,
}


class RepeatLast(Drafter):
    """Proposes the sequence's last token again, ``gamma`` times, each with q̂ = δ: the toy drafter."""

    name, uses_model, grows_trees = "repeat-last", False, False

    def __init__(self) -> None:
        self.calls = 0

    async def chain(
        self,
        draft: DraftModel,
        request: DraftRequest,
        gamma: int,
        limit: int | None,
        cancel: threading.Event | None,
        timing: DraftSeconds | None,
    ) -> TokenTree:
        self.calls += 1
        tokens = [request.sequence[-1]] * gamma
        return TokenTree.chain(tokens, [delta_support(t) for t in tokens])


@pytest.fixture
def toy() -> Iterator[RepeatLast]:
    drafter = register(RepeatLast())
    try:
        yield drafter
    finally:
        DRAFTERS.pop(drafter.name)


async def test_a_drafter_registered_by_a_test_is_served_end_to_end_and_keeps_the_law(
    client: httpx.AsyncClient, toy: RepeatLast
) -> None:
    plain = (
        await client.post("/v1/chat/completions", json={**CHAT, "speculative": {"mode": "autoregressive"}})
    ).json()
    for mode in ("exact", "tree", "aggregate"):
        answer = (
            await client.post(
                "/v1/chat/completions", json={**CHAT, "speculative": {"mode": mode, "drafter": "repeat-last"}}
            )
        ).json()
        speculative = answer["usage"]["speculative"]
        assert speculative["drafter"] == "repeat-last" and speculative["draft_tokens"] > 0, speculative
        assert answer["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"], mode
    assert toy.calls >= 3


async def test_unknown_and_taken_names_and_what_a_drafter_cannot_do_are_refused(
    client: httpx.AsyncClient, gateway: Gateway, toy: RepeatLast
) -> None:
    resp = await client.post(
        "/v1/chat/completions", json={**CHAT, "speculative": {"mode": "exact", "drafter": "telepathy"}}
    )
    assert_error(resp, 400, "speculative.drafter", "'telepathy' is not a drafter")
    assert "repeat-last" in resp.json()["error"]["message"]
    with pytest.raises(ValueError, match="a name of its own"):
        register(RepeatLast())
    resp = await client.post(
        "/v1/chat/completions",
        json={**CHAT, "speculative": {"mode": "exact", "drafter": "repeat-last", "overlap": True}},
    )
    assert_error(resp, 400, "speculative.overlap", "'repeat-last' cannot prepare it")
    resp = await client.post(
        "/v1/chat/completions", json={**CHAT, "speculative": {"mode": "pipeline", "drafter": "repeat-last"}}
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] in (
        "speculative.mode",
        "speculative.drafter",
    )
