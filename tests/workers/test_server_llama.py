"""The worker app in-process on the llama.cpp backend: a position scores the same alone or
with others, so every mode scores against the same p (docs/design.md §7)."""

from __future__ import annotations

import httpx
import numpy as np

from core.protocol import VerifyRequest, VerifyResponse, decode, encode, prefix_hash
from core.runners import ModelRunner
from workers.server import create_app
from workers.settings import WorkerSettings


async def _verify(client: httpx.AsyncClient, req: VerifyRequest) -> VerifyResponse:
    body, content_type = encode(req, 49152)
    resp = await client.post("/v1/verify", content=body, headers={"content-type": content_type})
    assert resp.status_code == 200, resp.text
    return decode(VerifyResponse, resp.content, resp.headers["content-type"])


async def test_one_position_alone_equals_it_among_others(builtin_llama: ModelRunner) -> None:
    tokens = list(builtin_llama.tokenizer.encode("A batch of one must not change the scores of a position."))
    app = create_app(WorkerSettings(model="builtin"), runner=builtin_llama)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as client:
        together = await _verify(
            client, VerifyRequest("t", 0, "", np.array(tokens[:-3]), np.array(tokens[-3:]))
        )
        prefix = tokens[:-1]
        await _verify(client, VerifyRequest("a", 0, "", np.array(prefix[:-1]), np.array([prefix[-1]])))
        alone = await _verify(
            client,
            VerifyRequest(
                "a", len(prefix), prefix_hash(prefix), np.array([tokens[-1]]), np.array([], dtype=np.int64)
            ),
        )
    assert np.array_equal(alone.probs[0], together.probs[-1])
