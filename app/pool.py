"""The gateway's side of protocol v1: one client per worker, byte counting, resend on
``409 session_short``, and every transport or protocol failure mapped once to WorkerError."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx

from core.config import LinkConfig
from core.errors import ProtocolError, SpecgateError
from core.protocol import (
    BINARY_CONTENT_TYPE,
    ErrorBody,
    InfoResponse,
    VerifyRequest,
    VerifyResponse,
    check_verify_response,
    decode,
    encode,
)

log = logging.getLogger(__name__)

_MAX_RESENDS = 2  # held prefix, then from zero


class WorkerError(SpecgateError):
    """A worker that is down, timed out, or answered something unusable."""

    def __init__(self, worker: str, message: str, status: int = 502) -> None:
        super().__init__(f"worker {worker}: {message}")
        self.worker = worker
        self.status = status


@dataclass
class Traffic:
    """Bytes on the wire with one worker, both directions (DESIGN §4)."""

    sent: int = 0
    received: int = 0
    calls: int = 0


@dataclass
class WorkerClient:
    name: str
    url: str
    weight: float
    client: httpx.AsyncClient
    link: LinkConfig | None = None  # emulated network: delays each direction, never blocks the loop
    vocab_size: int = 0
    info: InfoResponse | None = None
    traffic: Traffic = field(default_factory=Traffic)

    async def fetch_info(self) -> InfoResponse:
        try:
            resp = await self.client.get(f"{self.url}/v1/info")
            resp.raise_for_status()
            info = decode(InfoResponse, resp.content, resp.headers.get("content-type"))
        except httpx.HTTPError as exc:
            raise WorkerError(self.name, f"/v1/info failed at {self.url}: {_describe(exc)}", 503) from exc
        except ProtocolError as exc:
            raise WorkerError(self.name, f"/v1/info answered garbage: {exc}") from exc
        self.info, self.vocab_size = info, info.vocab_size
        return info

    async def verify(self, req: VerifyRequest, agreed: list[int]) -> tuple[VerifyResponse, Traffic]:
        """One verify call; on ``session_short`` resend from what the worker holds (or zero).

        ``agreed`` is the whole token sequence the request's prefix is a part of: resending
        moves tokens from the prefix into ``tokens``.
        """
        traffic = Traffic()
        for _ in range(_MAX_RESENDS + 1):
            status, body = await self._post(req, traffic)
            if status == 200:
                resp = self._parse(body, req)
                return resp, traffic
            if status != 409:
                raise WorkerError(self.name, _error_message(status, body))
            held = _held(body)
            prefix = held if held < req.prefix_len else 0  # held ≥ prefix_len: the hash differed
            log.info("worker %s lost session %s (holds %d): resending from %d", self.name, req.session_id, held, prefix)
            req = _resend(req, agreed, prefix)
        raise WorkerError(self.name, "kept answering session_short after a resend from zero")

    async def delete_session(self, session_id: str) -> None:
        try:
            await self.client.delete(f"{self.url}/v1/sessions/{session_id}", timeout=5.0)
        except httpx.HTTPError as exc:
            log.warning("could not free session %s on worker %s: %s", session_id, self.name, _describe(exc))

    async def _post(self, req: VerifyRequest, traffic: Traffic) -> tuple[int, bytes]:
        body, content_type = encode(req, self.vocab_size)
        if self.link is not None:
            await asyncio.sleep(self.link.delay_s(len(body), upstream=True))
        try:
            resp = await self.client.post(f"{self.url}/v1/verify", content=body, headers={"content-type": content_type, "accept": BINARY_CONTENT_TYPE})
        except httpx.HTTPError as exc:
            raise WorkerError(self.name, f"verify failed at {self.url}: {_describe(exc)}", 503) from exc
        if self.link is not None:
            await asyncio.sleep(self.link.delay_s(len(resp.content), upstream=False))
        for t in (traffic, self.traffic):
            t.sent += len(body)
            t.received += len(resp.content)
            t.calls += 1
        return resp.status_code, resp.content

    def _parse(self, body: bytes, req: VerifyRequest) -> VerifyResponse:
        try:
            resp = decode(VerifyResponse, body, BINARY_CONTENT_TYPE)
            check_verify_response(resp, req, self.vocab_size)
        except ProtocolError as exc:
            raise WorkerError(self.name, f"answered garbage: {exc}") from exc
        return resp


def _resend(req: VerifyRequest, agreed: list[int], prefix: int) -> VerifyRequest:
    held_until = req.prefix_len + len(req.tokens)
    return VerifyRequest.after(
        req.session_id, agreed[:prefix], agreed[prefix:held_until], req.draft.tolist(),
        temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, k=req.k, probs_dtype=req.probs_dtype,
        mode=req.mode, reconstruction=req.reconstruction, seed=req.seed, choice=req.choice, worker=req.worker,
        return_probs=req.return_probs, draft_probs=req.draft_probs, support_ids=req.support_ids, support_sizes=req.support_sizes,
    )


def _held(body: bytes) -> int:
    try:
        held = ErrorBody.from_json(body).held
    except ProtocolError:
        return 0
    return held if isinstance(held, int) and held >= 0 else 0


def _error_message(status: int, body: bytes) -> str:
    try:
        return f"HTTP {status}: {ErrorBody.from_json(body).message}"
    except ProtocolError:
        return f"HTTP {status}: {body[:200]!r}"


def _describe(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class WorkerPool:
    """The federation: every worker, its weight, and one HTTP client shared by them all."""

    def __init__(self, workers: list[tuple[str, str, float, LinkConfig | None]], timeout_s: float, transport: httpx.AsyncBaseTransport | None = None) -> None:
        timeout = httpx.Timeout(timeout_s, connect=min(5.0, timeout_s))
        self.client = httpx.AsyncClient(timeout=timeout, transport=transport)
        self.workers = [WorkerClient(name, url.rstrip("/"), weight, self.client, link) for name, url, weight, link in workers]

    @property
    def weights(self) -> list[float]:
        return [w.weight for w in self.workers]

    async def fetch_infos(self) -> list[InfoResponse | WorkerError]:
        results = await asyncio.gather(*(w.fetch_info() for w in self.workers), return_exceptions=True)
        return [r if isinstance(r, (InfoResponse, WorkerError)) else WorkerError("?", str(r)) for r in results]

    async def delete_sessions(self, session_id: str) -> None:
        await asyncio.gather(*(w.delete_session(session_id) for w in self.workers))

    async def close(self) -> None:
        await self.client.aclose()
