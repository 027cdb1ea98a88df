"""How a mode runs a choice (docs/design.md §3): round by round in the engine's loop, which calls its
``RoundStrategy``'s ``verify``; or, for a mode driven by something else than rounds (a pipeline's segment
arrivals), its own loop (``LoopStrategy``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from typing import Protocol

from app.drafting import DraftModel
from app.engine.round import Round
from app.engine.session import Session
from app.engine.spec import GenerationRequest, RoundResult
from app.targets.pool import TargetSet
from core.transform import LogitsTransform


class EngineView(Protocol):
    """What a strategy uses of the engine (``app.engine.loop.Engine``)."""

    draft: DraftModel
    pool: TargetSet
    vocab_size: int
    prefill_waits: bool

    def transformer(self, req: GenerationRequest) -> LogitsTransform | None: ...


class LoopStrategy(ABC):
    @abstractmethod
    def run(self, engine: EngineView, session: Session) -> AsyncGenerator[RoundResult, None]:
        """The results of one choice, until one carries a finish reason."""


class RoundStrategy(ABC):
    @abstractmethod
    async def verify(self, rnd: Round) -> RoundResult:
        """Verify the round's draft (none in autoregressive) and say what it emits."""
