"""What every kind of target shares (docs/design.md §1, §8): the ``Target`` base, the ``Dialect`` a kind of
target is spoken in, and a verify call resent from a shorter prefix (``resend``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import numpy as np

from app.targets.channel import Channel, Replica, Traffic
from core.protocol import InfoResponse, VerifyRequest, VerifyResponse, prefix_hash


class Dialect(Protocol):
    """How one kind of target is spoken to, replica by replica (``ReplicaSet`` does the rest)."""

    health_path: str | None  # probed before ``info`` when a breaker is open; None: straight to ``info``
    is_openai_logprobs: bool  # an OpenAI-compatible engine (docs/design.md §8), not a specgate worker

    # checked against Expected (ReplicaFailure otherwise)
    async def info(self, replica: Replica) -> InfoResponse: ...

    async def verify(
        self, replica: Replica, req: VerifyRequest, agreed: list[int], traffic: Traffic
    ) -> VerifyResponse: ...

    async def free(self, replica: Replica, session_id: str) -> None: ...

    def scorable(self, sequence: list[int], draft: list[int]) -> int: ...  # leading draft tokens it can score


class Target:
    """One weighted member of the federation (``ReplicaSet``, ``PipelineTarget``): ``verify``,
    ``delete_session``, ``scorable``, ``check_all``."""

    name: str
    weight: float
    channel: Channel

    @property
    def traffic(self) -> Traffic:
        return self.channel.traffic


def resend(req: VerifyRequest, agreed: list[int], prefix: int) -> VerifyRequest:
    """``req`` from a shorter prefix, every other field as it was but no ``path`` (the tree's accepted path is
    resent)."""
    held_until = req.prefix_len + len(req.tokens)
    tokens = np.asarray(agreed[prefix:held_until], dtype=np.int64)
    return replace(req, prefix_len=prefix, prefix_hash=prefix_hash(agreed[:prefix]), tokens=tokens, path=None)
