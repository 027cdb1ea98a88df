"""A late draft (issue 49): on a long prompt the draft prefills in the background while the first rounds carry
no draft — the targets sample their token, as in ``autoregressive`` — so the first token waits for the
targets' prefill alone, not for the draft's and then the targets'. Every token is still sampled by the targets
or verified: the law of every mode holds (tests/app/test_lossless_matrix.py crosses it as an option)."""

from __future__ import annotations

import asyncio
import logging

from app.drafting.drafters import DRAFTERS, DraftModel
from app.engine.session import Session
from app.engine.spec import SpecOptions
from core.modes import MODES

log = logging.getLogger(__name__)


def waits_for_a_model(spec: SpecOptions) -> bool:
    """Whether the mode's draft comes from a draft model that must prefill (lookup alone has nothing to wait
    for)."""
    return MODES[spec.mode].drafts and DRAFTERS[spec.drafter].uses_model


class LateDraft:
    """The draft's prefill of one session and which rounds go without it: the first ``draft_after`` for
    certain; then a seeded request waits for the draft (how many rounds carry none is a function of the
    request, never of timing), an unseeded one goes on without it until its prefill ends. The prefill starts
    at once, beside the targets'; with ``wait``, after the first round (where the draft and the targets share
    cores, it would slow the first token)."""

    def __init__(self, draft: DraftModel, session: Session, wait: bool = False) -> None:
        self.draft, self.session_id, self.sequence = draft, session.id, list(session.sequence)
        self.left, self.seeded = session.req.draft_after, session.req.seeded
        self.task: asyncio.Task[None] | None = None
        self.first = True  # the first round is next
        if not wait:
            self._start()

    @classmethod
    def start(cls, draft: DraftModel, session: Session, wait: bool = False) -> LateDraft | None:
        """The session's late draft; None when every round drafts as before (``draft_after`` 0, a mode or
        drafter with no draft model to wait for, no room for a second round)."""
        req = session.req
        if req.draft_after <= 0 or not waits_for_a_model(req.spec) or session.room() <= 1:
            return None
        return cls(draft, session, wait)

    def skips(self) -> bool:
        """Whether the next round carries no draft (asked once per round the targets verify). A prefill that
        waited for the first round starts after it — unless the next round drafts anyway (seeded): its draft
        prefills in its place."""
        first, self.first = self.first, False
        if self.left > 0:
            self.left -= 1
            if not first:
                self._start()
            return True
        if self.seeded:
            # the draft waits for a prefill in progress (``DraftModel.propose``), or decodes what it lacks
            return False
        self._start()
        assert self.task is not None
        return not self.task.done()

    async def close(self) -> None:
        """The choice ended: a prefill still running stops at its next chunk."""
        if self.task is None:
            return
        if not self.task.done():
            self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    def _start(self) -> None:
        if self.task is None:
            self.task = asyncio.create_task(self.draft.prefill(self.session_id, self.sequence))
            self.task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Task[None]) -> None:
    """A prefill's failure is logged, not raised: the first draft decodes what it lacks, and meets the same
    error there."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("a draft's background prefill failed: %s", task.exception())
