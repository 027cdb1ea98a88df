"""A stage's link to the next (docs/design.md §3.7): its new rows' states sent on over HTTP — after the
emulated link's delay (``link_rtt_ms``, ``link_mbps``) — and that stage's answer passed back with
this one's time in front; a next stage that fails or cannot be reached, passed back as such."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
import numpy as np

from core.errors import InvalidRequest, ProtocolError
from core.protocol import ErrorBody, StageRequest, StageResponse, decode, encode
from workers.settings import WorkerSettings
from workers.stage import StageStates


class StageFailed(Exception):
    """A later stage failed or could not be reached: its status and error, passed back."""

    def __init__(self, status: int, body: ErrorBody) -> None:
        super().__init__(body.message)
        self.status, self.body = status, body


class StageLink:
    """The outbound client of one stage worker."""

    def __init__(self, settings: WorkerSettings, vocab_size: int) -> None:
        self.settings, self.vocab_size = settings, vocab_size
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.settings.stage_wait_s * 2, connect=5.0)
            )
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def send_on(self, req: StageRequest, states: StageStates) -> StageResponse:
        """The new rows' states to the next stage; its answer with this one's time in front."""
        urls = list(req.next) if req.next else ([self.settings.next] if self.settings.next else [])
        if not urls:
            raise InvalidRequest(
                f"this stage (layers {self.settings.layers}) is not the last: the call must name "
                "the next stages (next), or the worker its --next",
                param="next",
            )
        onward = replace(req, hidden=states.states.float().numpy(), next=urls[1:])
        payload, content_type = encode(onward, self.vocab_size)
        if self.settings.link_rtt_ms or self.settings.link_mbps:
            rate = self.settings.link_mbps * 1e6 / 8
            await asyncio.sleep(self.settings.link_rtt_ms / 2e3 + (len(payload) / rate if rate else 0.0))
        headers = {"content-type": content_type}
        if self.settings.token:
            headers["authorization"] = f"Bearer {self.settings.token}"
        url = urls[0].rstrip("/")
        try:
            answer = await self.client().post(f"{url}/v1/stage/forward", content=payload, headers=headers)
        except httpx.HTTPError as exc:
            message = f"the next stage {url} is unreachable: {type(exc).__name__} {exc}"
            raise StageFailed(
                502, ErrorBody(message, "server_error", param=url, code="stage_unreachable")
            ) from exc
        if answer.status_code != 200:
            try:
                body = ErrorBody.from_json(answer.content)
            except ProtocolError:
                body = ErrorBody(f"answered {answer.status_code}", "server_error")
            if answer.status_code >= 500 and body.code not in ("stage_unreachable", "stage_failed"):
                # that stage failed itself
                body = replace(body, param=url, code="stage_failed")
            raise StageFailed(answer.status_code, replace(body, message=f"stage {url}: {body.message}"))
        try:
            resp = decode(StageResponse, answer.content, answer.headers.get("content-type"))
        except ProtocolError as exc:
            raise StageFailed(
                502,
                ErrorBody(
                    f"stage {url} answered garbage: {exc}", "server_error", param=url, code="stage_failed"
                ),
            ) from exc
        stage_ms = np.concatenate(
            [[states.model_ms], np.asarray(resp.stage_ms if resp.stage_ms is not None else [], np.float32)]
        ).astype(np.float32)
        hops = np.concatenate(
            [[len(payload)], np.asarray(resp.hop_bytes if resp.hop_bytes is not None else [], np.int32)]
        ).astype(np.int32)
        return replace(resp, stage_ms=stage_ms, hop_bytes=hops)
