"""The draft at the gateway (docs/design.md §3.1–3.2, §3.6, §3.10): one runner, its decodes shared by the drafts
in progress (``StepBatcher``); a chain or a tree of the model's tokens, a lookup's, or both."""

from __future__ import annotations

import threading

from app.drafting.batcher import DEFAULT_BATCH_TOKENS, StepBatcher
from app.drafting.chain import chain_steps
from app.drafting.forced import with_forced_runs
from app.drafting.lookup import LookupDrafter, Record
from app.drafting.request import DraftRequest
from app.drafting.tree import tree_steps
from core.math.shapes import ChildRule, TreeShape
from core.math.tree import TokenTree
from core.names import Drafter
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
        """A chain of ``gamma`` drafted tokens (``chain_steps``), a grammar's forced ones free up to ``limit`` in all;
        ``cancel`` stops it after the token in progress. ``lookup``: the lookup's proposal alone (δ rows)."""
        await self.batcher.idle(request.session_id)
        if cancel is not None and cancel.is_set():
            return TokenTree.chain([], [])
        most = max(gamma, limit or gamma)
        if request.drafter is Drafter.LOOKUP:
            return self.lookup.chain(request, most, timing)
        branch = self.lookup.branch(request, most) if request.drafter is Drafter.MODEL_LOOKUP else None
        record = Record() if branch is not None else None
        tree = await self.batcher.run(request.session_id, chain_steps(self.batcher, request, gamma, limit, cancel, branch, record), timing)
        self.lookup.keep(request.session_id, record)
        return tree

    async def propose_tree(
        self, request: DraftRequest, shape: TreeShape, depth_limit: int | None = None, extra: int = 0, timing: dict[str, float] | None = None,
    ) -> TokenTree:
        """A tree of ``shape`` (``tree_steps``); with a grammar, its forced runs free up to ``extra`` nodes, no deeper than
        ``depth_limit`` (``with_forced_runs``); ``model+lookup`` joins the lookup's proposal as a branch."""
        await self.batcher.idle(request.session_id)
        room = depth_limit if depth_limit is not None else shape.max_depth
        if request.drafter is Drafter.LOOKUP:
            return self.lookup.chain(request, room, timing)
        branch = self.lookup.branch(request, room) if request.drafter is Drafter.MODEL_LOOKUP else None
        sampled = shape.rule is not ChildRule.FIXED
        plan = self.lookup.plan(shape, branch) if sampled and branch is not None else None  # decided before any draw
        record = Record() if branch is not None else None
        grammar = extra > 0 and request.grammar
        limit = room if grammar else 0
        left = [extra if grammar else 0]  # sampled: ``extra`` per path (a shared one would let one branch's draws shape another's)
        steps = tree_steps(self.batcher, request, shape, limit, left, sampled, branch, plan, record)
        tree = await self.batcher.run(request.session_id, steps, timing)
        if grammar and request.transformer is not None and (sampled or left[0] > 0):
            tree = with_forced_runs(tree, request.transformer, request.sequence, limit, extra if sampled else left[0], set(self.runner.info.eos_ids), sampled)
        self.lookup.keep(request.session_id, record)
        return tree

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
