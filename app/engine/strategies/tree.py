"""``tree``: a draft tree verified in one walk (DESIGN §3.6), on the payload the request asks."""

from __future__ import annotations

from app.engine.round import Round
from app.engine.spec import RoundResult
from app.engine.strategies.aggregate import AggregateStrategy
from app.engine.strategies.base import Strategy
from app.engine.strategies.exact import ExactStrategy
from core.names import Mode


class TreeStrategy(Strategy):
    """A row per node plus the root: aggregate's (``k: full`` or top-k, its bound reported) or
    exact's sparse one (lossless, any number of weighted workers); both walk the tree by the
    rule of how the children were chosen."""

    def __init__(self) -> None:
        self.payloads: dict[Mode, Strategy] = {Mode.AGGREGATE: AggregateStrategy(), Mode.EXACT: ExactStrategy()}

    async def verify(self, rnd: Round) -> RoundResult:
        return await self.payloads[rnd.req.spec.tree_payload].verify(rnd)
