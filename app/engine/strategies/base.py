"""A strategy is how one mode verifies a round (DESIGN §3): what it asks of the targets, which
pure function of ``core.math`` decides, what the round emits. What a mode accepts and needs is
``core.modes``; the engine's loop (``app.engine.loop``) is the same for every strategy."""

from __future__ import annotations

from abc import ABC, abstractmethod

from app.engine.round import Round
from app.engine.spec import RoundResult


class Strategy(ABC):
    @abstractmethod
    async def verify(self, rnd: Round) -> RoundResult:
        """Verify the round's draft (none in autoregressive) and say what it emits."""
