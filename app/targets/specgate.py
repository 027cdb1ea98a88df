"""The specgate worker as a target (protocol v1, docs/design.md §4): ``/v1/info``, ``/v1/verify`` (a 409 or a
full worker: ``AskAgain``)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from app.targets.channel import Channel, Expected, Replica, Traffic
from app.targets.failures import AskAgain, ReplicaFailure, error_body, error_message, refused, status_failure
from core.errors import ProtocolError
from core.protocol import (
    BINARY_CONTENT_TYPE,
    InfoResponse,
    VerifyRequest,
    VerifyResponse,
    check_verify_response,
    decode,
    encode,
)

log = logging.getLogger(__name__)

_HEADERS = {"content-type": BINARY_CONTENT_TYPE, "accept": BINARY_CONTENT_TYPE}


class SpecgateDialect:
    health_path: str | None = "/health"
    is_openai_logprobs = False

    def __init__(self, name: str, channel: Channel, expected: Expected) -> None:
        self.name, self.channel, self.expected = name, channel, expected

    async def info(self, replica: Replica) -> InfoResponse:
        info = await self.channel.info(replica)
        if (
            info.tokenizer_fingerprint != self.expected.fingerprint
            or info.vocab_size != self.expected.vocab_size
        ):
            raise ReplicaFailure(
                "fingerprint", f"serves another tokenizer/vocabulary ({info.model_id}, V={info.vocab_size})"
            )
        return info

    async def verify(
        self, replica: Replica, req: VerifyRequest, agreed: list[int], traffic: Traffic
    ) -> VerifyResponse:
        """One exchange: the answer, or why not — ``AskAgain`` for a 409 (``held``) or a full worker, which
        the replica set retries."""
        started = time.perf_counter()
        if req.ahead and not decodes_ahead(replica.info):
            # an older worker would refuse the field it does not know
            req = replace(req, ahead=False)
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
        if status == 400 and req.ahead and error is not None and error.param == "ahead":
            # an older worker came back at this address
            replica.info = None  # read again: the field stays off until it says it decodes ahead
            log.info("worker %s refused the ahead field: sending without it", replica.url)
            return await self.verify(replica, replace(req, ahead=False), agreed, traffic)
        if status == 503 and error is not None and error.code == "worker_draining":
            # a new session on a worker shutting down
            raise ReplicaFailure("draining", f"{replica.url} is draining: {error.message}")
        if status == 503 and error is not None and error.code == "worker_full":
            raise AskAgain(error_message(answer))
        if status != 409:
            raise refused(self.name, status_failure(status, answer, "verify"))
        raise AskAgain(
            error_message(answer),
            error.held if error is not None and isinstance(error.held, int) and error.held >= 0 else 0,
        )

    async def free(self, replica: Replica, session_id: str) -> None:
        await self.channel.free(replica, session_id)

    def scorable(self, sequence: list[int], draft: list[int]) -> int:
        return len(draft)  # a worker scores every draft token


def decodes_ahead(info: InfoResponse | None) -> bool:
    """Whether the replica said it decodes an ``ahead`` call's token while idle (``/v1/info``
    ``step.decode_ahead``): only such a worker gets the field (one that does not know it refuses the
    frame)."""
    return info is not None and bool((info.step or {}).get("decode_ahead"))
