"""DSD's overlap (docs/design.md §3.8): the draft goes on during a verify as if all were accepted; draws keyed
by position keep the output the same."""

from __future__ import annotations

import asyncio
import logging
import threading

from app.drafting.drafters import MODEL, DraftModel
from app.engine.session import Session
from app.engine.spec import GenerationRequest, RoundResult
from core.math.tree import TokenTree

log = logging.getLogger(__name__)


class Overlap:
    """The next round's draft of one session, prepared during this round's flight."""

    def __init__(self, draft: DraftModel, eos_ids: set[int]) -> None:
        self.draft, self.eos_ids = draft, eos_ids
        self.ahead: TokenTree | None = None  # the next round's draft, when its assumption held
        self._preparing: tuple[asyncio.Task[TokenTree], threading.Event] | None = None

    def take(self) -> TokenTree | None:
        """The prepared draft (once), or None."""
        ahead, self.ahead = self.ahead, None
        return ahead

    def start(
        self, session: Session, draft: TokenTree, room: int, gamma: int, keyed: GenerationRequest
    ) -> None:
        """Draft on after ``draft`` as if all of it were accepted (``keyed``: the next round's draws), when
        there is room."""
        tokens = draft.ids()
        after = room - (len(tokens) + 1)
        self._preparing = None
        if not tokens or tokens[-1] in self.eos_ids or after <= 1:
            return
        cancel = threading.Event()
        request = keyed.draft(session.id, [*session.sequence, *tokens], session.transformer, MODEL.name)
        task = asyncio.create_task(self.draft.propose(request, 1 + min(gamma, after - 1), cancel=cancel))
        task.add_done_callback(_retrieve)  # a round that fails leaves it unawaited
        self._preparing = task, cancel

    def stop(self) -> None:
        """The round failed: the prepared draft ends after the token in progress; nobody waits for it."""
        if self._preparing is not None:
            self._preparing[1].set()

    async def settle(self, draft: TokenTree, result: RoundResult) -> None:
        """Keep the prepared draft if every draft token was accepted and its first token is the round's bonus
        token."""
        if self._preparing is None:
            return
        task, cancel = self._preparing
        self._preparing = None
        result.drafting.prepared = 1
        if result.accepted < len(draft):
            cancel.set()  # its assumption failed: stop it now
        try:
            prepared = await task
        except Exception:  # logged by _retrieve; the next round drafts afresh
            return
        first = prepared.ids()[:1]
        if (
            result.accepted != len(draft)
            or first != result.tokens[-1:]
            or first[0] in self.eos_ids
            or len(prepared) < 2
        ):
            return
        self.ahead = prepared.tail(1)


def _retrieve(task: asyncio.Task[TokenTree]) -> None:
    """Mark a background draft's failure as seen (it is logged, not raised: nobody uses it)."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("a draft prepared ahead failed: %s", task.exception())
