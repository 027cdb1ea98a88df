"""The specgate worker as a target (protocol v1, DESIGN §4): ``/v1/info`` checked against the
draft's tokenizer, ``/v1/verify`` with the resend on ``409 session_short``, ``DELETE`` of a
session."""

from __future__ import annotations

import logging
import time

import httpx

from app.targets.base import (
    Channel,
    Expected,
    Replica,
    ReplicaFailure,
    Traffic,
    WorkerError,
    describe,
    resend,
    status_failure,
)
from core.errors import ProtocolError
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
_HEADERS = {"content-type": BINARY_CONTENT_TYPE, "accept": BINARY_CONTENT_TYPE}


class SpecgateDialect:
    health_path: str | None = "/health"
    is_engine = False

    def __init__(self, name: str, channel: Channel, expected: Expected) -> None:
        self.name, self.channel, self.expected = name, channel, expected

    async def info(self, replica: Replica) -> InfoResponse:
        resp = await self.channel.request("GET", replica, "/v1/info")
        if resp.status_code != 200:
            raise status_failure(resp.status_code, resp.content, "/v1/info")
        try:
            info = decode(InfoResponse, resp.content, resp.headers.get("content-type"))
        except ProtocolError as exc:
            raise ReplicaFailure("garbage", f"/v1/info answered garbage: {exc}") from exc
        if info.tokenizer_fingerprint != self.expected.fingerprint or info.vocab_size != self.expected.vocab_size:
            raise ReplicaFailure("fingerprint", f"serves another tokenizer/vocabulary ({info.model_id}, V={info.vocab_size})")
        return info

    async def verify(self, replica: Replica, req: VerifyRequest, agreed: list[int], traffic: Traffic) -> VerifyResponse:
        for _ in range(_MAX_RESENDS + 1):
            started = time.perf_counter()
            body, content_type = encode(req, self.expected.vocab_size)
            traffic.time(gateway_codec=time.perf_counter() - started)
            status, answer = await self.channel.exchange(replica, "/v1/verify", body, _HEADERS, traffic)
            if status == 200:
                started = time.perf_counter()
                try:
                    return self._parse(answer, req)
                finally:
                    traffic.time(gateway_codec=time.perf_counter() - started)
            if status != 409:
                failure = status_failure(status, answer, "verify")
                if failure.kind == "rejected":  # the request itself: every replica would refuse it
                    raise WorkerError(self.name, str(failure))
                raise failure
            held = _held(answer)
            prefix = held if held < req.prefix_len else 0  # held ≥ prefix_len: the hash differed
            log.info("worker %s lost session %s (holds %d): resending from %d", self.name, req.session_id, held, prefix)
            req = resend(req, agreed, prefix)
        raise ReplicaFailure("garbage", "kept answering session_short after a resend from zero")

    def _parse(self, body: bytes, req: VerifyRequest) -> VerifyResponse:
        try:
            resp = decode(VerifyResponse, body, BINARY_CONTENT_TYPE)
            check_verify_response(resp, req, self.expected.vocab_size)
        except ProtocolError as exc:
            raise ReplicaFailure("garbage", f"answered garbage: {exc}") from exc
        return resp

    async def free(self, replica: Replica, session_id: str) -> None:
        try:
            await self.channel.client.delete(f"{replica.url}/v1/sessions/{session_id}", timeout=5.0)
        except httpx.HTTPError as exc:
            log.warning("could not free session %s on worker %s (%s): %s", session_id, self.name, replica.url, describe(exc))

    def scorable(self, sequence: list[int], draft: list[int]) -> int:
        """A worker scores every draft token."""
        return len(draft)


def _held(body: bytes) -> int:
    try:
        held = ErrorBody.from_json(body).held
    except ProtocolError:
        return 0
    return held if isinstance(held, int) and held >= 0 else 0
