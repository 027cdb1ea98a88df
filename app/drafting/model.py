"""The draft at the gateway (docs/design.md §3.1–3.2, §3.6, §3.10): one runner, its decodes shared by the drafts
in progress (``StepBatcher``); a chain or a tree from the request's drafter (the model's tokens, a lookup's, both, or another's)."""

from __future__ import annotations

import threading

from app.drafting.batcher import DEFAULT_BATCH_TOKENS, StepBatcher
from app.drafting.drafters import DRAFTERS
from app.drafting.lookup import LookupDrafter
from app.drafting.request import DraftRequest
from core.math.shapes import TreeShape
from core.math.tree import TokenTree
from core.runners import ModelRunner
from core.runners.model_thread import ModelThread


class DraftModel:
    """Proposes drafts from one runner: ``propose`` (a chain), ``propose_tree``; ``observe``, ``free`` a session."""

    def __init__(self, runner: ModelRunner, thread: ModelThread | None = None, max_batch_tokens: int = DEFAULT_BATCH_TOKENS) -> None:
        self.runner = runner
        self.batcher = StepBatcher(runner, thread, max_batch_tokens)
        self.lookup = LookupDrafter(runner.info.eos_ids)

    @property
    def vocab_size(self) -> int:
        return self.runner.info.vocab_size

    async def propose(
        self, request: DraftRequest, gamma: int, limit: int | None = None, cancel: threading.Event | None = None, timing: dict[str, float] | None = None,
    ) -> TokenTree:
        """A chain of ``gamma`` drafted tokens from the request's drafter (app.drafting.drafters), a grammar's forced ones
        free up to ``limit`` in all; ``cancel`` stops it after the token in progress."""
        await self.batcher.idle(request.session_id)
        if cancel is not None and cancel.is_set():
            return TokenTree.chain([], [])
        return await DRAFTERS[request.drafter].chain(self, request, gamma, limit, cancel, timing)

    async def propose_tree(
        self, request: DraftRequest, shape: TreeShape, depth_limit: int | None = None, extra: int = 0, timing: dict[str, float] | None = None,
    ) -> TokenTree:
        """A tree of ``shape`` from the request's drafter, no deeper than ``depth_limit``; with a grammar, its forced runs
        free up to ``extra`` nodes."""
        await self.batcher.idle(request.session_id)
        room = depth_limit if depth_limit is not None else shape.max_depth
        return await DRAFTERS[request.drafter].tree(self, request, shape, room, extra, timing)

    async def prefill(self, session_id: str, sequence: list[int]) -> None:
        """The session holds ``sequence`` (in the background: small chunks, behind the drafts waiting): its first draft
        starts from there (a late draft, app.engine.late); cancelled, it stops at its next chunk."""
        await self.batcher.idle(session_id)
        await self.batcher.run(session_id, self.batcher.prefill_steps(session_id, sequence), None, background=True)

    def observe(self, session_id: str, path: list[int]) -> None:
        """The walk of the session's last draft accepted ``path`` (``LookupDrafter.observe``)."""
        self.lookup.observe(session_id, path)

    async def free(self, session_id: str, output: list[int] | None = None) -> None:
        """Forget the session once its draft in progress ended; its ``output`` joins the suffix index."""
        await self.batcher.idle(session_id)
        self.lookup.forget(session_id, output)
        await self.batcher.thread.run(self.runner.free, session_id)
