"""The draft at the gateway (docs/design.md §3.1–3.2, §3.6, §3.10): ``DraftModel``, one runner whose decodes
the drafts in progress share (``StepBatcher``), and where each draft comes from: a ``Drafter`` proposes a
chain, or a tree, for a request. The built-in ones are the draft model, lookup, and the two together;
``register`` adds another, whose name is then what ``speculative.drafter`` takes. A drafter's q̂ rows go to
the verifier with its tokens, so any drafter keeps the law."""

from __future__ import annotations

import threading

from app.drafting.batcher import DEFAULT_BATCH_TOKENS, DraftSeconds, StepBatcher
from app.drafting.chain import chain_steps
from app.drafting.forced import with_forced_runs
from app.drafting.lookup import LookupDrafter, Record
from app.drafting.request import DraftRequest
from app.drafting.tree import tree_steps
from core.math.shapes import ChildRule, TreeShape
from core.math.tree import TokenTree
from core.runners import ModelRunner
from core.runners.model_thread import ModelThread


class Drafter:
    """A source of drafts, using what the gateway's ``draft`` holds (its runner, shared decodes, lookup).
    ``chain``: up to ``gamma`` tokens (a grammar's forced ones free up to ``limit`` in all), stopping after
    the token in progress once ``cancel`` is set; ``tree``: a tree of ``shape``, no deeper than ``room`` (by
    default the chain of ``room`` tokens)."""

    name = ""
    # needs the draft model's weights: a gateway without them (draft.model: none) refuses it
    uses_model = True
    # can keep a pipeline's stages busy, expanding its tree with the model (docs/design.md §3.7)
    grows_trees = True
    overlaps = False  # can prepare the next round's draft while a round is verified (DSD's overlap)
    learns = False  # is told each round's accepted path (``DraftModel.observe``)

    async def chain(
        self,
        draft: DraftModel,
        request: DraftRequest,
        gamma: int,
        limit: int | None,
        cancel: threading.Event | None,
        timing: DraftSeconds | None,
    ) -> TokenTree:
        raise NotImplementedError

    async def tree(
        self,
        draft: DraftModel,
        request: DraftRequest,
        shape: TreeShape,
        room: int,
        extra: int,
        timing: DraftSeconds | None,
    ) -> TokenTree:
        return await self.chain(draft, request, room, None, None, timing)


DRAFTERS: dict[str, Drafter] = {}


def register(drafter: Drafter) -> Drafter:
    """``drafter`` under its name: a request may name it (``speculative.drafter``). A name taken is
    refused."""
    if not drafter.name or drafter.name in DRAFTERS:
        raise ValueError(f"a drafter needs a name of its own, got {drafter.name!r}")
    DRAFTERS[drafter.name] = drafter
    return drafter


class ModelDrafter(Drafter):
    """The draft model, a step per token; ``with_lookup``: a lookup run the model agrees with first (one
    decode checks it)."""

    def __init__(self, name: str, with_lookup: bool) -> None:
        self.name, self.with_lookup, self.overlaps, self.learns = (
            name,
            with_lookup,
            not with_lookup,
            with_lookup,
        )

    async def chain(
        self,
        draft: DraftModel,
        request: DraftRequest,
        gamma: int,
        limit: int | None,
        cancel: threading.Event | None,
        timing: DraftSeconds | None,
    ) -> TokenTree:
        branch = draft.lookup.branch(request, max(gamma, limit or gamma)) if self.with_lookup else None
        record = Record() if branch is not None else None
        tree = await draft.batcher.run(
            request.session_id,
            chain_steps(draft.batcher, request, gamma, limit, cancel, branch, record),
            timing,
        )
        draft.lookup.keep(request.session_id, record)
        return tree

    async def tree(
        self,
        draft: DraftModel,
        request: DraftRequest,
        shape: TreeShape,
        room: int,
        extra: int,
        timing: DraftSeconds | None,
    ) -> TokenTree:
        """A tree of ``shape`` (``tree_steps``); with a grammar, its forced runs free up to ``extra`` nodes,
        no deeper than ``room`` (``with_forced_runs``); with the lookup, its proposal joins as a branch."""
        branch = draft.lookup.branch(request, room) if self.with_lookup else None
        sampled = shape.rule is not ChildRule.FIXED
        # decided before any draw
        plan = draft.lookup.plan(shape, branch) if sampled and branch is not None else None
        record = Record() if branch is not None else None
        grammar = extra > 0 and request.grammar
        limit = room if grammar else 0
        # sampled: ``extra`` per path (a shared one would let one branch's draws shape another's)
        left = [extra if grammar else 0]
        steps = tree_steps(draft.batcher, request, shape, limit, left, sampled, branch, plan, record)
        tree = await draft.batcher.run(request.session_id, steps, timing)
        if grammar and request.transformer is not None and (sampled or left[0] > 0):
            tree = with_forced_runs(
                tree,
                request.transformer,
                request.sequence,
                limit,
                extra if sampled else left[0],
                set(draft.runner.info.eos_ids),
                sampled,
            )
        draft.lookup.keep(request.session_id, record)
        return tree


