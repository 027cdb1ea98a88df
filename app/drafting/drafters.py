"""Where a draft comes from (docs/design.md §3.10): a ``Drafter`` proposes a chain, or a tree, for a request. The
built-in ones are the draft model, lookup, and the two together; ``register`` adds another, whose name is then what
``speculative.drafter`` takes. A drafter's q̂ rows go to the verifier with its tokens, so any drafter keeps the law."""

from __future__ import annotations

import threading
from typing import Protocol

from app.drafting.batcher import StepBatcher
from app.drafting.chain import chain_steps
from app.drafting.forced import with_forced_runs
from app.drafting.lookup import LookupDrafter, Record
from app.drafting.request import DraftRequest
from app.drafting.tree import tree_steps
from core.math.shapes import ChildRule, TreeShape
from core.math.tree import TokenTree
from core.runners import ModelRunner

Timing = dict[str, float] | None


class DraftParts(Protocol):
    """What a drafter may use (``DraftModel`` has them): the model's shared decodes, the lookup, the runner."""

    batcher: StepBatcher
    lookup: LookupDrafter
    runner: ModelRunner


class Drafter:
    """A source of drafts. ``chain``: up to ``gamma`` tokens (a grammar's forced ones free up to ``limit`` in all),
    stopping after the token in progress once ``cancel`` is set; ``tree``: a tree of ``shape``, no deeper than ``room``
    (by default the chain of ``room`` tokens)."""

    name = ""
    uses_model = True  # needs the draft model's weights: a gateway without them (draft.model: none) refuses it
    grows_trees = True  # can keep a pipeline's stages busy, expanding its tree with the model (docs/design.md §3.7)
    overlaps = False  # can prepare the next round's draft while a round is verified (DSD's overlap)
    learns = False  # is told each round's accepted path (``DraftModel.observe``)

    async def chain(self, parts: DraftParts, request: DraftRequest, gamma: int, limit: int | None, cancel: threading.Event | None, timing: Timing) -> TokenTree:
        raise NotImplementedError

    async def tree(self, parts: DraftParts, request: DraftRequest, shape: TreeShape, room: int, extra: int, timing: Timing) -> TokenTree:
        return await self.chain(parts, request, room, None, None, timing)


DRAFTERS: dict[str, Drafter] = {}


def register(drafter: Drafter) -> Drafter:
    """``drafter`` under its name: a request may name it (``speculative.drafter``). A name taken is refused."""
    if not drafter.name or drafter.name in DRAFTERS:
        raise ValueError(f"a drafter needs a name of its own, got {drafter.name!r}")
    DRAFTERS[drafter.name] = drafter
    return drafter


class ModelDrafter(Drafter):
    """The draft model, a step per token; ``with_lookup``: a lookup run the model agrees with first (one decode checks it)."""

    def __init__(self, name: str, with_lookup: bool) -> None:
        self.name, self.with_lookup = name, with_lookup
        self.overlaps, self.learns = not with_lookup, with_lookup

    async def chain(self, parts: DraftParts, request: DraftRequest, gamma: int, limit: int | None, cancel: threading.Event | None, timing: Timing) -> TokenTree:
        branch = parts.lookup.branch(request, max(gamma, limit or gamma)) if self.with_lookup else None
        record = Record() if branch is not None else None
        tree = await parts.batcher.run(request.session_id, chain_steps(parts.batcher, request, gamma, limit, cancel, branch, record), timing)
        parts.lookup.keep(request.session_id, record)
        return tree

    async def tree(self, parts: DraftParts, request: DraftRequest, shape: TreeShape, room: int, extra: int, timing: Timing) -> TokenTree:
        """A tree of ``shape`` (``tree_steps``); with a grammar, its forced runs free up to ``extra`` nodes, no deeper than
        ``room`` (``with_forced_runs``); with the lookup, its proposal joins as a branch."""
        branch = parts.lookup.branch(request, room) if self.with_lookup else None
        sampled = shape.rule is not ChildRule.FIXED
        plan = parts.lookup.plan(shape, branch) if sampled and branch is not None else None  # decided before any draw
        record = Record() if branch is not None else None
        grammar = extra > 0 and request.grammar
        limit = room if grammar else 0
        left = [extra if grammar else 0]  # sampled: ``extra`` per path (a shared one would let one branch's draws shape another's)
        steps = tree_steps(parts.batcher, request, shape, limit, left, sampled, branch, plan, record)
        tree = await parts.batcher.run(request.session_id, steps, timing)
        if grammar and request.transformer is not None and (sampled or left[0] > 0):
            tree = with_forced_runs(tree, request.transformer, request.sequence, limit, extra if sampled else left[0], set(parts.runner.info.eos_ids), sampled)
        parts.lookup.keep(request.session_id, record)
        return tree


class LookupOnly(Drafter):
    """Prompt lookup, then the suffix index of recent outputs: no model step at all (q̂ = δ)."""

    name, uses_model, grows_trees = "lookup", False, False

    async def chain(self, parts: DraftParts, request: DraftRequest, gamma: int, limit: int | None, cancel: threading.Event | None, timing: Timing) -> TokenTree:
        return parts.lookup.chain(request, max(gamma, limit or gamma), timing)


MODEL = register(ModelDrafter("model", with_lookup=False))
register(LookupOnly())
register(ModelDrafter("model+lookup", with_lookup=True))
