"""The specgate worker as a target (protocol v1, docs/design.md §4): ``/v1/info``, ``/v1/verify`` with the resend on a 409."""

from __future__ import annotations

import asyncio
import logging
import time

from app.targets.base import resend
from app.targets.channel import Channel, Expected, Replica, Traffic
from app.targets.failures import ReplicaFailure, WorkerError, error_body, error_message, refused, status_failure
from core.errors import ProtocolError
from core.protocol import BINARY_CONTENT_TYPE, InfoResponse, VerifyRequest, VerifyResponse, check_verify_response, decode, encode

log = logging.getLogger(__name__)

_MAX_RESENDS = 2  # held prefix, then from zero
_FULL_FIRST_PAUSE_S = 0.25  # a full worker (503 worker_full): the first wait, doubling to 2 s
_FULL_WAIT_S = 30.0  # at most this long in all when the channel has no read timeout
_HEADERS = {"content-type": BINARY_CONTENT_TYPE, "accept": BINARY_CONTENT_TYPE}


class SpecgateDialect:
    health_path: str | None = "/health"
    is_engine = False

    def __init__(self, name: str, channel: Channel, expected: Expected) -> None:
        self.name, self.channel, self.expected = name, channel, expected

    async def info(self, replica: Replica) -> InfoResponse:
        info = await self.channel.info(replica)
        if info.tokenizer_fingerprint != self.expected.fingerprint or info.vocab_size != self.expected.vocab_size:
            raise ReplicaFailure("fingerprint", f"serves another tokenizer/vocabulary ({info.model_id}, V={info.vocab_size})")
        return info

    async def verify(self, replica: Replica, req: VerifyRequest, agreed: list[int], traffic: Traffic) -> VerifyResponse:
        resends, waits = 0, [0.0]  # the pauses so far for a full worker
        while resends <= _MAX_RESENDS:
            started = time.perf_counter()
            body, content_type = encode(req.on_wire(), self.expected.vocab_size)
            traffic.time(gateway_codec=time.perf_counter() - started)
            status, answer = await self.channel.exchange(replica, "/v1/verify", body, _HEADERS, traffic)
            if status == 200:
                started = time.perf_counter()
                try:
                    resp = decode(VerifyResponse, answer, BINARY_CONTENT_TYPE)
                    check_verify_response(resp, req, self.expected.vocab_size)
                    return resp
                except ProtocolError as exc:
                    raise ReplicaFailure("garbage", f"answered garbage: {exc}") from exc
                finally:
                    traffic.time(gateway_codec=time.perf_counter() - started)
            error = error_body(answer)
            if status == 503 and error is not None and error.code == "worker_draining":  # a new session on a worker shutting down
                raise ReplicaFailure("draining", f"{replica.url} is draining: {error.message}")
            if status == 503 and error is not None and error.code == "worker_full":
                await self._wait_full(req.session_id, answer, waits)
                continue
            if status != 409:
                raise refused(self.name, status_failure(status, answer, "verify"))
            held = error.held if error is not None and isinstance(error.held, int) and error.held >= 0 else 0
            prefix = held if held < req.prefix_len else 0  # held ≥ prefix_len: the hash differed
            log.info("worker %s lost session %s (holds %d): resending from %d", self.name, req.session_id, held, prefix)
            req = resend(req, agreed, prefix)
            resends += 1
        raise ReplicaFailure("garbage", "kept answering session_short after a resend from zero")

    async def _wait_full(self, session_id: str, answer: bytes, waits: list[float]) -> None:
        """A full worker (503 ``worker_full``) is only busy: ask again until the read timeout (docs/reliability.md)."""
        limit, waited = self.channel.timeout.read or _FULL_WAIT_S, sum(waits)
        if waited >= limit:
            raise WorkerError(self.name, f"{error_message(answer)} (waited {waited:.1f} s)", 503)
        pause = min(_FULL_FIRST_PAUSE_S * 2 ** (len(waits) - 1), 2.0, limit - waited)
        log.info("worker %s is full, session %s waits %.2f s: %s", self.name, session_id, pause, error_message(answer))
        await asyncio.sleep(pause)
        waits.append(pause)

    async def free(self, replica: Replica, session_id: str) -> None:
        await self.channel.free(replica, session_id)

    def scorable(self, sequence: list[int], draft: list[int]) -> int:
        return len(draft)  # a worker scores every draft token