class LookupOnly(Drafter):
    """Prompt lookup, then the suffix index of recent outputs: no model step at all (q̂ = δ)."""

    name, uses_model, grows_trees = "lookup", False, False

    async def chain(
        self,
        draft: DraftModel,
        request: DraftRequest,
        gamma: int,
        limit: int | None,
        cancel: threading.Event | None,
        timing: DraftSeconds | None,
    ) -> TokenTree:
        return draft.lookup.chain(request, max(gamma, limit or gamma), timing)


MODEL = register(ModelDrafter("model", with_lookup=False))
register(LookupOnly())
register(ModelDrafter("model+lookup", with_lookup=True))


class DraftModel:
    """Proposes drafts from one runner: ``propose`` (a chain), ``propose_tree``; ``observe``, ``free`` a
    session."""

    def __init__(
        self,
        runner: ModelRunner,
        thread: ModelThread | None = None,
        max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
    ) -> None:
        self.runner = runner
        self.batcher = StepBatcher(runner, thread, max_batch_tokens)
        self.lookup = LookupDrafter(runner.info.eos_ids)

    @property
    def vocab_size(self) -> int:
        return self.runner.info.vocab_size

    async def propose(
        self,
        request: DraftRequest,
        gamma: int,
        limit: int | None = None,
        cancel: threading.Event | None = None,
        timing: DraftSeconds | None = None,
    ) -> TokenTree:
        """A chain of ``gamma`` drafted tokens from the request's drafter (``DRAFTERS``), a grammar's forced
        ones free up to ``limit`` in all; ``cancel`` stops it after the token in progress."""
        await self.batcher.idle(request.session_id)
        if cancel is not None and cancel.is_set():
            return TokenTree.chain([], [])
        return await DRAFTERS[request.drafter].chain(self, request, gamma, limit, cancel, timing)

    async def propose_tree(
        self,
        request: DraftRequest,
        shape: TreeShape,
        depth_limit: int | None = None,
        extra: int = 0,
        timing: DraftSeconds | None = None,
    ) -> TokenTree:
        """A tree of ``shape`` from the request's drafter, no deeper than ``depth_limit``; with a grammar, its
        forced runs free up to ``extra`` nodes."""
        await self.batcher.idle(request.session_id)
        room = depth_limit if depth_limit is not None else shape.max_depth
        return await DRAFTERS[request.drafter].tree(self, request, shape, room, extra, timing)

    async def prefill(self, session_id: str, sequence: list[int]) -> None:
        """The session holds ``sequence`` (in the background: small chunks, behind the drafts waiting): its
        first draft starts from there (a late draft, app.engine.late); cancelled, it stops at its next
        chunk."""
        await self.batcher.idle(session_id)
        await self.batcher.run(
            session_id, self.batcher.prefill_steps(session_id, sequence), None, background=True
        )

    def observe(self, session_id: str, path: list[int]) -> None:
        """The walk of the session's last draft accepted ``path`` (``LookupDrafter.observe``)."""
        self.lookup.observe(session_id, path)

    async def free(self, session_id: str, output: list[int] | None = None) -> None:
        """Forget the session once its draft in progress ended; its ``output`` joins the suffix index."""
        await self.batcher.idle(session_id)
        self.lookup.forget(session_id, output)
        await self.batcher.thread.run(self.runner.free, session_id)
